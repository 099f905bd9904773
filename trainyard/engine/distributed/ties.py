"""Parameters that several modules share: tied embeddings (`lm_head.weight` is `embed_tokens.weight`), or one
weight two blocks use. A tie is one `nn.Parameter` object reached under several names.

Steps of `parallelize` create new parameters module by module, and a new parameter per module breaks a tie
without a word: `to_empty` (a model built on the meta device), tensor parallelism (`distribute_module` gives
each module its own DTensor). Two copies of a tied weight then train apart: a different model, no error. So
ties are found on the model as built (`find_ties`), put back after each such step (`retie`) and checked at
the end (`check_ties`); a tie that cannot be kept (its members sharded two different ways) is refused,
naming the parameters. Blocks that share a parameter are sharded by MiCS as one unit (`shard_units`): FSDP2
manages a parameter in one group only.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True, slots=True)
class Tie:
    """The names of one shared parameter, in definition order (the first is its canonical name)."""

    names: tuple[str, ...]

    def __str__(self) -> str:
        return " = ".join(self.names)


def find_ties(model: nn.Module) -> list[Tie]:
    """Every parameter of `model` reached under more than one name."""
    names: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for leaf, p in module._parameters.items():
            if p is not None:
                name = f"{path}.{leaf}" if path else leaf
                if name not in names.setdefault(id(p), []):
                    names[id(p)].append(name)
    return [Tie(tuple(n)) for n in names.values() if len(n) > 1]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    path, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(path) if path else model
    except AttributeError:
        return None  # a module this pipeline stage does not hold
    return (module, leaf) if module is not None and leaf in module._parameters else None


def _layout(p) -> tuple:
    return (p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else ()


def retie(model: nn.Module, ties: list[Tie], *, after: str) -> None:
    """Make every name of each tie the same parameter again (the first name's), after the step `after` may have
    split them. A tie whose members were laid out differently (a DTensor and a plain tensor, or two placements)
    is refused: one weight cannot be sharded two ways."""
    for tie in ties:
        owners = [(n, o) for n in tie.names if (o := _owner(model, n)) is not None]
        if len(owners) < 2:
            continue
        first_name, (module, leaf) = owners[0]
        canonical = module._parameters[leaf]
        for name, (m, attr) in owners[1:]:
            p = m._parameters[attr]
            if p is canonical:
                continue
            if _layout(p) != _layout(canonical) or p.shape != canonical.shape:
                raise ValueError(
                    f"{name} and {first_name} are one parameter (tied), but {after} laid them out differently "
                    f"({_describe(p)} and {_describe(canonical)}): one weight cannot be sharded two ways. Give "
                    "both modules the same tp_plan style (or leave both out of it), or untie them in the model")
            m._parameters[attr] = canonical


def _describe(p) -> str:
    return f"{type(p).__name__}{list(p.placements)}" if isinstance(p, DTensor) else "a plain tensor"


def check_ties(model: nn.Module, ties: list[Tie]) -> None:
    """ValueError unless each tie is still one parameter on this rank (names it does not hold are skipped)."""
    for tie in ties:
        held = {n: o[0]._parameters[o[1]] for n in tie.names if (o := _owner(model, n)) is not None}
        if len({id(p) for p in held.values()}) > 1:
            raise ValueError(f"tied parameters {' = '.join(held)} became separate tensors while the model was laid "
                             "out: they would train apart. This is a bug of the engine; please report it with "
                             "the model's class")


def shard_units(model: nn.Module, blocks: list[nn.Module], ties: list[Tie]) -> list[list[nn.Module]]:
    """`blocks` grouped so that blocks sharing a parameter form one unit (in the order of their first block)."""
    paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    prefixes = [paths.get(id(b), "") + "." for b in blocks]
    parent = list(range(len(blocks)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for tie in ties:
        members = {i for n in tie.names for i, pre in enumerate(prefixes) if pre != "." and n.startswith(pre)}
        members = sorted(members)
        for i in members[1:]:
            parent[root(i)] = root(members[0])
    units: dict[int, list[nn.Module]] = {}
    for i, block in enumerate(blocks):
        units.setdefault(root(i), []).append(block)
    return list(units.values())
