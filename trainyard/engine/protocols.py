"""The seam between a model and the engine's parallelisms: a `ModelSpec` says what the engine needs to know
about a model family, so that model code stays parallel-agnostic and `parallelize` receives any module.

    blocks(model)          the units sharded and gathered one at a time, in forward order
    tp_plan(model)         {fqn pattern: style} for `distributed.tp.apply_tp_plan`, or None (no TP)
    apply_tp(model, mesh)  a model-specific TP (e.g. with sequence parallelism and a vocab-parallel loss);
                           when given it replaces tp_plan
    check_tp(model, tp)    ValueError naming the dimension a degree does not divide (heads, widths)
    apply_cp(model, mesh)  context parallelism: the model runs on its rank's zig-zag chunks of each sequence
                           (exact attention over the whole sequence); None: its attention cannot be split
    apply_moe(model, dims, group, layout)  a mixture of experts' balance group and expert parallelism (`layout()`
                           makes the `ExpertLayout` its experts take, a collective: called alike on every rank)
    stages                 how to cut the model into pipeline stages (None: no pipeline parallelism)
    init_module(model)     a function filling one module's own parameters and buffers (HF `_init_weights`,
                           `reset_parameters`), used for models built on the meta device; None when the
                           spec initialises the whole sharded model itself (`init_sharded`)
    loss_context(tp)       the context forward and loss run in (vocab-parallel cross-entropy)

Specs are found by `models.registry.resolve_spec(model)`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass(kw_only=True)
class StageSplit:
    """How a model is cut into pipeline stages by module names.

    Every stage is a copy of the model (cheap on the meta device) from which what it does not hold is
    removed: blocks of other stages, the `first` modules except on stage 0 and the `last` modules except on
    the final stage (set to None, or to nn.Identity for those in `identity`). The blocks of other stages
    either leave the container (it becomes a ModuleDict keyed by the original indices, so parameter names do
    not change) or, with `placeholders`, are replaced in the model's own ModuleList by `OtherStage` modules
    (pipeline.py): the list keeps its length, so the model's own forward runs unchanged and settings it reads
    by layer index stay right. `forward(stage_model, x)` runs a stage: token ids in on the first stage, hidden
    states between stages, the model's output (logits) on the last.
    """

    blocks: str
    """Path of the block container (`layers`, `model.layers`)."""
    first: tuple[str, ...]
    """Paths of the modules before the blocks (embeddings)."""
    last: tuple[str, ...]
    """Paths of the modules after the blocks (final norm, head)."""
    identity: tuple[str, ...] = ()
    """Those of `first`/`last` that a stage without them gets as nn.Identity (the model's forward calls them)."""
    placeholders: bool = False
    """Blocks of other stages become `OtherStage` placeholders in place (see above)."""
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    """The stage forward; None: the model's own forward copes with missing pieces."""
    verify: Callable[[nn.Module], None] | None = None
    """Called with the whole model before it is cut: ValueError, naming the model, when its stages would not
    compute what the model computes (e.g. a split run of a small model of the same family differs)."""
    before_cut: Callable[[nn.Module], None] | None = None
    """Called with the whole model after `verify`, before it is cut (a PEFT model keeps a meta copy of itself)."""
    context_parallel: bool = False
    """Its stages run under context parallelism as the whole model does: each block takes the rank's zig-zag
    chunks and their global positions by itself (the built-in model's blocks do; an HF model's positions come
    from a hook on the model's own forward, which no stage runs)."""


@dataclass(kw_only=True)
class ModelSpec:
    name: str
    blocks: Callable[[nn.Module], list[nn.Module]]
    tp_plan: Callable[[nn.Module], dict | None] = lambda model: None
    tp_plan_source: str = "tp_plan"
    """How errors name the plan: the user's `tp_plan`, or the model's own (`Phi3ForCausalLM._tp_plan`)."""
    apply_tp: Callable[[nn.Module, object], None] | None = None
    check_tp: Callable[[nn.Module, int], None] = lambda model, tp: None
    apply_cp: Callable[[nn.Module, object], None] | None = None
    """Context parallelism over a 1-D mesh (ring attention, rotary positions of the rank's chunks); None refuses it."""
    apply_moe: Callable[[nn.Module, object, object, object], int] | None = None
    """A mixture of experts: (model, ParallelDims, balance group, ExpertLayout or None) sets the group the
    load-balancing loss counts over and, with a layout, spreads the experts (ValueError for a layout it does not
    take); returns the number of MoE layers (0: a dense model). None: the family has no experts the engine knows
    (expert parallelism refused)."""
    stages: StageSplit | None = None
    no_stages: str | None = None
    """Why the model cannot be cut into stages, when `stages` is None and the reason is the model's own."""
    note: str | None = None
    """One line transform() prints on the first rank (e.g. that the family was never verified here)."""
    init_module: Callable[[nn.Module], Callable[[nn.Module], None] | None] | None = None
    """Given the model, the per-module initialiser to use (None: the model has none)."""
    init_sharded: Callable[[nn.Module, int], None] | None = None
    """Initialise the whole (sharded, materialised) model from a seed, layout-independently."""
    loss_context: Callable[[int], contextlib.AbstractContextManager] = \
        field(default=lambda tp: contextlib.nullcontext())
