"""The composition of the engine's parallelisms, in the one order that works:

    pipeline split -> tensor/sequence parallelism -> activation checkpointing -> MiCS -> weights

on the mesh `(pp, dp_replicate, dp_shard, tp)` of `ParallelDims`, and the training step of the result:
micro-batches through the pipeline schedule (or a plain loop without one), gradient sync, gradient
clipping over every dimension, and the global-batch loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainyard.engine.distributed.ac import apply_ac
from trainyard.engine.distributed.mics import MiCSConfig, apply_mics, sync_microbatch
from trainyard.engine.models.llama.model import ModelConfig, Transformer, build_model, init_weights
from trainyard.engine.distributed.dims import ParallelDims
from trainyard.engine.distributed.pipeline import PipelineConfig, build_schedule, build_stage_model, rank_stages
from trainyard.engine.models.llama.tp_plan import apply_tp, loss_context


class RankModel(nn.Module):
    """Every piece of the model this rank holds, under the whole model's names (`layers.4...`), for the
    optimizer, clipping and checkpoints. The pieces are shared with the pipeline stages, not copied."""

    def __init__(self, parts: list[Transformer]) -> None:
        super().__init__()
        self.config = parts[0].config
        self.tok_embeddings = next((p.tok_embeddings for p in parts if p.tok_embeddings is not None), None)
        self.layers = nn.ModuleDict()
        for part in parts:
            for name, block in part.layers.items():
                self.layers[name] = block
        self.norm = next((p.norm for p in parts if p.norm is not None), None)
        self.output = next((p.output for p in parts if p.output is not None), None)


@dataclass(kw_only=True)
class Parallelized:
    dims: ParallelDims
    parts: list[Transformer]
    """This rank's model pieces: the whole model without a pipeline, else one per stage it holds."""
    model: nn.Module
    """The pieces as one module under the model's parameter names (the model itself without a pipeline)."""
    schedule: object | None
    """The pipeline schedule (None without a pipeline)."""
    holds_first: bool
    """Whether this rank holds the embedding (and so takes the token ids)."""
    holds_last: bool
    """Whether this rank holds the head (and so computes the loss)."""
    two_hop: bool = True


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens; with vocab-sharded DTensor logits (under `loss_context`) the
    full logits are never gathered."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def parallelize(cfg: ModelConfig, dims: ParallelDims, *, seed: int, device: torch.device, ac: str = "none",
                mics: MiCSConfig | None = None, pipeline: PipelineConfig | None = None,
                seq_len: int | None = None, two_hop: bool = True) -> Parallelized:
    """Build this rank's part of the model, parallelised over `dims` (whose mesh is built), with weights
    identical to those of the unsharded model."""
    mesh = dims.mesh
    mics = mics or MiCSConfig()
    if dims.pp > 1:
        if pipeline is None:
            raise ValueError(f"pipeline parallel degree {dims.pp} needs a PipelineConfig")
        num_stages = dims.pp * pipeline.virtual_stages
        stages = rank_stages(dims.coords(dist.get_rank())["pp"], dims.pp, pipeline.virtual_stages)
        parts = [build_stage_model(cfg, s, num_stages, pipeline.split) for s in stages]
    else:
        num_stages, stages, parts = 1, [0], [build_model(cfg)]
    for part in parts:
        if dims.tp > 1:
            apply_tp(part, mesh["tp"], seq_len=seq_len)
        apply_ac(part, ac)
        apply_mics(part, dims, mics)
        init_weights(part, seed, device=device)
    schedule = None
    if dims.pp > 1:
        schedule = build_schedule(parts, stages, num_stages, pp_group=mesh.get_group("pp"), device=device,
                                  config=pipeline, loss_fn=token_loss)
    model = parts[0] if len(parts) == 1 and dims.pp == 1 else RankModel(parts)
    return Parallelized(dims=dims, parts=parts, model=model, schedule=schedule, holds_first=0 in stages,
                        holds_last=num_stages - 1 in stages, two_hop=two_hop)


def forward_backward(par: Parallelized, rows: torch.Tensor, microbatches: int) -> torch.Tensor:
    """Forward and backward of this rank's `rows` (batch, seq + 1) in `microbatches` chunks, gradients left
    reduced over the data-parallel ranks. Returns the sum over ranks that hold the head of their mean
    loss (a tensor; zero elsewhere)."""
    inputs, targets = rows[:, :-1], rows[:, 1:]
    total = torch.zeros((), device=rows.device)
    with loss_context(par.dims.tp):
        if par.schedule is not None:
            losses: list[torch.Tensor] = []
            args = (inputs,) if par.holds_first else ()
            par.schedule.step(*args, target=targets if par.holds_last else None,
                              losses=losses if par.holds_last else None)
            for loss in losses:
                total += _plain(loss).detach() / microbatches
            return total
        model = par.parts[0]
        for i, (x, y) in enumerate(zip(inputs.chunk(microbatches), targets.chunk(microbatches))):
            # 2-hop: reduce-scatter inside the partition group every micro-batch, all-reduce across the
            # replicas on the last one only (flat HSDP, two_hop False: both every micro-batch).
            if isinstance(model, FSDPModule):
                sync_microbatch(model, i, microbatches, two_hop=par.two_hop)
            # Each micro-batch's mean / count: summed over micro-batches and averaged over the
            # data-parallel ranks by the reduction, the gradient is that of the global-batch mean loss.
            loss = token_loss(model(x), y) / microbatches
            loss.backward()
            total += _plain(loss).detach()
    return total


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(par: Parallelized, max_norm: float) -> float:
    """Clip the gradients of the whole model (every stage, every shard) to `max_norm` in 2-norm; returns the
    norm before clipping. Sharded gradients are DTensors, whose norm already covers their mesh; the
    stages' squared norms are summed over the pipeline."""
    grads = [p.grad for p in par.model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=par.dims.mesh.device_type)
    norm = _plain(norm).float()
    if par.dims.pp > 1:
        squared = norm.pow(2)
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=par.dims.mesh.get_group("pp"))
        norm = squared.sqrt()
    value = float(norm.item())
    if math.isfinite(max_norm) and grads:
        # the coefficient torch.nn.utils.clip_grad_norm_ uses (1e-6 guards a zero norm)
        coef = min(1.0, max_norm / (value + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
    return value


def loss_value(total: torch.Tensor, dims: ParallelDims) -> float:
    """The global-batch mean loss from every rank's `forward_backward` total (a collective)."""
    total = total.clone()
    # SUM then divide: never rely on a backend's AVG (gloo once summed silently, pytorch#162338)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / (dims.world_size // dims.pp)  # the ranks that hold the head: dp x tp
