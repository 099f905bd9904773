"""Weights of a parallelised model that do not depend on its layout.

A model built with real weights keeps them: before anything is sharded, rank 0's values are broadcast so
that every rank starts from the same model whatever seed each used (`broadcast_weights`).

A model built on the meta device is materialised after sharding (`to_empty`) and filled module by module
(`init_by_module`): for every module of the unsharded meta template that owns parameters or buffers, a CPU
copy of that module alone is materialised, the CPU generator is seeded from (seed, module path), the
initialiser runs on it (HF `_init_weights`, `reset_parameters`, or the user's `init=`), and each rank copies
its own piece of every full value (`distribute_tensor` with no source rank: no communication). One module's
full weights are in memory at a time, and 1 process or N processes start from bit-identical weights. A tied
weight is filled once, by the first module that holds it (the input embedding before the head, as Hugging
Face's `tie_weights` leaves it).
"""
from __future__ import annotations

import copy
import zlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@torch.no_grad()
def broadcast_weights(model: nn.Module, group=None) -> None:
    """Every parameter and buffer of (unsharded) `model` set to rank 0's values."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    for t in (*model.parameters(), *model.buffers()):
        dist.broadcast(t.data, src=0, group=group)


def module_seed(seed: int, path: str) -> int:
    """Generator seed of one module: stable across processes and runs (crc32, not hash()). 32 bits: the CPU
    generator (mt19937) keeps only the low 32 bits of its seed."""
    return zlib.crc32(f"{seed}/{path}".encode())


@torch.no_grad()
def copy_piece(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's piece of `full` into `target` (a DTensor piece, or a whole plain tensor)."""
    if isinstance(target, DTensor):
        piece = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(piece.to_local())
    else:
        if target.shape != full.shape:
            raise ValueError(f"shape {tuple(full.shape)} does not fit {tuple(target.shape)}")
        target.copy_(full)


@torch.no_grad()
def init_by_module(model: nn.Module, template: nn.Module, seed: int, init: Callable[[nn.Module], None]) -> None:
    """Fill the materialised (possibly sharded, possibly a pipeline stage of) `model` from `template`, the
    unsharded model on the meta device, one module at a time (see the module docstring)."""
    own = dict(model.named_modules())
    filled: set[int] = set()  # template tensors filled already: a tied weight keeps its first module's values
    for path, tmod in template.named_modules():
        target = own.get(path)
        if target is None:
            continue  # another pipeline stage's module
        names = [n for n, t in (*tmod.named_parameters(recurse=False), *tmod.named_buffers(recurse=False))
                 if id(t) not in filled]
        filled.update(id(t) for t in (*tmod.parameters(recurse=False), *tmod.buffers(recurse=False)))
        if not names:
            continue
        cpu = copy.deepcopy(tmod).to_empty(device="cpu", recurse=False)
        for name in names:  # NaN marks what the initialiser leaves unfilled (to_empty leaves garbage)
            t = getattr(cpu, name)
            if t is not None and t.is_floating_point():
                t.data.fill_(float("nan"))
        # the CPU generator only: the copy is on the CPU, and torch.manual_seed would also queue a CUDA seeding
        # with its stack trace on a machine where CUDA is not initialised (about 10% of the CPU of a small HF model's
        # transform and 2 steps); on a GPU the CUDA generator keeps the state it had (the trainer's seed)
        torch.random.default_generator.manual_seed(module_seed(seed, path))
        init(cpu)
        for name in names:
            full, dest = getattr(cpu, name), getattr(target, name, None)
            if dest is None or full is None:
                continue
            if full.is_meta or (full.is_floating_point() and torch.isnan(full).any()):
                raise ValueError(f"{path or type(model).__name__}.{name} ({type(tmod).__name__}) was not filled by "
                                 f"its initialiser; give init= a function that fills every module's parameters "
                                 "and buffers (e.g. fall back to module.reset_parameters())")
            copy_piece(dest, full)


def check_materialised(model: nn.Module) -> None:
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{len(left)} tensor(s) still on the meta device: {left[:5]}; pass init= or "
                         "load_pretrained weights")
