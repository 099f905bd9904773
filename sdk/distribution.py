"""`distribution`: Trainyard's typed form, and SageMaker's forms mapped onto it.

Typed form (what the engine reads from `TRAINYARD_DISTRIBUTION`):

    {"mics": {"partition_group_size": p, "hierarchical_allgather": true|false|null,
              "reshard_after_forward": true|false|n}}

SageMaker forms accepted: `{"torch_distributed": {"enabled": True}}` (plain data parallel: ZeRO-3 over
the world); SMP v2 `smdistributed.modelparallel.parameters.hybrid_shard_degree`; SMP v1
`sharded_data_parallel_degree` with `sdp_hierarchical_allgather`. Impossible layouts are refused when
the Estimator is built.
"""
from __future__ import annotations

from typing import Any

from trainyard.sdk.errors import ConfigError

MICS_KEYS = ("partition_group_size", "hierarchical_allgather", "reshard_after_forward")


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
    return {"mics": {"partition_group_size": p, "hierarchical_allgather": h, "reshard_after_forward": r}}
