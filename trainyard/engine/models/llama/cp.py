"""Context parallelism for the built-in `Transformer`: each rank runs its zig-zag chunks of every sequence
(`engine/distributed/context.py`); everything but attention is token-wise and runs unchanged on them.

`apply_cp(model, cp_mesh)` changes two things on every block's `Attention`, in place (after tensor parallelism,
so the heads are this rank's; the model code stays parallel-agnostic):

- `rope`: the rotary tables are read at the global positions of the rank's tokens (a sequence of
  S = local tokens x cp), then the rope in place (the plain one, or trainyard.kernels' when swapped in) runs;
- `attend`: exact causal ring attention over the context-parallel group instead of SDPA over the local tokens.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from trainyard.engine.distributed.context import GroupRing, ring_attention, zigzag_positions


def apply_cp(model: nn.Module, cp_mesh) -> nn.Module:
    """Make `model` (a `Transformer`) run on its rank's zig-zag chunks over the 1-D `cp_mesh`."""
    ring = GroupRing(cp_mesh.get_group())
    for block in model.layers.values():
        attention = block.attention
        attention.rope = functools.partial(_rope_at_positions, attention.rope, ring.size, ring.rank,
                                           model.config.max_seq_len)
        attention.attend = functools.partial(ring_attention, ring=ring)
    return model


def _rope_at_positions(rope, cp: int, rank: int, max_seq_len: int, q: torch.Tensor, k: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor):
    seq = q.shape[1] * cp  # the whole sequence the rank's tokens come from
    if seq > max_seq_len:
        raise ValueError(f"sequence length {seq} ({q.shape[1]} tokens on each of {cp} context-parallel ranks) exceeds "
                         f"max_seq_len {max_seq_len}")
    positions = zigzag_positions(seq, cp, rank, device=cos.device)
    return rope(q, k, cos.index_select(0, positions), sin.index_select(0, positions))
