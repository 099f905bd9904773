"""ParallelDims: the named device mesh of a job, host-aware.

Ranks are numbered host by host (`rank = host * processes_per_host + local_rank`, as torchrun numbers
them with node rank = host index). The mesh is row-major over

    (pp, dp_replicate, dp_shard_inter, dp_shard_intra, tp)

with `tp` innermost so that it stays inside a host. `dp_shard` (the MiCS partition group, size p) is the
flattened `(dp_shard_inter, dp_shard_intra)`: when p * tp <= processes_per_host a partition group lives
inside one host (`dp_shard_inter` = 1); otherwise it spans k = p * tp / processes_per_host whole hosts with
m = p / k ranks on each, and the two sub-dimensions are the groups a hierarchical collective needs:
`dp_shard_inter` joins the ranks with the same local index on the k hosts, `dp_shard_intra` the m ranks
of the group on one host.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MESH_DIMS = ("pp", "dp_replicate", "dp_shard_inter", "dp_shard_intra", "tp")


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    dp_replicate: int
    """Replicas of the model states (MiCS: the number of partition groups, r = N / p)."""
    dp_shard: int
    """Partition group size p: the model states are sharded over this many ranks."""
    tp: int = 1
    """Tensor-parallel degree (inside a host)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    world_size: int
    """Number of ranks of the job."""
    processes_per_host: int
    """Ranks per host; the world is world_size / processes_per_host hosts."""
    _mesh: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "world_size", "processes_per_host"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        n, pph = self.world_size, self.processes_per_host
        if self.dp_replicate * self.dp_shard * self.tp * self.pp != n:
            raise ValueError(
                f"dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}) x tp ({self.tp}) x pp ({self.pp}) = "
                f"{self.dp_replicate * self.dp_shard * self.tp * self.pp} must equal the world size {n}"
            )
        if n % pph:
            raise ValueError(f"world size {n} is not a whole number of hosts of {pph} processes")
        if pph % self.tp:
            raise ValueError(f"tp ({self.tp}) must divide the processes per host ({pph}): tensor parallelism stays "
                             "inside a host")
        g = self.dp_shard * self.tp
        if pph % g and g % pph:
            raise ValueError(
                f"a partition group (dp_shard {self.dp_shard} x tp {self.tp} = {g} consecutive ranks) must fit "
                f"inside a host of {pph} processes (divide {pph}) or span whole hosts (be a multiple of {pph})"
            )

    @property
    def hosts(self) -> int:
        return self.world_size // self.processes_per_host

    @property
    def shard_hosts(self) -> int:
        """k: the number of hosts one partition group spans (1 when it fits inside a host)."""
        return max(1, self.dp_shard * self.tp // self.processes_per_host)

    @property
    def shard_per_host(self) -> int:
        """m: the ranks of one partition group on each of its hosts."""
        return self.dp_shard // self.shard_hosts

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.shard_hosts, self.shard_per_host, self.tp)

    def rank_grid(self):
        """The ranks laid out in MESH_DIMS order (what the mesh is built from), as a tensor."""
        import torch  # lazily: the SDK validates layouts without loading torch

        return torch.arange(self.world_size).reshape(self.mesh_shape)

    def host_of(self, rank: int) -> int:
        return rank // self.processes_per_host

    def shard_groups(self) -> list[list[int]]:
        """Every partition group's ranks (each is one dp_shard group of the mesh)."""
        g = self.rank_grid().movedim(MESH_DIMS.index("tp"), 2).reshape(-1, self.dp_shard)
        return [row.tolist() for row in g]

    def replicate_groups(self) -> list[list[int]]:
        g = self.rank_grid().movedim(1, -1).reshape(-1, self.dp_replicate)
        return [row.tolist() for row in g]

    def build_mesh(self, device_type: str):
        """The named DeviceMesh (a collective: every rank calls it), with `dp_shard` flattened."""
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None:
            mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_DIMS)
            mesh["dp_shard_inter", "dp_shard_intra"]._flatten("dp_shard")
            self._mesh = mesh
        return self._mesh

    @property
    def mesh(self):
        if self._mesh is None:
            raise RuntimeError("call build_mesh(device_type) first")
        return self._mesh

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks that see different data (dp_replicate x dp_shard)."""
        return self.dp_replicate * self.dp_shard

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s index along each mesh dimension, with `dp_shard` and `dp` (its data-parallel index)."""
        grid = self.rank_grid()
        idx = dict(zip(MESH_DIMS, (int(i) for i in (grid == rank).nonzero()[0])))
        idx["dp_shard"] = idx["dp_shard_inter"] * self.shard_per_host + idx["dp_shard_intra"]
        idx["dp"] = idx["dp_replicate"] * self.dp_shard + idx["dp_shard"]
        return idx

    def dp_mesh(self):
        """The 2-D `(dp_replicate, dp_shard)` mesh FSDP2 shards over (dim 0 replicates)."""
        return self.mesh["dp_replicate", "dp_shard"]


def dims_from_distribution(distribution: dict, *, world_size: int, processes_per_host: int) -> ParallelDims:
    """ParallelDims for the typed `distribution` (see `trainyard.job.distribution`): `tp` and `pp` from
    the tensor- and pipeline-parallel degrees; the remaining data-parallel ranks form partition groups of
    `mics.partition_group_size` (default: all of them, ZeRO-3), replicated over the rest."""
    tp = distribution.get("tensor_parallel_degree") or 1
    pp = distribution.get("pipeline_parallel_degree") or 1
    if world_size % (tp * pp):
        raise ValueError(f"tensor_parallel_degree ({tp}) x pipeline_parallel_degree ({pp}) = {tp * pp} must divide "
                         f"the world size {world_size}")
    dp = world_size // (tp * pp)
    p = (distribution.get("mics") or {}).get("partition_group_size") or dp
    if dp % p:
        raise ValueError(f"partition_group_size {p} must divide the data-parallel degree {dp} (world size "
                         f"{world_size} / (tensor_parallel_degree {tp} x pipeline_parallel_degree {pp}))")
    return ParallelDims(dp_replicate=dp // p, dp_shard=p, tp=tp, pp=pp, world_size=world_size,
                        processes_per_host=processes_per_host)
