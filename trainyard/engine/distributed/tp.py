"""Tensor parallelism from a plan: `{"fqn pattern": style}` applied with DTensor's `parallelize_module`.

A pattern is a module path whose atoms may be `*` (`model.layers.*.self_attn.q_proj`); patterns that match
no module of this rank's model (a pipeline stage without the head) are skipped. A style is a torch
`ParallelStyle` or one of these names (Hugging Face's plan names, which transformers 5 emits):

    colwise                  Linear split over its output features (Megatron's column-parallel)
    rowwise                  Linear split over its input features, output all-reduced (row-parallel)
    colwise_gather_output    column-parallel whose output is all-gathered: full outputs (a head, or a packed
    (alias colwise_rep)      q/k/v or gate/up projection whose halves are not whole heads)
    rowwise_split_input      row-parallel whose input is full on every rank and is split locally (the partner
                             of colwise_gather_output)
    embedding_rowwise        Embedding split over its rows (vocabulary), output all-reduced
    replicated_with_grad_allreduce
                             parameters replicated, gradient summed over the group: a per-head norm (q_norm,
                             k_norm) after a column-parallel projection, whose input is this rank's heads
    sequence_parallel        a norm on sequence shards (with a plan that keeps activations sharded)

Any other name (transformers' `packed_colwise`, `moe_tp_experts`, ...) is refused before anything is sharded,
naming the plan it came from and the module, as is a style on a module it cannot shard (GPT-2's `Conv1D`:
column/row splits apply to `nn.Linear` and `nn.Embedding`).

Column- then row-parallel in one block costs one all-reduce forward and one backward (Megatron-LM); the
module receives and returns plain tensors, so model code does not change. What a split needs (heads,
widths divisible by the degree) is checked before anything is sharded, naming the module and the number.
"""
from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

STYLE_NAMES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input",
               "embedding_rowwise", "replicated_with_grad_allreduce", "sequence_parallel")
# the styles that split a weight, and the module types they can split
_SPLITS = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input", "embedding_rowwise")


def style_of(name: str | ParallelStyle, fqn: str, source: str = "tp_plan") -> ParallelStyle:
    """The ParallelStyle a plan entry names. `source` names the plan in errors (the user's `tp_plan`, or a
    model's own)."""
    if isinstance(name, ParallelStyle):
        return name
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("embedding_rowwise", "rowwise_split_input"):
        return RowwiseParallel(input_layouts=Replicate())
    if name == "replicated_with_grad_allreduce":
        # the input is this rank's share of the heads (not the sequence: any dimension but the normalised
        # last one serves); the weight's gradient is then a partial sum, which DTensor all-reduces
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    if name == "sequence_parallel":
        return SequenceParallel()
    raise ValueError(f"{source}[{fqn!r}]: style {name!r} is not one the engine maps (it knows "
                     f"{', '.join(STYLE_NAMES)}); {_NO_STYLE_FIX[source == 'tp_plan']}")


_NO_STYLE_FIX = {True: "use one of those or a torch ParallelStyle",
                 False: "tensor parallelism is refused for this model rather than trained wrong: use MiCS "
                        "sharding (mics.partition_group_size), or pass a tp_plan of your own to transform()"}


def _matches(pattern: str, fqn: str) -> bool:
    atoms, parts = pattern.split("."), fqn.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))


def resolve_plan(model: nn.Module, plan: dict) -> dict[str, object]:
    """The plan's entries by the module paths of `model` they match (patterns matching nothing dropped)."""
    names = [n for n, m in model.named_modules() if n and m is not None]
    out: dict[str, object] = {}
    for pattern, style in plan.items():
        for name in names:
            if _matches(pattern, name):
                out[name] = style
    return out


def check_plan(model: nn.Module, resolved: dict[str, object], tp: int, source: str = "tp_plan") -> None:
    """ValueError naming the module when a style does not apply to it (a split of anything but nn.Linear and
    nn.Embedding, an unknown style) or a split dimension is not a multiple of `tp`."""
    for fqn, style in resolved.items():
        style_of(style, fqn, source)
        module = model.get_submodule(fqn)
        if style in _SPLITS and not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ValueError(f"{source}[{fqn!r}]: style {style!r} splits an nn.Linear or nn.Embedding weight, but "
                             f"{fqn} is a {type(module).__name__}; tensor parallelism cannot shard it (GPT-2's "
                             "Conv1D keeps its weight transposed and q/k/v packed): leave it out of the plan and "
                             "use MiCS sharding for this model")
        if isinstance(module, nn.Linear) and style in ("colwise", "colwise_gather_output", "colwise_rep"):
            dim, what = module.out_features, "out_features"
        elif isinstance(module, nn.Linear) and style in ("rowwise", "rowwise_split_input"):
            dim, what = module.in_features, "in_features"
        elif isinstance(module, nn.Embedding) and style == "embedding_rowwise":
            dim, what = module.num_embeddings, "num_embeddings"
        else:
            continue
        if dim % tp:
            raise ValueError(f"tensor_parallel_degree {tp} must divide {fqn}.{what} = {dim} ({style}); choose a "
                             f"degree that divides {dim}, or leave {fqn} out of {source}")


def apply_tp_plan(model: nn.Module, tp_mesh, plan: dict, source: str = "tp_plan") -> dict[str, object]:
    """Shard `model` in place over the 1-D `tp_mesh` as `plan` says; returns the resolved plan. `source` names
    the plan in errors."""
    resolved = resolve_plan(model, plan)
    if not resolved:
        raise ValueError(f"{source} matches no module of {type(model).__name__}: patterns {sorted(plan)}; module "
                         "paths look like 'layers.0.attn.proj' (see model.named_modules())")
    check_plan(model, resolved, tp_mesh.size(), source)
    # torch's styles make new Parameters, and some (SequenceParallel's replicated weights: the q/k norms of Qwen3's
    # plan) drop requires_grad: a frozen weight (under LoRA, or frozen by the user) would train
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, {fqn: style_of(style, fqn, source) for fqn, style in resolved.items()})
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return resolved
