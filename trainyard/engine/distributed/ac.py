"""Activation checkpointing per transformer block, applied before sharding.

`apply_ac(blocks, "full")` recomputes every block's activations in backward instead of keeping them;
`"selective"` does it for every second block (half the recompute, about half the saving); `"none"` keeps
everything. The block's forward is wrapped in place, so parameter names (which seed the weight init and
key the checkpoints) do not change.
"""
from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from trainyard.parallel.parallelism import AC_MODES


def apply_ac(blocks: list[nn.Module], mode: str) -> None:
    """Checkpoint the activations of `blocks` (in forward order) as `mode` says."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {list(AC_MODES)}, got {mode!r}")
    if mode == "none":
        return
    for i, block in enumerate(blocks):
        if mode == "full" or i % 2 == 0:
            # non-reentrant checkpointing composes with FSDP2: the block's parameters are gathered
            # again by its pre-backward hook before the recompute runs
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
