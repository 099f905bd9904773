"""MiCS on FSDP2: partition-group sharding, hierarchical collectives, 2-hop gradient sync.

`apply_mics(model, blocks, dims, config)` shards every block (blocks sharing a parameter as one unit) and then the root with `fully_shard`
over the 2-D mesh `(dp_replicate, dp_shard)` of `ParallelDims`: model states are sharded inside a
partition group of p = dp_shard ranks and replicated across the r = dp_replicate groups. Under context
parallelism the group is `dp_shard_cp`, its p data-parallel ranks with their cp ranks each (p x cp ranks). Partition size
1 is DDP, p = world is ZeRO-3; `reshard_after_forward=False` is ZeRO-2-like, an int is hpZ-like.

When a partition group spans k > 1 hosts, the parameter all-gather and the gradient reduce-scatter run
in two hops (`HierarchicalAllGather`, `HierarchicalReduceScatter`): across hosts among the k ranks with
the same local index, and inside each host among its m = p / k ranks. A host's network traffic for an
all-gather of M bytes drops from M (p-1)/p to M (k-1)/k, in k-1 ring steps instead of p-1.

Under gradient accumulation, `sync_microbatch(model, i, s, two_hop=True)` keeps the reduce-scatter inside
the group on every micro-batch and runs the all-reduce across replicas on the last one only. That all-reduce
is, by default (`replica_sync="bucketed"`), Trainyard's own (`ReplicaSync`, replica_sync.py): bucketed, started
as each bucket's reduce-scatters finish so that it overlaps the rest of the backward, optionally compressed;
FSDP then shards over the partition group alone. `replica_sync="native"` leaves it to FSDP2's HSDP (one
all-reduce per block, after its reduce-scatter, not overlapped on CPU); pipelines and flat HSDP
(`two_hop=False`) use that.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from trainyard.engine.distributed.experts import expert_params
from trainyard.parallel.dims import ParallelDims
from trainyard.parallel.parallelism import REPLICA_COMPRESSIONS, REPLICA_SYNCS
from trainyard.engine.distributed.replica_sync import ReplicaSync


@dataclass(kw_only=True, slots=True)
class MiCSConfig:
    reshard_after_forward: bool | int = True
    """Blocks: True frees gathered parameters after forward (ZeRO-3-like inside the group), False keeps
    them until backward (ZeRO-2-like), an int n reshards to groups of n ranks (hpZ-like)."""
    hierarchical: bool | None = None
    """Two-hop all-gather / reduce-scatter for groups spanning hosts. None: on exactly when they do."""
    param_dtype: torch.dtype | None = None
    """Compute dtype of gathered parameters (None: the parameters' own, float32)."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of gradient reduction (None: param_dtype)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in host memory."""
    prefetch: bool = True
    """Explicitly prefetch the next block's all-gather in forward and the previous one's in backward."""
    replica_sync: str = "bucketed"
    """Cross-replica gradient all-reduce: "bucketed" (ReplicaSync: overlapped with the backward) or "native"
    (FSDP2's HSDP all-reduce per block)."""
    replica_bucket_mb: float = 4.0
    """Bucket size of the bucketed sync, in MiB of fp32 gradient shard."""
    replica_compression: str | None = None
    """None (exact), "bf16" or "int8" (with error feedback): what the bucketed sync sends."""
    hierarchical_chunks: int = 4
    """Chunks the hierarchical all-gather is pipelined in (1: its two hops one after the other)."""

    def __post_init__(self) -> None:
        r = self.reshard_after_forward
        if not isinstance(r, bool) and (not isinstance(r, int) or r < 1):
            raise ValueError(f"reshard_after_forward must be True, False or an int >= 1, got {r!r}")
        if self.hierarchical not in (None, True, False):
            raise ValueError(f"hierarchical must be True, False or None, got {self.hierarchical!r}")
        if self.replica_sync not in REPLICA_SYNCS:
            raise ValueError(f"replica_sync must be one of {list(REPLICA_SYNCS)}, got {self.replica_sync!r}")
        if self.replica_compression not in (None, *REPLICA_COMPRESSIONS):
            raise ValueError(f"replica_compression must be one of {list(REPLICA_COMPRESSIONS)} or None, got "
                             f"{self.replica_compression!r}")
        if self.replica_compression is not None and self.replica_sync != "bucketed":
            raise ValueError("replica_compression needs replica_sync='bucketed'")
        if isinstance(self.replica_bucket_mb, bool) or not isinstance(self.replica_bucket_mb, (int, float)) \
                or not self.replica_bucket_mb > 0:
            raise ValueError(f"replica_bucket_mb must be a number > 0, got {self.replica_bucket_mb!r}")
        c = self.hierarchical_chunks
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"hierarchical_chunks must be an int >= 1, got {c!r}")


class _TwoHop:
    """The groups of a partition group that spans k hosts with m ranks on each."""

    def __init__(self, intra: dist.ProcessGroup, inter: dist.ProcessGroup, k: int, m: int, chunks: int = 1):
        self.intra, self.inter, self.k, self.m, self.chunks = intra, inter, k, m, chunks

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def spans(self, group: dist.ProcessGroup) -> bool:
        """Whether `group` is the whole partition group. With hpZ-like resharding, FSDP gathers again in
        backward over a smaller group inside a host: that one runs flat."""
        return group.size() == self.k * self.m


class HierarchicalAllGather(_TwoHop, AllGather):
    """All-gather over a partition group of k hosts x m ranks: inter-host, then intra-host, pipelined.

    Group rank r = h * m + j (host h of the group, local index j). Hop 1 gathers the k shards of local
    index j across hosts; hop 2 gathers the m results inside the host; a transpose puts the shards in
    group-rank order. The shard is cut into `chunks` pieces: every piece's hop 1 is started at once, and
    each piece's hop 2 starts as soon as its hop 1 is done, so the intra-host hop of one piece runs while
    the inter-host hops of the later ones are still on the wire. Pure data movement: the result is
    bit-identical to the flat all-gather.
    """

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        if not self.spans(group):
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        k, m, n = self.k, self.m, input_tensor.numel()
        flat, out = input_tensor.reshape(-1), output_tensor.view(k, m, n)
        step = max(1, -(-n // max(1, min(self.chunks, n))))
        bounds = [(a, min(n, a + step)) for a in range(0, n, step)]
        across = [torch.empty(k * (b - a), dtype=flat.dtype, device=flat.device) for a, b in bounds]
        hop1 = [dist.all_gather_single(x, flat[a:b], group=self.inter, async_op=len(bounds) > 1)
                for x, (a, b) in zip(across, bounds)]
        hop2 = []
        for i, (a, b) in enumerate(bounds):
            if hop1[i] is not None:
                hop1[i].wait()
            inside = torch.empty(m * k * (b - a), dtype=flat.dtype, device=flat.device)
            hop2.append((inside, dist.all_gather_single(inside, across[i], group=self.intra,
                                                        async_op=len(bounds) > 1)))
        for (inside, work), (a, b) in zip(hop2, bounds):
            if work is not None:
                work.wait()
            out[:, :, a:b].copy_(inside.view(m, k, b - a).transpose(0, 1))
        return None  # done when it returns


class HierarchicalReduceScatter(_TwoHop, ReduceScatter):
    """Reduce-scatter over k hosts x m ranks: intra-host first (the big hop stays on fast links), then
    inter-host among the k ranks with the same local index, on 1/m of the data."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
        if not self.spans(group):
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        k, m, n = self.k, self.m, output_tensor.numel()
        # group order [h][j] -> [j][h]: rank j of the host receives the k chunks it reduces further
        by_local = input_tensor.view(k, m, n).transpose(0, 1).contiguous().view(-1)
        partial = torch.empty(k * n, dtype=input_tensor.dtype, device=input_tensor.device)
        dist.reduce_scatter_single(partial, by_local, op=op, group=self.intra)
        # SUM and AVG compose over the two hops; a pre-multiplied sum is applied once, in hop 1
        second = op if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) else dist.ReduceOp.SUM
        dist.reduce_scatter_single(output_tensor.view(-1), partial, op=second, group=self.inter)
        return None


def check_offload(config: MiCSConfig, device_type: str) -> None:
    if config.cpu_offload and device_type == "cpu":
        raise ValueError("cpu_offload needs an accelerator: on a CPU-only host the states already live in host "
                         "memory; set cpu_offload=False")


def uses_hierarchy(dims: ParallelDims, config: MiCSConfig) -> bool:
    return dims.shard_hosts > 1 and config.hierarchical is not False


def apply_mics(model: nn.Module, units: list, dims: ParallelDims, config: MiCSConfig,
               ignored: set | None = None) -> nn.Module:
    """Shard `model` over the partition groups of `dims`: each unit (the blocks gathered together, in forward
    order: a block, or a list of the blocks that share a parameter, `ties.shard_units`), then the root (what no
    block holds: embeddings, final norm, head). `ignored`: parameters left alone (experts spread by expert
    parallelism, distributed/experts.py)."""
    check_offload(config, dims.mesh.device_type)
    units = [unit if isinstance(unit, list) else [unit] for unit in units]
    blocks = [unit[0] for unit in units]  # a unit's first block is its FSDP handle
    # one replica, or replicas synced by ReplicaSync: 1-D sharding, so FSDP issues no all-reduce of its own
    # (under context parallelism the group is dp_shard x cp: the cp ranks' gradients join the same reduce-scatter)
    mesh = dims.dp_mesh() if uses_native_sync(dims, config) else dims.shard_mesh()
    policy = MixedPrecisionPolicy(param_dtype=config.param_dtype,
                                  reduce_dtype=config.reduce_dtype or config.param_dtype)
    offload = CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy()
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=policy, offload_policy=offload,
                    reshard_after_forward=config.reshard_after_forward, ignored_params=ignored or None)
    # The root (embedding, final norm, head) is used again at once by backward: keep it gathered.
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=False,
                ignored_params=ignored or None)
    model.register_forward_hook(_reshard_without_backward)
    if uses_hierarchy(dims, config):
        # on each host the group has m data-parallel ranks, each with its cp ranks (dp_shard_intra_cp)
        k, m = dims.shard_hosts, dims.shard_per_host * dims.cp
        intra = dims.mesh.get_group("dp_shard_intra_cp" if dims.cp > 1 else "dp_shard_intra")
        inter = dims.mesh.get_group("dp_shard_inter")
        for module in [*blocks, model]:
            module.set_custom_all_gather(HierarchicalAllGather(intra, inter, k, m, config.hierarchical_chunks))
            module.set_custom_reduce_scatter(HierarchicalReduceScatter(intra, inter, k, m))
    if config.prefetch and len(blocks) > 1 and all(len(unit) == 1 for unit in units):
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return model


def _reshard_without_backward(model: nn.Module, args, output) -> None:
    """After a forward without gradients (an evaluation), shard every unit again: what is kept gathered for a
    backward (the root, ZeRO-2-like blocks) would otherwise stay gathered, and `model.parameters()` would then
    give the gathered copies, which an optimizer built at that moment would update in vain."""
    if not torch.is_grad_enabled():
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def uses_native_sync(dims: ParallelDims, config: MiCSConfig) -> bool:
    """Whether FSDP2 itself all-reduces across replicas (2-D HSDP mesh): when asked, and with CPU offload, whose
    gradient shards go to host memory right after their reduce-scatter (the bucketed sync needs them on the GPU)."""
    return dims.dp_replicate > 1 and (config.replica_sync == "native" or config.cpu_offload)


def replica_sync(model: nn.Module, blocks: list[nn.Module], dims: ParallelDims, config: MiCSConfig) -> ReplicaSync | None:
    """The bucketed cross-replica sync of a model `apply_mics` sharded over its partition groups alone (None
    when FSDP syncs natively or there is one replica). Parameters go in the order their gradients become
    final: the blocks last to first, then the root's own."""
    if dims.dp_replicate == 1 or uses_native_sync(dims, config):
        return None
    ordered, seen = [], set()
    for block in reversed(blocks):
        for p in block.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                ordered.append(p)
    ordered += [p for p in model.parameters() if id(p) not in seen and p.requires_grad]
    # the experts spread by expert parallelism are reduced by their own groups (distributed/experts.py)
    spread = {id(p) for p in expert_params(model)}
    ordered = [p for p in ordered if p.requires_grad and id(p) not in spread]
    return ReplicaSync(ordered, dims.mesh.get_group("dp_replicate"),
                       bucket_bytes=int(config.replica_bucket_mb * 2 ** 20), compression=config.replica_compression)


def sync_microbatch(model: nn.Module, index: int, count: int, *, two_hop: bool = True,
                    sync: ReplicaSync | None = None) -> None:
    """Set gradient sync for micro-batch `index` of `count` before its backward.

    two_hop (MiCS): reduce-scatter inside the partition group on every micro-batch, all-reduce across
    replicas only on the last (by `sync` when given, else by FSDP). Otherwise (flat HSDP, native): both on
    every micro-batch.
    """
    model.set_requires_gradient_sync(True)
    if sync is not None:
        sync.final = index == count - 1
    else:
        model.set_requires_all_reduce(index == count - 1 if two_hop else True)
