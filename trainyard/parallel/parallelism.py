"""`Parallelism`: a job's `distribution`, parsed once into one typed value that flows down.

Forms accepted (the SDK passes whichever the user wrote; `init()` and `transform()` take them too):

- Trainyard's typed form:

      {"mics": {"partition_group_size": p, "hierarchical_allgather": true|false|null,
                "reshard_after_forward": true|false|n, "two_hop_sync": true|false,
                "replica_sync": "bucketed"|"native", "replica_bucket_mb": x,
                "replica_compression": null|"bf16"|"int8", "hierarchical_chunks": c, "cpu_offload": true|false},
       "tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "context_parallel_degree": cp,
       "expert_parallel_degree": ep, "pipeline_schedule": "gpipe"|"1f1b"|"interleaved_1f1b", "virtual_stages": v,
       "microbatches": m|null,
       "pipeline_split": [blocks per stage, pp * v of them]|null,
       "gradient_accumulation_steps": s|null, "activation_checkpointing": "none"|"full"|"selective",
       "mixed_precision": "bf16"|"fp32"|null, "gradient_clipping": float|null}

- SageMaker's: `{"torch_distributed": {"enabled": True}}` (plain data parallel: ZeRO-3 over the data-parallel
  ranks); SMP v2 `smdistributed.modelparallel.parameters.hybrid_shard_degree` and `tensor_parallel_degree`;
  SMP v2 `context_parallel_degree` and `expert_parallel_degree`;
  SMP v1 `sharded_data_parallel_degree` with `sdp_hierarchical_allgather` and `sdp_gradient_clipping`,
  `tensor_parallel_degree`, `pipeline_parallel_degree` (alias `partitions`), `microbatches` and `pipeline`
  ("simple": gpipe; "interleaved", which interleaves forward and backward: 1f1b). Keys of the launchers
  (`mpi`, `torch_distributed`, `pytorchddp`, ...) say how processes start and do not change the layout.
  Typed keys win over mapped ones.

The world is tp x cp x pp x dp ranks: tensor parallelism inside a host, cp context-parallel ranks splitting
the sequence (inside a host), pp pipeline stages, and dp = world / (tp x cp x pp) data-parallel ranks in MiCS
partition groups of p (default dp: ZeRO-3 over the data-parallel ranks); the model states are sharded over
the p x cp ranks of a partition group and its context-parallel ranks. Torch-free: the SDK parses and checks a distribution with this module before anything starts.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from trainyard.parallel.dims import ParallelDims
from trainyard.parallel.layout import PIPELINE_SCHEDULES, check_pipeline
from trainyard.errors import did_you_mean

# ParallelDims' short names of the degrees, as its errors use them, and the distribution keys they are
_DIM_NAMES = {"tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree", "cp": "context_parallel_degree",
              "ep": "expert_parallel_degree", "dp_shard": "mics.partition_group_size",
              "dp_replicate": "the MiCS replicas: the data-parallel degree / mics.partition_group_size"}

MICS_KEYS = ("partition_group_size", "hierarchical_allgather", "reshard_after_forward", "two_hop_sync",
             "replica_sync", "replica_bucket_mb", "replica_compression", "hierarchical_chunks", "cpu_offload")
REPLICA_SYNCS = ("bucketed", "native")
REPLICA_COMPRESSIONS = ("bf16", "int8")
AC_MODES = ("none", "full", "selective")
PRECISIONS = ("bf16", "fp32")
SMP_PIPELINES = {"simple": "gpipe", "interleaved": "1f1b"}  # SMP v1 `pipeline` -> pipeline_schedule
_TYPED_KEYS = ("mics", "tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
               "expert_parallel_degree", "pipeline_schedule", "virtual_stages",
               "microbatches", "pipeline_split", "gradient_accumulation_steps", "activation_checkpointing",
               "mixed_precision", "gradient_clipping")
# SageMaker's launcher keys: how processes start, not how the model is laid out
_LAUNCHER_KEYS = ("smdistributed", "torch_distributed", "pytorchddp", "mpi", "parameter_server", "dataparallel",
                  "instance_groups", "multi_worker_mirrored_strategy")


def _positive_int(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 1


@dataclass(kw_only=True, slots=True)
class Parallelism:
    """How a job lays out its model; every check that needs no world size runs in `__post_init__`."""

    tensor_parallel_degree: int = 1
    """Ranks one layer's matrices are split over (inside a host)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages (ranks) the blocks are cut into."""
    context_parallel_degree: int = 1
    """Ranks one sequence is split over (zig-zag chunks, exact ring attention; inside a host). They see the same
    rows and share the MiCS partition group: model states are sharded over partition_group_size x this."""
    expert_parallel_degree: int = 1
    """Data-parallel ranks a mixture of experts' experts are spread over (each holds n_experts / this; tokens go to
    their experts by all-to-all). The rest of the model is sharded by MiCS as without it."""
    partition_group_size: int | None = None
    """MiCS partition group p: model states sharded over p data-parallel ranks (None: all of them, ZeRO-3)."""
    hierarchical_allgather: bool | None = None
    """Two-hop collectives for partition groups spanning hosts (None: exactly when they do)."""
    reshard_after_forward: bool | int = True
    """True ZeRO-3-like, False ZeRO-2-like, n hpZ-like (regather from groups of n ranks in backward)."""
    two_hop_sync: bool = True
    """Under gradient accumulation, all-reduce across replicas on the last micro-batch only."""
    replica_sync: str = "bucketed"
    """That all-reduce: "bucketed" (Trainyard's, overlapped with the backward) or "native" (FSDP2's HSDP)."""
    replica_bucket_mb: float = 4.0
    """Bucket size of the bucketed sync (MiB of fp32 gradient shard)."""
    replica_compression: str | None = None
    """What the bucketed sync sends: null (exact fp32), "bf16" or "int8" (with error feedback)."""
    hierarchical_chunks: int = 4
    """Pieces the hierarchical all-gather is pipelined in (1: its two hops one after the other)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer states in host memory (FSDP2's CPU offload; GPUs
    only). Replicas then sync through FSDP2's native all-reduce, on the GPU before the gradients leave it."""
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int | None = None
    pipeline_split: list[int] | None = None
    """Blocks per stage (pp x virtual_stages entries); None cuts them evenly."""
    gradient_accumulation_steps: int | None = None
    activation_checkpointing: str = "none"
    mixed_precision: str | None = None
    gradient_clipping: float | None = None

    def __post_init__(self) -> None:
        for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                    "expert_parallel_degree", "virtual_stages"):
            if not _positive_int(getattr(self, key)):
                raise ValueError(f"distribution: {key} must be an integer >= 1, got {getattr(self, key)!r}")
        for key in ("partition_group_size", "microbatches", "gradient_accumulation_steps"):
            v = getattr(self, key)
            if v is not None and not _positive_int(v):
                raise ValueError(f"distribution: {key} must be an integer >= 1 or null, got {v!r}")
        if self.hierarchical_allgather not in (None, True, False):
            raise ValueError("distribution: hierarchical_allgather must be true, false or null, got "
                             f"{self.hierarchical_allgather!r}")
        r = self.reshard_after_forward
        if not isinstance(r, bool) and not _positive_int(r):
            raise ValueError(f"distribution: reshard_after_forward must be true, false or an int >= 1, got {r!r}")
        if not isinstance(self.two_hop_sync, bool):
            raise ValueError(f"distribution: two_hop_sync must be true or false, got {self.two_hop_sync!r}")
        if self.replica_sync not in REPLICA_SYNCS:
            raise ValueError(f"distribution: mics.replica_sync must be one of {list(REPLICA_SYNCS)}, got "
                             f"{self.replica_sync!r}")
        if self.replica_compression is not None and self.replica_compression not in REPLICA_COMPRESSIONS:
            raise ValueError(f"distribution: mics.replica_compression must be one of {list(REPLICA_COMPRESSIONS)} "
                             f"or null, got {self.replica_compression!r}")
        if self.replica_compression is not None and self.replica_sync != "bucketed":
            raise ValueError("distribution: mics.replica_compression needs mics.replica_sync 'bucketed' (FSDP2's "
                             "native sync sends fp32); drop one of them")
        if not isinstance(self.cpu_offload, bool):
            raise ValueError(f"distribution: mics.cpu_offload must be true or false, got {self.cpu_offload!r}")
        if self.cpu_offload and self.replica_compression is not None:
            raise ValueError("distribution: mics.replica_compression needs the bucketed replica sync, and with "
                             "mics.cpu_offload the replicas sync through FSDP2's native all-reduce (the gradients "
                             "leave the GPU right after their reduce-scatter); drop one of them")
        mb = self.replica_bucket_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:
            raise ValueError(f"distribution: mics.replica_bucket_mb must be a number > 0, got {mb!r}")
        if not _positive_int(self.hierarchical_chunks):
            raise ValueError(f"distribution: mics.hierarchical_chunks must be an integer >= 1, got "
                             f"{self.hierarchical_chunks!r}")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(f"distribution: activation_checkpointing must be one of {list(AC_MODES)}, got "
                             f"{self.activation_checkpointing!r}")
        if self.mixed_precision is not None and self.mixed_precision not in PRECISIONS:
            raise ValueError(f"distribution: mixed_precision must be one of {list(PRECISIONS)}, got "
                             f"{self.mixed_precision!r}")
        clip = self.gradient_clipping
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
            raise ValueError(f"distribution: gradient_clipping must be a number >= 0, got {clip!r}")
        split = self.pipeline_split
        if split is not None:
            if not isinstance(split, (list, tuple)) or not all(_positive_int(n) for n in split):
                raise ValueError(f"distribution: pipeline_split must be a list of block counts (integers >= 1), one "
                                 f"per stage, got {split!r}")
            self.pipeline_split = list(split)
            if len(split) != self.stages:
                raise ValueError(f"distribution: pipeline_split has {len(split)} entries; it needs one per stage: "
                                 f"pipeline_parallel_degree {self.pipeline_parallel_degree} x virtual_stages "
                                 f"{self.virtual_stages} = {self.stages}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"distribution: pipeline_schedule must be one of {list(PIPELINE_SCHEDULES)}, got "
                             f"{self.pipeline_schedule!r}")
        try:
            check_pipeline(pp=self.pipeline_parallel_degree, schedule=self.pipeline_schedule,
                           virtual_stages=self.virtual_stages, microbatches=self.microbatches, split=self.pipeline_split)
        except ValueError as e:
            raise ValueError(f"distribution: {e}") from None

    @property
    def tp(self) -> int:
        return self.tensor_parallel_degree

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_degree

    @property
    def cp(self) -> int:
        return self.context_parallel_degree

    @property
    def ep(self) -> int:
        return self.expert_parallel_degree

    @property
    def stages(self) -> int:
        return self.pipeline_parallel_degree * self.virtual_stages

    @classmethod
    def parse(cls, distribution: dict[str, Any] | None) -> "Parallelism":
        """The typed value of a `distribution` in any accepted form (ValueError naming the key otherwise)."""
        distribution = dict(distribution or {})
        unknown = [k for k in distribution if k not in _TYPED_KEYS and k not in _LAUNCHER_KEYS]
        if unknown:
            named = ", ".join(f"{k!r}{did_you_mean(str(k), _TYPED_KEYS + _LAUNCHER_KEYS)}" for k in unknown)
            raise ValueError(f"distribution: unknown key(s) {named}; known: {sorted(_TYPED_KEYS)} and SageMaker's "
                             f"{sorted(_LAUNCHER_KEYS)}")
        _check_enabled_flags(distribution)
        mics = distribution.pop("mics", None) or {}
        if not isinstance(mics, dict):
            raise ValueError(f"distribution: mics must be a dict of {list(MICS_KEYS)}, got {mics!r}")
        bad = [k for k in mics if k not in MICS_KEYS]
        if bad:
            named = ", ".join(f"'mics.{k}'{did_you_mean(str(k), MICS_KEYS, prefix='mics.')}" for k in bad)
            raise ValueError(f"distribution: unknown key(s) {named}; known in mics: {list(MICS_KEYS)}")
        mics = dict(mics)
        smp = (distribution.get("smdistributed") or {}).get("modelparallel") or {}
        if smp.get("enabled"):
            mapped_mics, mapped = _from_smp(smp.get("parameters") or {})
            mics = {**mapped_mics, **mics}
            distribution = {**mapped, **distribution}
        # a null means the default (the typed form writes nulls for the keys whose default is null)
        typed = {k: distribution[k] for k in _TYPED_KEYS if distribution.get(k) is not None and k != "mics"}
        return cls(**mics, **typed)

    def dims(self, *, world_size: int, processes_per_host: int) -> ParallelDims:
        """The host-aware layout of this parallelism on a world (ValueError naming the degrees otherwise)."""
        tp, pp, cp = self.tp, self.pp, self.cp
        dp = self.data_parallel_degree(world_size)
        p = self.partition_group_size or dp
        if dp % p:
            named = f" x context_parallel_degree {cp}" if cp > 1 else ""
            raise ValueError(f"distribution: partition_group_size {p} must divide the data-parallel degree {dp} = "
                             f"world size {world_size} / (tensor_parallel_degree {tp} x pipeline_parallel_degree "
                             f"{pp}{named}); choose a divisor of {dp}")
        try:
            return ParallelDims(dp_replicate=dp // p, dp_shard=p, cp=cp, tp=tp, pp=pp, ep=self.ep,
                                world_size=world_size, processes_per_host=processes_per_host)
        except ValueError as e:
            used = [f"{short} is {name}" for short, name in _DIM_NAMES.items() if re.search(rf"\b{short}\b", str(e))]
            raise ValueError(f"distribution: {e}" + (f" ({', '.join(used)})" if used else "")) from None

    def data_parallel_degree(self, world_size: int) -> int:
        """The ranks that see different data: the world over the tensor-, pipeline- and context-parallel degrees."""
        n = self.tp * self.pp * self.cp
        if world_size % n:
            named = f" x context_parallel_degree {self.cp}" if self.cp > 1 else ""
            raise ValueError(f"distribution: tensor_parallel_degree {self.tp} x pipeline_parallel_degree {self.pp}"
                             f"{named} = {n} must divide the world size {world_size} (hosts x processes per host); "
                             f"choose degrees whose product divides {world_size}")
        return world_size // n

    def to_dict(self) -> dict[str, Any]:
        """The typed form, every key."""
        d = dataclasses.asdict(self)
        mics = {k: d.pop(k) for k in MICS_KEYS}
        return {"mics": mics, **d}

    def to_env(self) -> str:
        """The typed form as `TRAINYARD_DISTRIBUTION` carries it to the engine: JSON of the keys that differ from
        their defaults (`parse` fills those in again), so that it fits SageMaker's 512 characters a variable."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        d = {k: v for k, v in dataclasses.asdict(self).items() if v != defaults[k] or k == "partition_group_size"}
        mics = {k: d.pop(k) for k in MICS_KEYS if k in d}
        return json.dumps({"mics": mics, **d}, separators=(",", ":"))


def _from_smp(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """SMP v1/v2 `parameters` as (mics keys, typed top-level keys)."""
    mics: dict[str, Any] = {}
    for key in ("hybrid_shard_degree", "sharded_data_parallel_degree"):
        if params.get(key):  # SMP v2 / v1 partition size
            mics.setdefault("partition_group_size", params[key])
    if "sdp_hierarchical_allgather" in params:
        mics["hierarchical_allgather"] = params["sdp_hierarchical_allgather"]
    out: dict[str, Any] = {}
    if "sdp_gradient_clipping" in params:
        out["gradient_clipping"] = params["sdp_gradient_clipping"]
    if "pipeline_parallel_degree" in params and "partitions" in params \
            and params["pipeline_parallel_degree"] != params["partitions"]:
        raise ValueError(f"distribution: smdistributed: partitions ({params['partitions']!r}) is an alias of "
                         f"pipeline_parallel_degree ({params['pipeline_parallel_degree']!r}); give one of them")
    for key, src in (("tensor_parallel_degree", "tensor_parallel_degree"),
                     ("context_parallel_degree", "context_parallel_degree"),
                     ("expert_parallel_degree", "expert_parallel_degree"),
                     ("pipeline_parallel_degree", "pipeline_parallel_degree"),
                     ("pipeline_parallel_degree", "partitions"), ("microbatches", "microbatches")):
        if src in params:
            out.setdefault(key, params[src])
    if "pipeline" in params:
        if params["pipeline"] not in SMP_PIPELINES:
            raise ValueError(f"distribution: smdistributed: pipeline must be one of {list(SMP_PIPELINES)}, got "
                             f"{params['pipeline']!r}; or give pipeline_schedule")
        out["pipeline_schedule"] = SMP_PIPELINES[params["pipeline"]]
    return mics, out


def _check_enabled_flags(distribution: dict, path: str = "") -> None:
    """SageMaker's `{"torch_distributed": {"enabled": True}}` and the like: every `enabled` is a bool (the string
    "false" is true in Python, and would turn on what it means to turn off)."""
    for key, value in distribution.items():
        name = f"{path}{key}"
        if key == "enabled" and not isinstance(value, bool):
            raise ValueError(f"distribution: {name} must be true or false, got {value!r} ({type(value).__name__})")
        if isinstance(value, dict):
            _check_enabled_flags(value, f"{name}.")


def asks_for_launcher(distribution: dict[str, Any] | None) -> bool:
    """Whether `distribution` asks for processes started together by a launcher (torchrun): any of Trainyard's
    keys, or a SageMaker launcher turned on (`{"torch_distributed": {"enabled": True}}`, `mpi`, `smdistributed`'s
    `dataparallel` or `modelparallel`, ...). None, {}, or launchers all turned off: SageMaker runs the entry point
    as plain `python`, once per host, and so does Trainyard."""
    def on(value: object) -> bool:
        if isinstance(value, dict):
            if "enabled" in value:
                return value["enabled"] is True
            return any(on(v) for v in value.values() if isinstance(v, dict))
        return bool(value)

    return any(key in _TYPED_KEYS and value is not None or key in _LAUNCHER_KEYS and on(value)
               for key, value in (distribution or {}).items())
