"""Tensor parallelism from a plan: `{"fqn pattern": style}` applied with DTensor's `parallelize_module`.

A pattern is a module path whose atoms may be `*` (`model.layers.*.self_attn.q_proj`); patterns that match
no module of this rank's model (a pipeline stage without the head) are skipped. A style is a torch
`ParallelStyle` or one of these names (Hugging Face's plan names where they exist):

    colwise                  Linear split over its output features (Megatron's column-parallel)
    rowwise                  Linear split over its input features, output all-reduced (row-parallel)
    colwise_gather_output    column-parallel whose output is all-gathered: plain full logits for a head
    (alias colwise_rep)
    embedding_rowwise        Embedding split over its rows (vocabulary), output all-reduced
    sequence_parallel        a norm on sequence shards (with a plan that keeps activations sharded)

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

STYLE_NAMES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise", "sequence_parallel")


def style_of(name: str | ParallelStyle, fqn: str) -> ParallelStyle:
    """The ParallelStyle a plan entry names."""
    if isinstance(name, ParallelStyle):
        return name
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if name == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "sequence_parallel":
        return SequenceParallel()
    raise ValueError(f"tp_plan[{fqn!r}]: unknown style {name!r}; use one of {list(STYLE_NAMES)} or a torch "
                     "ParallelStyle")


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


def check_plan(model: nn.Module, resolved: dict[str, object], tp: int) -> None:
    """ValueError naming the module when a split dimension is not a multiple of `tp`."""
    for fqn, style in resolved.items():
        module = model.get_submodule(fqn)
        if isinstance(module, nn.Linear) and style in ("colwise", "colwise_gather_output", "colwise_rep"):
            dim, what = module.out_features, "out_features"
        elif isinstance(module, nn.Linear) and style == "rowwise":
            dim, what = module.in_features, "in_features"
        elif isinstance(module, nn.Embedding) and style == "embedding_rowwise":
            dim, what = module.num_embeddings, "num_embeddings"
        else:
            continue
        if dim % tp:
            raise ValueError(f"tensor_parallel_degree {tp} must divide {fqn}.{what} = {dim} ({style}); choose a "
                             f"degree that divides {dim}, or leave {fqn} out of tp_plan")


def apply_tp_plan(model: nn.Module, tp_mesh, plan: dict) -> dict[str, object]:
    """Shard `model` in place over the 1-D `tp_mesh` as `plan` says; returns the resolved plan."""
    resolved = resolve_plan(model, plan)
    if not resolved:
        raise ValueError(f"tp_plan matches no module of {type(model).__name__}: patterns {sorted(plan)}; module "
                         "paths look like 'layers.0.attn.proj' (see model.named_modules())")
    check_plan(model, resolved, tp_mesh.size())
    parallelize_module(model, tp_mesh, {fqn: style_of(style, fqn) for fqn, style in resolved.items()})
    return resolved
