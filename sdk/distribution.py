"""`distribution`: Trainyard's typed form, and SageMaker's forms mapped onto it.

Typed form (what the engine reads from `TRAINYARD_DISTRIBUTION`):

    {"mics": {"partition_group_size": p, "hierarchical_allgather": true|false|null,
              "reshard_after_forward": true|false|n, "two_hop_sync": true|false},
     "gradient_accumulation_steps": s|null, "activation_checkpointing": "none"|"full"|"selective",
     "mixed_precision": "bf16"|"fp32"|null, "gradient_clipping": float|null}

SageMaker forms accepted: `{"torch_distributed": {"enabled": True}}` (plain data parallel: ZeRO-3 over
the world); SMP v2 `smdistributed.modelparallel.parameters.hybrid_shard_degree`; SMP v1
`sharded_data_parallel_degree` with `sdp_hierarchical_allgather` and `sdp_gradient_clipping`. Impossible
layouts are refused when the Estimator is built.
"""
from __future__ import annotations

from typing import Any

from trainyard.sdk.errors import ConfigError

MICS_KEYS = ("partition_group_size", "hierarchical_allgather", "reshard_after_forward", "two_hop_sync")
AC_MODES = ("none", "full", "selective")  # the same as trainyard.engine.ac (which imports torch)
PRECISIONS = ("bf16", "fp32")


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
    p = mics.get("partition_group_size", world_size)
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ConfigError("distribution", f"partition_group_size must be an integer >= 1, got {p!r}")
    if world_size % p:
        raise ConfigError("distribution", f"partition_group_size {p} must divide the world size {world_size} "
                                          f"(instance_count x processes_per_host)")
    h = mics.get("hierarchical_allgather")
    if h not in (None, True, False):
        raise ConfigError("distribution", f"hierarchical_allgather must be true, false or null, got {h!r}")
    r = mics.get("reshard_after_forward", True)
    if not isinstance(r, bool) and (not isinstance(r, int) or r < 1):
        raise ConfigError("distribution", f"reshard_after_forward must be true, false or an int >= 1, got {r!r}")
    from trainyard.engine.parallel import ParallelDims

    try:
        ParallelDims(dp_replicate=world_size // p, dp_shard=p, world_size=world_size,
                     processes_per_host=processes_per_host)
    except ValueError as e:
        raise ConfigError("distribution", f"mics: {e}") from None
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
            "gradient_accumulation_steps": s, "activation_checkpointing": ac, "mixed_precision": mp,
            "gradient_clipping": clip}
