"""Expert parallelism: a mixture of experts' experts spread over groups of data-parallel ranks.

`ParallelDims.ep_groups()` are ep consecutive data-parallel ranks (at the same context-parallel index: under context
parallelism each rank routes the tokens of its chunks); rank i of a group holds the i-th
n_experts / ep of every MoE layer's experts, as a DTensor sharded on the expert dimension over the group's
1-D mesh (`Shard(0)`), so that checkpoints reshard between expert-parallel degrees like any sharded parameter.
The model's MoE layers send each token to the rank of its experts and back with all-to-all
(`models/llama/moe.py`); the rest of the model is sharded by MiCS as without experts, which leaves the expert
parameters alone (`ignored_params`).

Gradients: a rank's expert gradient is the sum of what every rank of its ep group sent it (all-to-all's backward
carries each source's loss back). `reduce_expert_grads` sums that over the ranks holding the same experts
(`expert_replica_groups`: one rank per ep group, at every context- and tensor-parallel index) and divides by the
data-parallel x context-parallel degree: the mean over the ranks whose losses the step averages, as MiCS's reduction
gives every other gradient. The tensor-parallel ranks are summed, not averaged: they share one loss, and each routes
its own sequence-parallel shard of the rows (the built-in model's plan, `models/llama/tp_plan.py`), so that with
tensor parallelism the experts take this layout even with ep 1 (held whole on every rank). It runs after a step's
last micro-batch.

`balance_group`: the ranks whose tokens make one micro-batch (those of one pipeline stage: every data-parallel
and context-parallel rank of it), over which the load-balancing loss counts its assignments.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainyard.parallel.dims import ParallelDims

# On a module whose parameters expert parallelism spread: their names (a module attribute survives `to_empty`,
# which gives every module new parameter objects)
EXPERT_ATTR = "_trainyard_experts"

# The weight a load-balancing loss's gradient gets: that of the current micro-batch's loss in the step (1 /
# micro-batches, times the fp16 loss scale), set by the engine around each micro-batch's forward.
_AUX_WEIGHT = [1.0]


def aux_loss_weight() -> float:
    return _AUX_WEIGHT[0]


@contextlib.contextmanager
def aux_weight(weight: float):
    previous, _AUX_WEIGHT[0] = _AUX_WEIGHT[0], float(weight)
    try:
        yield
    finally:
        _AUX_WEIGHT[0] = previous


@dataclass
class ExpertLayout:
    ep: int
    ep_rank: int
    ep_group: dist.ProcessGroup
    ep_mesh: object  # a 1-D DeviceMesh over ep_group
    replica_group: dist.ProcessGroup | None  # None: one rank holds each expert
    averaged: int  # the ranks whose losses a step averages (data-parallel x context-parallel)


@dataclass
class ExpertGroup:
    """The ranks among which one MoE layer's experts are spread: `group` (size ep, this rank's index `rank`)."""

    group: dist.ProcessGroup
    size: int
    rank: int


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a parameter expert parallelism spread (a DTensor's local shard); `t` itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def dispatch(tokens: torch.Tensor, counts: torch.Tensor, ep: ExpertGroup, compute) -> torch.Tensor:
    """The experts' outputs for `tokens` (rows grouped by global expert, `counts[e]` rows for expert e), computed on
    the ranks holding the experts: the counts go round first (all-to-all), then the rows to their experts' ranks,
    where `compute(rows grouped by local expert, counts per local expert)` runs, and the results back (all-to-all
    with autograd: the backward sends the gradients the other way)."""
    from torch.distributed import _functional_collectives as funcol

    local = counts.numel() // ep.size
    send = counts.view(ep.size, local)  # row j: my assignments to rank j's experts
    recv = funcol.wait_tensor(funcol.all_to_all_single(send.flatten().contiguous(), None, None, ep.group))
    recv = recv.view(ep.size, local)  # row s: rank s's assignments to my experts
    out_splits, in_splits = recv.sum(1).tolist(), send.sum(1).tolist()
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(tokens, out_splits, in_splits, ep.group))
    # received by (source, expert); the experts want them by (expert, source), and back again after
    segments = recv.flatten().tolist()
    pieces = got.split(segments)
    by_expert = [pieces[s * local + e] for e in range(local) for s in range(ep.size)]
    y = compute(torch.cat(by_expert), recv.sum(0).tolist())
    back = y.split([segments[s * local + e] for e in range(local) for s in range(ep.size)])
    by_source = [back[e * ep.size + s] for s in range(ep.size) for e in range(local)]
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(torch.cat(by_source), in_splits, out_splits,
                                                                ep.group))


_LAYOUTS: dict = {}


def expert_layout(dims: ParallelDims, device_type: str) -> ExpertLayout:
    """This rank's expert-parallel groups (a collective the first time for a layout: every rank calls it)."""
    key = (device_type, dims.world_size, dims.processes_per_host, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp,
           dims.pp, dims.ep)
    world = dist.group.WORLD
    held = _LAYOUTS.get(key)
    if held is not None and held[0] is world:
        return held[1]
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    groups = dims.ep_groups()
    ep_group, _ = dist.new_subgroups_by_enumeration(groups)
    replicas = dims.expert_replica_groups()
    replica_group = dist.new_subgroups_by_enumeration(replicas)[0] if len(replicas[0]) > 1 else None
    mine = next(g for g in groups if rank in g)
    layout = ExpertLayout(ep=dims.ep, ep_rank=mine.index(rank), ep_group=ep_group,
                          ep_mesh=DeviceMesh.from_group(ep_group, device_type, mesh_dim_names=("ep",)),
                          replica_group=replica_group, averaged=dims.dp * dims.cp)
    _LAYOUTS[key] = (world, layout)
    return layout


def shard_experts(module: nn.Module, names: tuple[str, ...], layout: ExpertLayout) -> None:
    """Replace `module`'s parameters `names` (experts on dim 0) by this rank's slice, a DTensor `Shard(0)` over the
    ep mesh; on the meta device no data moves (the weights are initialised afterwards, layout-independently)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    for name in names:
        full = getattr(module, name)
        if full.shape[0] % layout.ep:
            raise ValueError(f"expert_parallel_degree {layout.ep} must divide the number of experts {full.shape[0]}; "
                             f"choose a degree that divides {full.shape[0]}")
        if full.is_meta:
            local = torch.empty((full.shape[0] // layout.ep, *full.shape[1:]), dtype=full.dtype, device="meta")
            sharded = DTensor.from_local(local, layout.ep_mesh, [Shard(0)], run_check=False,
                                         shape=full.shape, stride=full.stride())
        else:
            sharded = distribute_tensor(full.detach(), layout.ep_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=full.requires_grad))
    setattr(module, EXPERT_ATTR, tuple(names))


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters expert parallelism spread (`shard_experts`), in module order."""
    return [getattr(m, name) for m in model.modules() for name in getattr(m, EXPERT_ATTR, ())]


@torch.no_grad()
def reduce_expert_grads(params: list[nn.Parameter], layout: ExpertLayout) -> None:
    """After a step's last micro-batch: each expert gradient summed over the ranks holding the same experts and
    divided by the data-parallel x context-parallel degree (see the module's docstring)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if layout.replica_group is not None:
        dist.all_reduce(flat, group=layout.replica_group)
    flat /= layout.averaged
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
