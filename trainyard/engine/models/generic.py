"""The spec of any `nn.Module`: blocks found by structure, tensor parallelism only from a user's plan, no
pipeline (a module's forward cannot be cut without knowing it), initialisation by `reset_parameters`.

Blocks, unless given: the children of the model's largest `nn.ModuleList` (or `nn.ModuleDict`) by parameter
count, e.g. `self.layers`, `self.h`, `self.blocks`, `self.stack`. A model with none is sharded as one unit.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from trainyard.engine.protocols import ModelSpec


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def largest_list(model: nn.Module) -> list[nn.Module]:
    """The children of the largest ModuleList/ModuleDict of `model` (by parameters); [] when there is none."""
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
    if not lists:
        return []
    best = max(lists, key=_params)
    return [b for b in (best.values() if isinstance(best, nn.ModuleDict) else best) if b is not None]


def blocks_selector(blocks) -> Callable[[nn.Module], list[nn.Module]]:
    """`blocks` as a function of the model: a callable is used as is; classes (or class names) select every
    module of those classes not inside another selected one; names select modules by path."""
    if callable(blocks) and not isinstance(blocks, type):
        return blocks
    wanted = list(blocks) if isinstance(blocks, (list, tuple, set)) else [blocks]

    def select(model: nn.Module) -> list[nn.Module]:
        if all(isinstance(w, str) and "." not in w and w[:1].isupper() for w in wanted) or \
                all(isinstance(w, type) for w in wanted):
            found = blocks_by_class(model, wanted)
        else:
            found = [model.get_submodule(str(w)) for w in wanted]
        if not found:
            raise ValueError(f"blocks {wanted!r} select no module of {type(model).__name__}; give block classes, "
                             "module paths (e.g. 'layers.0') or a function of the model")
        return found

    return select


def blocks_by_class(model: nn.Module, classes: list) -> list[nn.Module]:
    """Every module of `classes` (types, or class names) not inside another one, in forward (definition) order."""
    def hit(m: nn.Module) -> bool:
        return any(type(m) is c if isinstance(c, type) else type(m).__name__ == c for c in classes)

    out: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if child is None:
                continue
            if hit(child):
                out.append(child)
            else:
                walk(child)

    walk(model)
    return out


def reset_parameters_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """The per-module initialiser of plain PyTorch modules: their own `reset_parameters()`."""
    def init(module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        elif any(True for _ in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
            raise ValueError(f"{type(module).__name__} owns parameters or buffers but has no reset_parameters(): "
                             "the engine cannot initialise it on the meta device; pass init=fn (called on every "
                             "module, as model.apply(fn)), or build the model with real weights")
    return init


def spec_for(model: nn.Module) -> ModelSpec:
    return ModelSpec(name=type(model).__name__, blocks=largest_list, init_module=reset_parameters_init)
