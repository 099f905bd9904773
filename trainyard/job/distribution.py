"""`distribution` as the SDK checks it, parsed once where a job spec is validated (`JobSpec.parallelism`):
`trainyard.parallel.parallelism.Parallelism` does the parsing (Trainyard's typed form and SageMaker's
forms, documented there); `typed` fills in the partition group the job's world gives, and `normalize` turns its
errors into `ConfigError("distribution", ...)` for callers outside a spec (the planner's layouts, tests)."""
from __future__ import annotations

from typing import Any

from trainyard.parallel.parallelism import Parallelism
from trainyard.errors import ConfigError


def typed(distribution: dict[str, Any], *, world_size: int, processes_per_host: int) -> Parallelism:
    """The typed value of `distribution` on the job's world, its partition group filled in (ValueError
    "distribution: ..." naming the key or the degrees otherwise)."""
    par = Parallelism.parse(distribution)
    par.partition_group_size = par.dims(world_size=world_size, processes_per_host=processes_per_host).dp_shard
    return par


def normalize(distribution: dict[str, Any], *, world_size: int, processes_per_host: int) -> dict[str, Any]:
    """The typed form of `distribution` as a dict, checked against the job's layout."""
    try:
        return typed(distribution, world_size=world_size, processes_per_host=processes_per_host).to_dict()
    except ValueError as e:
        raise ConfigError("distribution", str(e).removeprefix("distribution: ")) from None
