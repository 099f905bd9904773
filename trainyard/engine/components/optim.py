"""AdamW and the learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio * lr."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

# AdamW moments as in Llama / GPT-3 training: beta2 0.95 reacts faster to gradient-scale changes
# than the 0.999 default, which matters for short runs and large learning rates.
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr used at 1-based optimizer step `step`."""
    if warmup_steps and step <= warmup_steps:
        return step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings, none on vectors (norm weights). On CUDA it is
    PyTorch's fused AdamW (one multi-tensor kernel per step over the shards' local tensors; why trainyard.kernels
    has no AdamW of its own: see its docstring), and PyTorch's fused CPU AdamW for the host-resident shards of a
    model offloaded from a GPU (3-7x the foreach one on a CPU, measured); on a CPU-only host the foreach one
    (bit-identical to PyTorch's default there, the single-tensor loop, which dispatches every op of every DTensor
    shard on its own: a sharded tiny model's step 15.2 -> 1.6 ms)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    params = decay + no_decay
    offloaded = torch.cuda.is_available() and all(p.device.type == "cpu" for p in params)
    fused = all(p.is_cuda for p in params) or offloaded or None
    # foreach takes no mix of DTensors and plain tensors (PyTorch's default is the loop wherever one is a DTensor)
    foreach = None if fused or len({isinstance(p, DTensor) for p in params}) > 1 else True
    return torch.optim.AdamW(groups, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, fused=fused, foreach=foreach)


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float) -> LambdaLR:
    """LambdaLR whose epoch e (0 before the first step) gives the lr of step e + 1."""
    def factor(epoch: int) -> float:
        return lr_factor(epoch + 1, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)

    return LambdaLR(optimizer, factor)
