"""`check_equivalence`: before a long job, one step of the sharded model against the unsharded one.

Every rank builds the model twice from the same seed: once unsharded (the oracle: the whole global batch in
one forward and backward on this process) and once through `transform` on the job's layout (this rank's
rows, in micro-batches, through the pipeline when there is one). The report compares the global-batch mean
loss, the total gradient norm and every parameter's gradient (gathered to full size), by relative error.
For a model that fits on one process; fp32 agrees to ~1e-6, bf16 to ~1e-2.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from trainyard.engine import api
from trainyard.engine.distributed.experts import aux_weight
from trainyard.engine.distributed.materialize import is_meta
from trainyard.engine.distributed.parallelize import _materialise, plain
from trainyard.engine.distributed.ties import find_ties
from trainyard.engine.models.registry import resolve_spec


@dataclass(kw_only=True)
class EquivalenceReport:
    loss: tuple[float, float]
    """(unsharded, sharded) global-batch mean loss."""
    grad_norm: tuple[float, float]
    """(unsharded, sharded) total gradient norm."""
    worst_grad: tuple[str, float]
    """The parameter whose gradient differs most, and its relative error ||g - g_ref|| / ||g_ref||."""
    tolerance: float
    parameters: int

    @property
    def loss_rel_err(self) -> float:
        return abs(self.loss[1] - self.loss[0]) / max(abs(self.loss[0]), 1e-12)

    @property
    def grad_norm_rel_err(self) -> float:
        return abs(self.grad_norm[1] - self.grad_norm[0]) / max(self.grad_norm[0], 1e-12)

    @property
    def ok(self) -> bool:
        return max(self.loss_rel_err, self.grad_norm_rel_err, self.worst_grad[1]) <= self.tolerance

    def __str__(self) -> str:
        rows = [("loss", *self.loss, self.loss_rel_err), ("grad norm", *self.grad_norm, self.grad_norm_rel_err)]
        lines = [f"{'':<12}{'unsharded':>14}{'sharded':>14}{'rel. error':>12}"]
        lines += [f"{n:<12}{a:>14.6g}{b:>14.6g}{e:>12.2e}" for n, a, b, e in rows]
        lines.append(f"worst gradient of {self.parameters} parameters: {self.worst_grad[0]} "
                     f"(rel. error {self.worst_grad[1]:.2e})")
        lines.append(f"{'EQUIVALENT' if self.ok else 'NOT EQUIVALENT'} within {self.tolerance:g}")
        return "\n".join(lines)


def check_equivalence(build: Callable[[], nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
                      loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *, microbatches: int = 1,
                      seed: int = 0, tolerance: float = 1e-4, verbose: bool = True,
                      **transform_kwargs) -> EquivalenceReport:
    """One step of `build()` through `transform(**transform_kwargs)` against `build()` unsharded, on the global
    batch (`inputs`, `targets`: the same on every rank). A collective: every rank calls it. `loss_fn(output,
    targets)` is the mean loss of a batch. Prints the report on rank 0 when `verbose`."""
    ctx = api.current()
    torch.manual_seed(seed)
    reference = _unsharded(build(), ctx.device, seed, transform_kwargs.get("init"))
    torch.manual_seed(seed)
    model = api.transform(build(), seed=seed, **transform_kwargs)
    # the sharded run's micro-batch i is chunk i of every data-parallel rank's rows: the reference's too (a mixture
    # of experts balances the tokens of a micro-batch together; for any other model only the order differs)
    dp = api._layout(model).dims.dp
    ref_loss = torch.zeros((), device=ctx.device)
    for x, y in zip(_microbatches(inputs, dp, microbatches), _microbatches(targets, dp, microbatches)):
        with aux_weight(1 / microbatches):
            loss_i = loss_fn(reference(x.to(ctx.device)), y.to(ctx.device)) / microbatches
        loss_i.backward()
        ref_loss += loss_i.detach()
    ref_grads = {n: p.grad.detach().float() for n, p in reference.named_parameters() if p.grad is not None}
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()])).item()

    # this model's layout decides the rows (transform's distribution= may differ from init's)
    loss = api.forward_backward(model, api.rows(model, inputs).to(ctx.device), api.rows(model, targets).to(ctx.device),
                                loss_fn, microbatches=microbatches)
    norm = api.clip_grad_norm_(model, float("inf"))
    errors = {}
    for name, p in model.named_parameters():
        if p.grad is None or name not in ref_grads:
            continue
        g = plain(p.grad).float()
        errors[name] = ((g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12)).item()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    merged: dict[str, float] = {}
    for part in gathered:
        for k, v in part.items():
            merged[k] = max(v, merged.get(k, 0.0))
    missing = sorted(set(ref_grads) - set(merged))
    if missing:
        raise ValueError(f"check_equivalence: {len(missing)} parameter(s) got no gradient in the sharded model: "
                         f"{missing[:5]}")
    worst = max(merged.items(), key=lambda kv: kv[1])
    report = EquivalenceReport(loss=(ref_loss.item(), loss), grad_norm=(ref_norm, norm), worst_grad=worst,
                               tolerance=tolerance, parameters=len(merged))
    if verbose and ctx.is_main:
        print(report, flush=True)
    return report


def _unsharded(model: nn.Module, device: torch.device, seed: int, init) -> nn.Module:
    """`model` on `device`, whole; one built on the meta device is initialised as `transform` initialises it
    (layout-independently, from `seed`)."""
    if not is_meta(model):
        return model.to(device)
    _materialise(model, resolve_spec(model), copy.deepcopy(model), device, seed, init, ties=find_ties(model))
    return model


def _microbatches(rows: torch.Tensor, dp: int, count: int) -> list[torch.Tensor]:
    """The global micro-batches of `rows` as the data-parallel ranks split them: rank r takes the r-th block of
    rows and cuts it into `count`; micro-batch i joins every rank's i-th piece."""
    per_rank = [block.chunk(count) for block in rows.chunk(dp)]
    return [torch.cat([pieces[i] for pieces in per_rank]) for i in range(count)]
