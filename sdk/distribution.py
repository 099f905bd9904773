"""`distribution`: Trainyard's typed form, and SageMaker's forms mapped onto it.

Typed form (what the engine reads from `TRAINYARD_DISTRIBUTION`):

    {"mics": {"partition_group_size": p, "hierarchical_allgather": true|false|null,
              "reshard_after_forward": true|false|n, "two_hop_sync": true|false},
     "tensor_parallel_degree": tp, "pipeline_parallel_degree": pp,
     "pipeline_schedule": "gpipe"|"1f1b"|"interleaved_1f1b", "virtual_stages": v, "microbatches": m|null,
     "pipeline_split": [layers per stage, pp * v of them]|null,
     "gradient_accumulation_steps": s|null, "activation_checkpointing": "none"|"full"|"selective",
     "mixed_precision": "bf16"|"fp32"|null, "gradient_clipping": float|null}

The world is tp x pp x dp ranks: tensor parallelism inside a host, pp pipeline stages, and dp = world /
(tp x pp) data-parallel ranks in MiCS partition groups of p (default dp: ZeRO-3 over the data-parallel ranks).

SageMaker forms accepted: `{"torch_distributed": {"enabled": True}}` (plain data parallel: ZeRO-3 over
the world); SMP v2 `smdistributed.modelparallel.parameters.hybrid_shard_degree` and
`tensor_parallel_degree`; SMP v1 `sharded_data_parallel_degree` with `sdp_hierarchical_allgather` and
`sdp_gradient_clipping`, `tensor_parallel_degree`, `pipeline_parallel_degree` (alias `partitions`),
`microbatches` and `pipeline` ("simple": gpipe; "interleaved", which interleaves forward and backward: 1f1b).
Typed keys win over mapped ones. Impossible layouts are refused when the Estimator is built.
"""
from __future__ import annotations

from typing import Any

from trainyard.sdk.errors import ConfigError

MICS_KEYS = ("partition_group_size", "hierarchical_allgather", "reshard_after_forward", "two_hop_sync")
AC_MODES = ("none", "full", "selective")  # the same as trainyard.engine.distributed.ac (which imports torch)
PRECISIONS = ("bf16", "fp32")
SMP_PIPELINES = {"simple": "gpipe", "interleaved": "1f1b"}  # SMP v1 `pipeline` -> pipeline_schedule


def _positive_int(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 1


def _smp(params: dict[str, Any]) -> dict[str, Any]:
    """The typed top-level keys that SMP v1/v2 `parameters` map to."""
    out: dict[str, Any] = {}
    if "pipeline_parallel_degree" in params and "partitions" in params \
            and params["pipeline_parallel_degree"] != params["partitions"]:
        raise ConfigError("distribution", f"smdistributed: partitions ({params['partitions']!r}) is an alias of "
                                          f"pipeline_parallel_degree ({params['pipeline_parallel_degree']!r}); "
                                          "give one of them")
    for key, src in (("tensor_parallel_degree", "tensor_parallel_degree"),
                     ("pipeline_parallel_degree", "pipeline_parallel_degree"),
                     ("pipeline_parallel_degree", "partitions"), ("microbatches", "microbatches")):
        if src in params:
            out.setdefault(key, params[src])
    if "pipeline" in params:
        if params["pipeline"] not in SMP_PIPELINES:
            raise ConfigError("distribution", f"smdistributed: pipeline must be one of {list(SMP_PIPELINES)}, got "
                                              f"{params['pipeline']!r}; or give pipeline_schedule")
        out["pipeline_schedule"] = SMP_PIPELINES[params["pipeline"]]
    return out


def normalize(distribution: dict[str, Any], *, world_size: int, processes_per_host: int) -> dict[str, Any]:
    """The typed form of `distribution`, checked against the job's layout."""
    mics = dict(distribution.get("mics") or {})
    unknown = sorted(set(mics) - set(MICS_KEYS))
    if unknown:
        raise ConfigError("distribution", f"mics: unknown key(s) {unknown}; known: {list(MICS_KEYS)}")
    smp = ((distribution.get("smdistributed") or {}).get("modelparallel") or {})
    if smp.get("enabled"):
        params = smp.get("parameters") or {}
        for key in ("hybrid_shard_degree", "sharded_data_parallel_degree"):
            if params.get(key):  # SMP v2 / v1 partition size
                mics.setdefault("partition_group_size", params[key])
        if "sdp_hierarchical_allgather" in params:
            mics.setdefault("hierarchical_allgather", params["sdp_hierarchical_allgather"])
        if "sdp_gradient_clipping" in params:
            distribution = {"gradient_clipping": params["sdp_gradient_clipping"], **distribution}
        distribution = {**_smp(params), **distribution}
    degrees = {}
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "virtual_stages"):
        degrees[key] = distribution.get(key, 1)
        if not _positive_int(degrees[key]):
            raise ConfigError("distribution", f"{key} must be an integer >= 1, got {degrees[key]!r}")
    tp, pp, v = degrees["tensor_parallel_degree"], degrees["pipeline_parallel_degree"], degrees["virtual_stages"]
    if world_size % (tp * pp):
        raise ConfigError("distribution", f"tensor_parallel_degree {tp} x pipeline_parallel_degree {pp} = {tp * pp} "
                                          f"must divide the world size {world_size} (instance_count x "
                                          f"processes_per_host); choose degrees whose product divides {world_size}")
    dp = world_size // (tp * pp)
    p = mics.get("partition_group_size", dp)
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ConfigError("distribution", f"partition_group_size must be an integer >= 1, got {p!r}")
    if dp % p:
        raise ConfigError("distribution", f"partition_group_size {p} must divide the data-parallel degree {dp} = "
                                          f"world size {world_size} / (tensor_parallel_degree {tp} x "
                                          f"pipeline_parallel_degree {pp}); choose a divisor of {dp}")
    h = mics.get("hierarchical_allgather")
    if h not in (None, True, False):
        raise ConfigError("distribution", f"hierarchical_allgather must be true, false or null, got {h!r}")
    r = mics.get("reshard_after_forward", True)
    if not isinstance(r, bool) and (not isinstance(r, int) or r < 1):
        raise ConfigError("distribution", f"reshard_after_forward must be true, false or an int >= 1, got {r!r}")
    from trainyard.engine.distributed.dims import ParallelDims

    try:
        ParallelDims(dp_replicate=dp // p, dp_shard=p, tp=tp, pp=pp, world_size=world_size,
                     processes_per_host=processes_per_host)
    except ValueError as e:
        raise ConfigError("distribution", f"{e}; tp is tensor_parallel_degree, dp_shard is "
                                          "mics.partition_group_size") from None
    schedule = distribution.get("pipeline_schedule", "1f1b")
    m = distribution.get("microbatches")
    if m is not None and not _positive_int(m):
        raise ConfigError("distribution", f"microbatches must be an integer >= 1 or null, got {m!r}")
    split = distribution.get("pipeline_split")
    if split is not None:
        if not isinstance(split, (list, tuple)) or not all(_positive_int(n) for n in split):
            raise ConfigError("distribution", f"pipeline_split must be a list of layer counts (integers >= 1), one "
                                              f"per stage, got {split!r}")
        if len(split) != pp * v:
            raise ConfigError("distribution", f"pipeline_split has {len(split)} entries; it needs one per stage: "
                                              f"pipeline_parallel_degree {pp} x virtual_stages {v} = {pp * v}")
        split = list(split)
    from trainyard.engine.distributed.layout import check_pipeline

    try:
        check_pipeline(pp=pp, schedule=schedule, virtual_stages=v, microbatches=m, split=split)
    except ValueError as e:
        raise ConfigError("distribution", str(e)) from None
    two_hop = mics.get("two_hop_sync", True)
    if not isinstance(two_hop, bool):
        raise ConfigError("distribution", f"two_hop_sync must be true or false, got {two_hop!r}")
    s = distribution.get("gradient_accumulation_steps")
    if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
        raise ConfigError("distribution", f"gradient_accumulation_steps must be an integer >= 1, got {s!r}")
    ac = distribution.get("activation_checkpointing", "none")
    if ac not in AC_MODES:
        raise ConfigError("distribution", f"activation_checkpointing must be one of {list(AC_MODES)}, got {ac!r}")
    mp = distribution.get("mixed_precision")
    if mp is not None and mp not in PRECISIONS:
        raise ConfigError("distribution", f"mixed_precision must be one of {list(PRECISIONS)}, got {mp!r}")
    clip = distribution.get("gradient_clipping")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        raise ConfigError("distribution", f"gradient_clipping must be a number >= 0, got {clip!r}")
    return {"mics": {"partition_group_size": p, "hierarchical_allgather": h, "reshard_after_forward": r,
                     "two_hop_sync": two_hop},
            "tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "pipeline_schedule": schedule,
            "virtual_stages": v, "microbatches": m, "pipeline_split": split,
            "gradient_accumulation_steps": s, "activation_checkpointing": ac, "mixed_precision": mp,
            "gradient_clipping": clip}
