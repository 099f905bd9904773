"""`distribution` as the SDK checks it: `trainyard.engine.distributed.parallelism.Parallelism` does the parsing
(Trainyard's typed form and SageMaker's forms, documented there); this module turns its errors into
`ConfigError("distribution", ...)` and fills in the partition group the job's world gives."""
from __future__ import annotations

from typing import Any

from trainyard.engine.distributed.parallelism import Parallelism
from trainyard.job.errors import ConfigError


def normalize(distribution: dict[str, Any], *, world_size: int, processes_per_host: int) -> dict[str, Any]:
    """The typed form of `distribution`, checked against the job's layout."""
    try:
        par = Parallelism.parse(distribution)
        dims = par.dims(world_size=world_size, processes_per_host=processes_per_host)
    except ValueError as e:
        raise ConfigError("distribution", str(e).removeprefix("distribution: ")) from None
    par.partition_group_size = dims.dp_shard
    return par.to_dict()
