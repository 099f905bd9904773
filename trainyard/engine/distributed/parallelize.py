"""The composition of the engine's parallelisms for any module its spec describes, in the one order that works:

    pipeline cut -> tensor (and sequence) parallelism -> context parallelism -> activation checkpointing
    -> torch.compile -> MiCS -> weights

on the mesh `(pp, dp_replicate, dp_shard, cp, tp)` of `ParallelDims`; and the training step of the result:
micro-batches through the pipeline schedule (or a plain loop with 2-hop gradient sync), gradient clipping
over every mesh dimension, and the global-batch loss. Under context parallelism the step cuts each rank's rows
into its zig-zag chunks of the sequence (`sequence_shard`) and the loss of a rank is the mean over its tokens;
every context-parallel rank has as many, so the mean over the ranks is the mean over the global tokens.

Weights: a model with real weights keeps rank 0's values (broadcast before sharding); a model on the meta
device is materialised after sharding and initialised layout-independently (`materialize`). With one
data-parallel rank and no mixed precision nothing is wrapped for MiCS (no all-gather of one rank's shard).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainyard.engine.components import heartbeat
from trainyard.engine.components.scaler import GradScaler
from trainyard.engine.distributed.ac import apply_ac
from trainyard.engine.distributed.context import refuse_whole_sequences, shard_sequence
from trainyard.parallel.dims import ParallelDims
from trainyard.parallel.layout import check_cp, check_cp_pp
from trainyard.engine.distributed.materialize import (broadcast_weights, check_materialised, init_by_module,
                                                      is_meta)
from trainyard.engine.distributed.mics import MiCSConfig, apply_mics, replica_sync, sync_microbatch
from trainyard.engine.distributed.replica_sync import ReplicaSync
from trainyard.engine.distributed.experts import (ExpertLayout, aux_weight, expert_layout, expert_params,
                                                  reduce_expert_grads)
from trainyard.engine.distributed.pipeline import PipelineConfig, build_schedule, cut_stage, rank_stages
from trainyard.engine.distributed.ties import Tie, check_ties, find_ties, retie, shard_units
from trainyard.engine.distributed.tp import apply_tp_plan
from trainyard.engine.protocols import ModelSpec


@dataclass(kw_only=True)
class Parallelized:
    dims: ParallelDims
    spec: ModelSpec
    parts: list[nn.Module]
    """This rank's model pieces: the whole model without a pipeline, else one per stage it holds."""
    model: nn.Module
    """The pieces as one module under the model's parameter names (the piece itself when there is one)."""
    stages: list[int]
    num_stages: int
    coords: dict[str, int]
    """This rank's index along every mesh dimension (`ParallelDims.coords`)."""
    mics: MiCSConfig
    pipeline: PipelineConfig | None = None
    two_hop: bool = True
    sharded: bool = True
    """Whether MiCS wrapped the model (FSDP2); False with one data-parallel rank and no mixed precision."""
    syncs: list = field(default_factory=list)
    """Per part, its bucketed cross-replica gradient sync (`ReplicaSync`) or None."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _schedules: dict = field(default_factory=dict)
    tp_checked: bool = False
    """Whether the first backward's gradients were checked across the tensor-parallel group
    (`check_tp_gradients`)."""
    kernels: dict = field(default_factory=dict)
    """transform(kernels=...)'s implementation per op (trainyard.kernels.auto.as_record); empty without kernels."""
    scaler: GradScaler | None = None
    """The loss scaler (enabled under float16; `forward_backward` scales the losses it backpropagates)."""
    float8_all_gather: bool = False
    """Whether MiCS all-gathers FP8 weights (torchao): their scales are computed after each optimizer step."""
    _scaled_losses: dict = field(default_factory=dict)
    experts: ExpertLayout | None = None
    """Expert parallelism's groups (None without it)."""

    def finish_experts(self) -> None:
        """After a step's last micro-batch: the spread experts' gradients reduced (distributed/experts.py)."""
        if self.experts is not None:
            reduce_expert_grads(expert_params(self.model), self.experts)

    def sequence_shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's zig-zag chunks of `t` (batch, sequence, ...) under context parallelism; `t` otherwise."""
        if self.dims.cp > 1:  # the rank's tokens are split again between blocks under sequence parallelism
            check_cp(cp=self.dims.cp, seq_len=t.shape[1], tp=self.dims.tp)
        return shard_sequence(t, self.dims.cp, self.coords["cp"])

    @property
    def holds_first(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.stages

    def scaled(self, loss_fn: Callable) -> Callable:
        """`loss_fn` times the current loss scale (for the pipeline schedule, which runs the backward itself);
        `loss_fn` itself without an enabled scaler. One wrapper per loss function, so its schedule is built once."""
        if self.scaler is None or not self.scaler.enabled:
            return loss_fn
        if loss_fn not in self._scaled_losses:
            scaler = self.scaler
            self._scaled_losses[loss_fn] = lambda output, target: scaler.scale(loss_fn(output, target))
        return self._scaled_losses[loss_fn]

    def schedule(self, microbatches: int, loss_fn: Callable):
        """The pipeline schedule for `microbatches` micro-batches and `loss_fn` (built once per pair)."""
        key = (microbatches, loss_fn)
        if key not in self._schedules:
            config = PipelineConfig(schedule=self.pipeline.schedule, virtual_stages=self.pipeline.virtual_stages,
                                    microbatches=microbatches, split=self.pipeline.split)
            self._schedules[key] = build_schedule(self.parts, self.stages, self.num_stages,
                                                  pp_group=self.dims.mesh.get_group("pp"), device=self.device,
                                                  config=config, loss_fn=loss_fn)
        return self._schedules[key]


class RankModel(nn.Module):
    """Several pipeline stages of one rank as one module under the whole model's names (for the optimizer,
    clipping and checkpoints): the stages' blocks and other parameter-owning modules are shared, not copied."""

    def __init__(self, parts: list[nn.Module], blocks: list[nn.Module]) -> None:
        super().__init__()
        units = {id(b) for b in blocks}
        for part in parts:
            self._mirror(part, "", units)

    def _mirror(self, module: nn.Module, path: str, units: set[int]) -> None:
        for name, child in module.named_children():
            if child is None or not any(True for _ in (*child.parameters(), *child.buffers())):
                continue  # nothing to train or save: a placeholder of another stage's block, an identity
            sub = f"{path}.{name}" if path else name
            if id(child) in units or not any(True for _ in child.children()):
                self._place(sub, child)
            else:
                if any(True for _ in child.parameters(recurse=False)):
                    raise ValueError(f"{sub} owns parameters and has children: cannot mirror it across stages")
                self._mirror(child, sub, units)

    def _place(self, path: str, module: nn.Module) -> None:
        owner = self
        *parents, leaf = path.split(".")
        for p in parents:
            if p not in owner._modules:
                owner.add_module(p, nn.Module())
            owner = owner._modules[p]
        owner.add_module(leaf, module)


def parallelize(model: nn.Module, spec: ModelSpec, dims: ParallelDims, *, device: torch.device,
                mics: MiCSConfig | None = None, pipeline: PipelineConfig | None = None, ac: str = "none",
                two_hop: bool = True, seed: int = 0, init: Callable[[nn.Module], None] | None = None,
                compile: bool = False) -> Parallelized:
    """This rank's part of `model`, parallelised over `dims` (whose mesh is built). `compile`: each block's
    forward (after activation checkpointing, inside MiCS's hooks) goes through torch.compile."""
    mics = mics or MiCSConfig()
    check_cp_pp(cp=dims.cp, pp=dims.pp, stages_take_cp=spec.stages is None or spec.stages.context_parallel,
                model=spec.name)
    if dims.cp > 1 and spec.apply_cp is None:
        raise ValueError(f"context_parallel_degree {dims.cp}: the engine cannot split the attention of {spec.name} over "
                         "the sequence (context parallelism works for the built-in Transformer so far); set "
                         "context_parallel_degree to 1 and use MiCS or tensor parallelism")
    if dims.pp > 1 or not two_hop:
        # a pipeline schedule drives FSDP's sync itself, and flat HSDP all-reduces every micro-batch: FSDP's own
        mics = dataclasses.replace(mics, replica_sync="native", replica_compression=None)
    meta = is_meta(model)
    if not meta:
        broadcast_weights(model)
    template = copy.deepcopy(model) if meta else None
    if dims.tp > 1:
        spec.check_tp(model, dims.tp)
    coords = dims.coords(dist.get_rank())
    stages, num_stages, parts = _cut(model, spec, dims, coords["pp"], pipeline)
    # the context-parallel ranks share the partition group: their gradients are reduced with it
    sharded = dims.dp * dims.cp > 1 or mics.param_dtype not in (None, torch.float32) or mics.cpu_offload
    blocks_of = [spec.blocks(part) for part in parts]
    syncs: list[ReplicaSync | None] = []
    experts: ExpertLayout | None = None
    for part, blocks in zip(parts, blocks_of):
        ties = find_ties(part)
        if not meta and not sharded:
            part.to(device)  # sharded: fully_shard moves each rank's shards to the mesh's device
        if dims.tp > 1:
            _apply_tp(part, spec, dims)
            retie(part, ties, after="tensor parallelism")
        if dims.cp > 1:
            spec.apply_cp(part, dims.mesh["cp"])
            refuse_whole_sequences(part)
        experts = _apply_moe(part, spec, dims, device, experts)
        apply_ac(blocks, ac)
        if compile:
            apply_compile(blocks)
        if sharded:
            apply_mics(part, shard_units(part, blocks, ties), dims, mics, ignored=set(expert_params(part)))
        if meta:
            _materialise(part, spec, template, device, seed, init, offload=sharded and mics.cpu_offload, ties=ties)
        check_ties(part, ties)
        syncs.append(replica_sync(part, blocks, dims, mics) if sharded else None)
    one = parts[0] if len(parts) == 1 else RankModel(parts, [b for bs in blocks_of for b in bs])
    return Parallelized(dims=dims, spec=spec, parts=parts, model=one, stages=stages, num_stages=num_stages, coords=coords,
                        mics=mics, pipeline=pipeline, two_hop=two_hop, sharded=sharded, syncs=syncs, device=device,
                        experts=experts)


def _apply_moe(part: nn.Module, spec: ModelSpec, dims: ParallelDims, device: torch.device,
               layout: ExpertLayout | None) -> ExpertLayout | None:
    """A mixture of experts' balance group (the ranks whose tokens make a micro-batch: every rank, or those of the
    rank's pipeline stage) and, under expert parallelism, its experts spread (distributed/experts.py). Returns the
    layout."""
    if spec.apply_moe is None:
        if dims.ep > 1 and spec.name.startswith("peft:"):
            raise ValueError(f"expert_parallel_degree {dims.ep} with a PEFT model ({spec.name}): spreading the experts "
                             "of a model under LoRA adapters is not verified in the engine; set expert_parallel_degree "
                             "to 1 (MiCS still shards the experts), or train without adapters")
        if dims.ep > 1:
            raise ValueError(f"expert_parallel_degree {dims.ep}: the engine knows no experts in {spec.name} (the "
                             "built-in model with n_experts > 0 and Hugging Face mixtures of experts have them); set "
                             "expert_parallel_degree to 1")
        return None
    made = [layout]

    def make() -> ExpertLayout:  # the spec asks for it where its experts take one (all ranks alike)
        if made[0] is None:
            made[0] = expert_layout(dims, device.type)
        return made[0]

    balance = None
    if dist.is_initialized() and dims.world_size > 1:
        balance = dist.group.WORLD if dims.pp == 1 else stage_data_group(dims)
    layers = spec.apply_moe(part, dims, balance, make)
    layout = made[0]
    if dims.ep > 1 and not layers:
        raise ValueError(f"expert_parallel_degree {dims.ep}: {spec.name} has no mixture-of-experts layers (a dense "
                         "model); set expert_parallel_degree to 1")
    return layout


def stage_data_group(dims: ParallelDims):
    """The data-, context- and tensor-parallel ranks of this rank's pipeline stage: the ranks whose tokens make one
    micro-batch of the stage (tensor-parallel ranks route their sequence shards; a collective the first time: the
    mesh's flattened dimension)."""
    name = "dp_cp_tp_of_stage"
    try:
        return dims.mesh[name].get_group()
    except KeyError:
        return dims.mesh["dp_replicate", "dp_shard_inter", "dp_shard_intra", "cp", "tp"]._flatten(name).get_group()


def apply_compile(blocks: list[nn.Module]) -> None:
    """torch.compile each block's forward in place. The module keeps its identity, so MiCS's hooks stay outside
    the compiled region (they gather and free the parameters eagerly) and checkpoints keep their names; the
    blocks of one model share their code, so one compilation serves them all."""
    for block in blocks:
        block.forward = torch.compile(block.forward)


def _cut(model: nn.Module, spec: ModelSpec, dims: ParallelDims, pp_rank: int, pipeline: PipelineConfig | None):
    if dims.pp == 1:
        return [0], 1, [model]
    if spec.stages is None:
        why = spec.no_stages or "its forward is unknown"
        raise ValueError(f"pipeline_parallel_degree {dims.pp}: the engine cannot cut {spec.name} into stages ({why}); "
                         "pipeline parallelism works for the built-in model and Hugging Face decoder-only causal LMs "
                         "without tied embeddings; use tensor or MiCS sharding instead")
    if spec.stages.verify is not None:
        spec.stages.verify(model)
    if spec.stages.before_cut is not None:
        spec.stages.before_cut(model)
    pipeline = pipeline or PipelineConfig(microbatches=dims.pp)
    num_stages = dims.pp * pipeline.virtual_stages
    stages = rank_stages(pp_rank, dims.pp, pipeline.virtual_stages)
    return stages, num_stages, [cut_stage(model, spec.stages, s, num_stages, pipeline.split) for s in stages]


def _apply_tp(part: nn.Module, spec: ModelSpec, dims: ParallelDims) -> None:
    tp_mesh = dims.mesh["tp"]
    if spec.apply_tp is not None:
        spec.apply_tp(part, tp_mesh)
        return
    plan = spec.tp_plan(part)
    if not plan:
        raise ValueError(f"tensor_parallel_degree {dims.tp}: {spec.name} has no tensor-parallel plan; pass "
                         "tp_plan={'fqn pattern': 'colwise'|'rowwise'|...} to transform()")
    apply_tp_plan(part, tp_mesh, plan, spec.tp_plan_source)


def _materialise(part: nn.Module, spec: ModelSpec, template: nn.Module, device: torch.device, seed: int,
                 init: Callable[[nn.Module], None] | None, *, offload: bool = False, ties: list[Tie] = ()) -> None:
    """Storage for `part`'s shards and buffers, filled. CPU offload: the shards in host memory (FSDP2 wants them
    materialised there), the buffers on the device the forward runs on. `to_empty` gives every module a new
    parameter, so tied ones are tied again before they are filled."""
    part.to_empty(device="cpu" if offload else device)
    retie(part, list(ties), after="materialisation")
    if offload:
        for module in part.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    if init is None and spec.init_sharded is not None:
        spec.init_sharded(part, seed)
    else:
        fn = init or (spec.init_module(template) if spec.init_module else None)
        if fn is None:
            raise ValueError(f"{spec.name} was built on the meta device and has no initialiser: pass init=fn")
        init_by_module(part, template, seed, fn)
    check_materialised(part)


# --- the training step ------------------------------------------------------------------------------------

def plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def sync_for(par: Parallelized, index: int, count: int) -> None:
    """Gradient sync for micro-batch `index` of `count` (2-hop under MiCS; nothing unsharded)."""
    for part, sync in zip(par.parts, par.syncs):
        if isinstance(part, FSDPModule):
            sync_microbatch(part, index, count, two_hop=par.two_hop, sync=sync)


def forward_backward(par: Parallelized, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Forward and backward of this rank's `inputs`/`targets` (whole sequences: under context parallelism each rank
    takes its zig-zag chunks of them) in `microbatches` chunks along the batch, gradients left reduced over the
    data-parallel and context-parallel ranks. Returns this rank's mean loss if it computes the loss (the last
    pipeline stage), else zero, as a detached tensor. Under float16 the losses backpropagated are scaled by the
    model's loss scaler (`par.scaler`); the loss returned is not."""
    total = torch.zeros((), device=inputs.device)
    scale = par.scaler.get_scale() if par.scaler is not None else 1.0
    inputs, targets = par.sequence_shard(inputs), par.sequence_shard(targets)
    with par.spec.loss_context(par.dims.tp):
        if par.dims.pp > 1:
            heartbeat.set_phase("pipeline")
            losses: list[torch.Tensor] = []
            args = (inputs,) if par.holds_first else ()
            # the schedule divides the gradients by the micro-batches itself (scale_grads): a load-balancing loss
            # weighs as a micro-batch's loss before that, the loss scale only
            with aux_weight(scale):
                par.schedule(microbatches, par.scaled(loss_fn)).step(
                    *args, target=targets if par.holds_last else None, losses=losses if par.holds_last else None)
            for loss in losses:  # the scaled losses the schedule backpropagated
                total += plain(loss).detach().float() / scale / microbatches
            par.finish_experts()
            return total
        model = par.parts[0]
        for i, (x, y) in enumerate(zip(inputs.chunk(microbatches), targets.chunk(microbatches))):
            sync_for(par, i, microbatches)
            # Each micro-batch's mean / count: summed over micro-batches and averaged over the data-parallel
            # ranks by the reduction, the gradient is that of the global-batch mean loss.
            heartbeat.set_phase("forward")
            with aux_weight(scale / microbatches):  # a load-balancing loss weighs as this micro-batch's
                loss = loss_fn(model(x), y) / microbatches
            heartbeat.set_phase("backward")
            (par.scaler.scale(loss) if par.scaler is not None else loss).backward()
            total += plain(loss).detach()
        for sync in par.syncs:
            if sync is not None:
                sync.finish()  # autograd's final callback has done it; a no-op then
        par.finish_experts()
    return total


# Gradients of a parameter that tensor parallelism leaves whole agree across the group to rounding (the same
# operations on the same values); one that sees a part of the activations is off by O(1).
TP_GRAD_TOLERANCE = 1e-3


def _sharded_over_tp(p: torch.Tensor) -> bool:
    """A DTensor (parameter or gradient) split, or held as partial sums, along the mesh's "tp" dimension."""
    if not isinstance(p, DTensor) or "tp" not in (p.device_mesh.mesh_dim_names or ()):
        return False
    return not p.placements[p.device_mesh.mesh_dim_names.index("tp")].is_replicate()


def check_tp_gradients(par: Parallelized) -> None:
    """Once per model, after its first backward under tensor parallelism: every parameter that is not sharded
    over "tp" must have the same gradient on every rank of a tensor-parallel group. One that sits between a
    column- and a row-parallel layer outside the plan (a learnable activation: PReLU, xIELU's alphas) sees only
    its rank's part of the activations, gets a partial gradient, and would train apart on each rank: such a model
    is refused here, naming the parameters, instead of training wrong (a collective over the tp group)."""
    if par.dims.tp == 1 or par.tp_checked:
        return
    par.tp_checked = True
    names, stats = [], []
    for name, p in par.model.named_parameters():
        g = p.grad
        if _sharded_over_tp(p) or (g is not None and _sharded_over_tp(g)):
            continue  # split over tp, or a partial sum DTensor reduces (replicated_with_grad_allreduce)
        local = (g.to_local() if isinstance(g, DTensor) else g) if g is not None else None
        names.append(name)
        stats.append(torch.zeros(2) if local is None else
                     torch.stack([local.detach().float().sum().cpu(), local.detach().float().norm().cpu()]))
    if not stats:
        return
    mine = torch.stack(stats).to(par.device)
    group = par.dims.mesh.get_group("tp")
    everyone = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(everyone, mine, group=group)
    spread = torch.stack([(e - everyone[0]).abs() for e in everyone]).amax(0).sum(1)  # of the sum and the norm
    scale = everyone[0][:, 1].abs().clamp_min(1e-12)  # relative to the gradient's norm
    mine_bad = [names[i] for i in torch.nonzero(spread / scale > TP_GRAD_TOLERANCE).flatten().tolist()]
    # every rank decides the same: a rank may hold an empty shard of a small parameter (MiCS pads it)
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine_bad)
    bad = [n for n in names if any(n in f for f in found)]
    if bad:
        raise ValueError(f"tensor_parallel_degree {par.dims.tp}: {', '.join(bad[:5])}"
                         f"{f' and {len(bad) - 5} more' if len(bad) > 5 else ''} got different gradients on the "
                         "ranks of one tensor-parallel group: the parameter is whole on every rank but sees only "
                         "that rank's part of the activations (it sits between a column- and a row-parallel "
                         f"layer, outside the plan {par.spec.tp_plan_source}), so it would train apart; this "
                         "model is refused under tensor parallelism rather than trained wrong: use MiCS sharding "
                         "(mics.partition_group_size), or a plan that shards that module too")


def clip_grad_norm(model: nn.Module, dims: ParallelDims, max_norm: float) -> float:
    """Clip the gradients of the whole model (every stage, every shard) to `max_norm` in 2-norm; returns the
    norm before clipping. Sharded gradients are DTensors whose norm covers their mesh; they are grouped by
    mesh (TP-sharded and MiCS-only parameters live on different ones); the stages' squared norms are summed
    over the pipeline."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    squared = torch.zeros((), device=dims.mesh.device_type, dtype=torch.float32)
    for key, group in groups.items():
        if key is not None and not any(p.is_partial() for p in key[1]):
            squared += sharded_squared_norm(group).to(squared.device)
        else:  # plain tensors, and partial sums (their norm needs the reduced values: DTensor's own)
            squared += plain(torch.nn.utils.get_total_norm(group, 2.0)).float().pow(2)
    if dims.pp > 1:
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=dims.mesh.get_group("pp"))
    value = float(squared.sqrt().item())
    if math.isfinite(max_norm) and grads:
        # the coefficient torch.nn.utils.clip_grad_norm_ uses (1e-6 guards a zero norm)
        coef = min(1.0, max_norm / (value + 1e-6))
        if coef < 1.0:
            for group in groups.values():
                torch._foreach_mul_(group, coef)
    return value


def sharded_squared_norm(grads: list[DTensor]) -> torch.Tensor:
    """The squared 2-norm of DTensor gradients of one mesh and placement (sharded or replicated, not partial):
    the local shards' sum of squares, on the mesh's device, summed over the mesh dimensions that shard them.
    One all-reduce a dimension, where DTensor's own norm (`get_total_norm`) dispatched and propagated shardings
    for every gradient: on a CPU step of a small model that was most of the clipping's time. The local shards
    may live in host memory (CPU offload) while the mesh's collectives run on its device (NCCL takes no CPU
    tensors): the sum moves to the device first."""
    mesh, placements = grads[0].device_mesh, grads[0].placements
    norms = torch._foreach_norm([g.to_local() for g in grads], 2.0, dtype=torch.float32)  # no float32 copies
    total = torch.stack(norms).pow(2).sum().to(mesh.device_type)
    for dim, placement in enumerate(placements):
        if not placement.is_replicate() and mesh.size(dim) > 1:  # Shard, _StridedShard (not a Shard in torch 2.13)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
    return total


def loss_value(total: torch.Tensor, dims: ParallelDims) -> float:
    """The global-batch mean loss from every rank's `forward_backward` total (a collective)."""
    total = total.clone()
    # SUM then divide: never rely on a backend's AVG (gloo once summed silently, pytorch#162338)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / (dims.world_size // dims.pp)  # the ranks that hold the head: dp x cp x tp
