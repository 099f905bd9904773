"""ParallelDims: the named device mesh of a job, host-aware.

Ranks are numbered host by host (`rank = host * processes_per_host + local_rank`, as torchrun numbers
them with node rank = host index). The mesh is row-major over

    (pp, dp_replicate, dp_shard_inter, dp_shard_intra, cp, tp)

with `tp` innermost so that it stays inside a host, and the context-parallel ranks `cp` (which split the
sequence and see the same rows) next to it, inside a host too. `dp_shard` (the MiCS partition group, p
data-parallel ranks) is the flattened `(dp_shard_inter, dp_shard_intra)`: when p * cp * tp <=
processes_per_host a partition group lives inside one host (`dp_shard_inter` = 1); otherwise it spans
k = p * cp * tp / processes_per_host whole hosts with m = p / k data-parallel ranks on each, and the two
sub-dimensions are the groups a hierarchical collective needs: `dp_shard_inter` joins the ranks with the same
local index on the k hosts, `dp_shard_intra` the m ranks of the group on one host.

Context parallelism folds into the sharding, as torchtitan folds it into FSDP: the model states are sharded
over the p * cp ranks of `dp_shard_cp` (the flattened `(dp_shard_inter, dp_shard_intra, cp)`, built when
cp > 1), so the gradients of the context-parallel ranks are reduced by the same reduce-scatter. With cp = 1
the mesh has a `cp` dimension of size 1 and every group is what it was without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MESH_DIMS = ("pp", "dp_replicate", "dp_shard_inter", "dp_shard_intra", "cp", "tp")


# built meshes by (device type, shape), each with the default group it was built in: a mesh is reused only in that
# world; forget_meshes() empties it when the engine destroys the default group (engine/distributed/process.py)
_MESHES: dict = {}


def forget_meshes() -> None:
    _MESHES.clear()


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    dp_replicate: int
    """Replicas of the model states (MiCS: the number of partition groups, r = N / p)."""
    dp_shard: int
    """Partition group size p in data-parallel ranks: the model states are sharded over p x cp ranks."""
    cp: int = 1
    """Context-parallel degree: ranks that split the sequence of the same rows (inside a host)."""
    tp: int = 1
    """Tensor-parallel degree (inside a host)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    ep: int = 1
    """Expert-parallel degree: consecutive data-parallel ranks that spread a mixture of experts' experts between
    them (each holds n_experts / ep); not a mesh dimension (the ep groups are made of data-parallel ranks)."""
    world_size: int
    """Number of ranks of the job."""
    processes_per_host: int
    """Ranks per host; the world is world_size / processes_per_host hosts."""
    _mesh: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "world_size", "processes_per_host"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        n, pph = self.world_size, self.processes_per_host
        if self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp != n:
            cp = f" x cp ({self.cp})" if self.cp > 1 else ""
            raise ValueError(
                f"dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}){cp} x tp ({self.tp}) x pp ({self.pp}) = "
                f"{self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp} must equal the world size {n}"
            )
        if n % pph:
            raise ValueError(f"world size {n} is not a whole number of hosts of {pph} processes")
        if pph % self.tp:
            raise ValueError(f"tp ({self.tp}) must divide the processes per host ({pph}): tensor parallelism stays "
                             "inside a host")
        if pph % (self.cp * self.tp):
            raise ValueError(f"cp ({self.cp}) x tp ({self.tp}) = {self.cp * self.tp} must divide the processes per host "
                             f"({pph}): the ranks that split one sequence stay inside a host")
        if self.ep > 1:
            if self.dp % self.ep:
                fits = [d for d in range(1, self.dp + 1) if self.dp % d == 0]
                raise ValueError(f"ep ({self.ep}) must divide the data-parallel degree {self.dp}: the experts are spread "
                                 f"over groups of ep data-parallel ranks; choose one of {fits}")
        g = self.dp_shard * self.cp * self.tp
        if pph % g and g % pph:
            cp = f" x cp {self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"a partition group (dp_shard {self.dp_shard}{cp} x tp {self.tp} = {g} consecutive ranks) must fit "
                f"inside a host of {pph} processes (divide {pph}) or span whole hosts (be a multiple of {pph})"
            )

    @property
    def hosts(self) -> int:
        return self.world_size // self.processes_per_host

    @property
    def shard_hosts(self) -> int:
        """k: the number of hosts one partition group spans (1 when it fits inside a host)."""
        return max(1, self.dp_shard * self.cp * self.tp // self.processes_per_host)

    @property
    def shard_per_host(self) -> int:
        """m: the data-parallel ranks of one partition group on each of its hosts (each with its cp ranks)."""
        return self.dp_shard // self.shard_hosts

    @property
    def shard_size(self) -> int:
        """The ranks the model states are sharded over: the partition group's data-parallel ranks, each with its
        context-parallel ranks (p x cp)."""
        return self.dp_shard * self.cp

    @property
    def shard_dim(self) -> str:
        """The mesh dimension FSDP shards over: `dp_shard`, or `dp_shard_cp` under context parallelism."""
        return "dp_shard_cp" if self.cp > 1 else "dp_shard"

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.shard_hosts, self.shard_per_host, self.cp, self.tp)

    def rank_grid(self):
        """The ranks laid out in MESH_DIMS order (what the mesh is built from), as a tensor."""
        import torch  # lazily: the SDK validates layouts without loading torch

        return torch.arange(self.world_size).reshape(self.mesh_shape)

    def host_of(self, rank: int) -> int:
        return rank // self.processes_per_host

    def shard_groups(self) -> list[list[int]]:
        """Every partition group's ranks, the ranks the model states are sharded over (each is one group of
        `shard_dim`: dp_shard, or dp_shard x cp)."""
        g = self.rank_grid().movedim(MESH_DIMS.index("tp"), 2).reshape(-1, self.shard_size)
        return [row.tolist() for row in g]

    def cp_groups(self) -> list[list[int]]:
        """Every context-parallel group's ranks (they split the sequence of the same rows)."""
        g = self.rank_grid().movedim(MESH_DIMS.index("cp"), -1).reshape(-1, self.cp)
        return [row.tolist() for row in g]

    def ep_groups(self) -> list[list[int]]:
        """Every expert-parallel group: ep consecutive data-parallel ranks (at the same tp, cp and pp index) that
        spread the experts between them (rank i of a group holds the i-th n_experts / ep)."""
        return self._by_dp(lambda dp: dp // self.ep)

    def expert_replica_groups(self) -> list[list[int]]:
        """The ranks that hold the same experts (the same index in their ep groups, at every cp and tp index: each
        of those routes its own tokens, a chunk or a sequence-parallel shard of the rows): their expert gradients
        are summed, as the data- and context-parallel reduction does for the rest of the model."""
        return self._by_dp(lambda dp: dp % self.ep, across=True)

    def _by_dp(self, key, across: bool = False) -> list[list[int]]:
        """Ranks grouped by pipeline stage and `key(data-parallel index)`, and unless `across`, by cp and tp index."""
        groups: dict = {}
        for r in range(self.world_size):
            c = self.coords(r)
            where = (0, 0) if across else (c["cp"], c["tp"])
            groups.setdefault((c["pp"], *where, key(c["dp"])), []).append((c["dp"], c["cp"], c["tp"], r))
        return [[r for *_, r in sorted(members)] for _, members in sorted(groups.items())]

    def replicate_groups(self) -> list[list[int]]:
        g = self.rank_grid().movedim(1, -1).reshape(-1, self.dp_replicate)
        return [row.tolist() for row in g]

    def build_mesh(self, device_type: str):
        """The named DeviceMesh (a collective: every rank calls it), with `dp_shard` flattened; under context
        parallelism also `dp_shard_cp` (what FSDP shards over) and `dp_shard_intra_cp` (its ranks on one host)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None:
            # one mesh per shape and world: another transform of the same layout (a model per case, a checked
            # equivalence) reuses its process groups instead of creating (and connecting) them again
            key = (device_type, self.mesh_shape)
            world, mesh = _MESHES.get(key, (None, None))
            if mesh is None or world is not dist.group.WORLD:  # held, so a new world is never taken for the old
                mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_DIMS)
                mesh["dp_shard_inter", "dp_shard_intra"]._flatten("dp_shard")
                if self.cp > 1:
                    mesh["dp_shard_inter", "dp_shard_intra", "cp"]._flatten("dp_shard_cp")
                    mesh["dp_shard_intra", "cp"]._flatten("dp_shard_intra_cp")
                _MESHES[key] = (dist.group.WORLD, mesh)
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
        """The 2-D `(dp_replicate, dp_shard)` mesh FSDP2 shards over (dim 0 replicates); `dp_shard_cp` for the
        second under context parallelism."""
        return self.mesh["dp_replicate", self.shard_dim]

    def shard_mesh(self):
        """The 1-D mesh of the partition group FSDP2 shards over (`shard_dim`)."""
        return self.mesh[self.shard_dim]
