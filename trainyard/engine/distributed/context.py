"""Context parallelism: a sequence split over the `cp` ranks in zig-zag chunks, and exact ring attention.

Layout (causal load balancing): a sequence of S tokens is cut into 2 x cp chunks of S / (2 cp) tokens; rank r
holds chunks r and 2 cp - 1 - r, in that order (`shard_sequence`). Under a causal mask the early chunks attend
to few keys and the late ones to many; a rank with one of each does the same work as every other rank.
Everything but attention is token-wise and runs on a rank's own tokens; rotary embeddings take the tokens'
global positions (`zigzag_positions`).

Ring attention (`ring_attention`): every rank keeps its queries and passes its keys and values around the ring
of the cp ranks (to rank + 1, from rank - 1), cp - 1 times, so that after cp steps its queries have met every
key block. Each step attends the local queries to the block it holds and folds the result into the running
output with an online softmax (the log-sum-exp of each query row: out = sum_b exp(lse_b - lse) out_b), which
gives exactly softmax attention over the whole sequence. The causal mask is applied by chunk: a query chunk
attends fully to earlier chunks, causally to its own, not at all to later ones (those pairs are skipped, the
zig-zag layout gives every rank the same number of pairs to compute). The backward is the flash-attention one,
blockwise from the saved output and log-sum-exp: the same ring again, with each key/value block travelling
together with the gradient accumulated for it, which after cp steps is back home (one more hop). Keys and
values travel without the grouped-query repeat.

Blocks are computed with plain matmuls in float32 (float64 for float64 inputs) (exact against the unsharded model to rounding; memory per
step is O((S / 2 cp)^2) per head, not a flash kernel). The transport is torch.distributed point-to-point
(`GroupRing`: `batch_isend_irecv`, gloo and NCCL), or anything with the same `start` (the tests simulate the
ranks with threads).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from trainyard.parallel.layout import check_cp


# --- the zig-zag layout --------------------------------------------------------------------------------------

def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) rank `rank` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions of rank `rank`'s tokens of a sequence of `seq_len`, in its local order."""
    check_cp(cp=cp, seq_len=seq_len)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in zigzag_chunks(cp, rank)])


_SHARDED_LENGTHS: set[int] = set()  # the lengths shard_sequence produced in this process (refuse_whole_sequences)


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s zig-zag chunks of `t` along `dim` (the sequence); `t` itself when cp is 1."""
    if cp == 1:
        return t
    check_cp(cp=cp, seq_len=t.shape[dim])
    chunks = t.chunk(2 * cp, dim)
    _SHARDED_LENGTHS.add(t.shape[dim] // cp)
    return torch.cat([chunks[i] for i in zigzag_chunks(cp, rank)], dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's `shard_sequence` part (in rank order)."""
    cp = len(parts)
    chunks: list = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim)
        a, b = zigzag_chunks(cp, rank)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim)


def refuse_whole_sequences(model: torch.nn.Module) -> None:
    """Refuse a forward whose input is not what `shard_sequence` cut: a loop that forgot `te.sequence_shard` hands
    each rank the whole sequence, which the model would take for the rank's two chunks and train wrong without a
    sound. The check is by length: the input's tokens per row must be a length `shard_sequence` produced."""
    def check(module, args, kwargs):
        tokens = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if tokens is None:
            tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if isinstance(tokens, torch.Tensor) and tokens.dim() > 1 and tokens.shape[1] not in _SHARDED_LENGTHS:
            cut = f"te.sequence_shard cut {sorted(_SHARDED_LENGTHS)} tokens per row so far" if _SHARDED_LENGTHS \
                else "te.sequence_shard was not called"
            raise ValueError(f"context parallelism: this rank's input has {tokens.shape[1]} tokens per row, not its "
                             f"chunks of the sequence ({cut}); call x, y = te.sequence_shard(model, x, y) before the "
                             "forward (te.forward_backward and te.evaluate do it themselves)")
        return None

    model.register_forward_pre_hook(check, with_kwargs=True)


# --- the transport -------------------------------------------------------------------------------------------

class _Pending:
    def __init__(self, works, received: torch.Tensor) -> None:
        self.works, self.received = works, received

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.received


class GroupRing:
    """The ring of a process group: `start(t)` sends `t` to the next rank and receives the previous rank's
    tensor of the same shape; `.wait()` on the result returns it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), group.size()

    def start(self, tensor: torch.Tensor, tag: int = 0) -> _Pending:
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
               dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag)]
        return _Pending(dist.batch_isend_irecv(ops), received)


_KV, _DKV = 0, 1  # message tags: key/value blocks, their gradient accumulators


# --- blockwise attention -------------------------------------------------------------------------------------
# Shapes inside: queries (batch, kv_heads, repeat, tokens, head_dim), keys and values (batch, kv_heads, 1, tokens,
# head_dim): query head g * repeat + j reads key/value head g, as repeat_interleave of the keys would give.

def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:  # a chunk against itself: token i sees tokens 0..i of it
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs and float32, float64 for float64 (the tests' exact comparison)."""
    return torch.promote_types(t.dtype, torch.float32)


def _pairs(cp: int, rank: int, source: int):
    """(query half, key half, causal) of the blocks to compute when rank `rank` holds `source`'s keys: a query
    chunk sees every earlier chunk, itself causally, no later one."""
    mine, theirs = zigzag_chunks(cp, rank), zigzag_chunks(cp, source)
    for i, cq in enumerate(mine):
        for j, ck in enumerate(theirs):
            if ck <= cq:
                yield i, j, ck == cq


def _split_kv(flat: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = flat.view(2, *shape).unbind(0)
    return k, v


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, scale):
        cp, rank = ring.size, ring.rank
        b, g, r, s, d = q.shape
        c = s // 2
        acc = _accumulation_dtype(q)
        qf = q.to(acc)
        halves = lambda t: (t[..., :c, :], t[..., c:, :])  # noqa: E731 (the two chunks of a rank)
        out = [torch.zeros(b, g, r, c, d, device=q.device, dtype=acc) for _ in range(2)]
        lse = [torch.full((b, g, r, c), float("-inf"), device=q.device, dtype=acc) for _ in range(2)]
        kv = torch.stack([k, v]).contiguous()  # one message per step
        for step in range(cp):
            pending = ring.start(kv, _KV) if step < cp - 1 else None
            kb, vb = (t.to(acc) for t in kv.unbind(0))
            for i, j, causal in _pairs(cp, rank, (rank - step) % cp):
                s_ij = _scores(halves(qf)[i], halves(kb)[j], scale, causal)
                lse_b = torch.logsumexp(s_ij, -1)
                out_b = torch.exp(s_ij - lse_b.unsqueeze(-1)) @ halves(vb)[j]
                new = torch.logaddexp(lse[i], lse_b)
                out[i] = out[i] * torch.exp(lse[i] - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1)
                lse[i] = new
            if pending is not None:
                kv = pending.wait()
        o, l = torch.cat(out, -2), torch.cat(lse, -1)
        ctx.save_for_backward(q, k, v, o, l)
        ctx.ring, ctx.scale = ring, scale
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, o, l = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        cp, rank = ring.size, ring.rank
        c = q.shape[-2] // 2
        halves = lambda t: (t[..., :c, :], t[..., c:, :])  # noqa: E731
        acc = o.dtype
        qf, do = q.to(acc), grad_out.to(acc)
        delta = (do * o).sum(-1)  # rowsum(dO * O): the softmax's share of each row
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).contiguous()
        # the gradient of the block held, accumulated along the ring
        dkv = torch.zeros(kv.shape, device=q.device, dtype=acc)
        for step in range(cp):
            pending = ring.start(kv, _KV) if step < cp - 1 else None
            kb, vb = (t.to(acc) for t in kv.unbind(0))
            dk, dv = dkv.unbind(0)
            for i, j, causal in _pairs(cp, rank, (rank - step) % cp):
                qi, kj, vj = halves(qf)[i], halves(kb)[j], halves(vb)[j]
                p = torch.exp(_scores(qi, kj, scale, causal) - halves(l.unsqueeze(-1))[i])
                doi = halves(do)[i]
                halves(dv)[j].add_((p.transpose(-1, -2) @ doi).sum(2, keepdim=True))
                ds = p * (doi @ vj.transpose(-1, -2) - halves(delta.unsqueeze(-1))[i])
                halves(dq)[i].add_(ds @ kj, alpha=scale)
                halves(dk)[j].add_((ds.transpose(-1, -2) @ qi).sum(2, keepdim=True), alpha=scale)
            dkv = ring.start(dkv, _DKV).wait()  # after the last step: this rank's own block's gradient
            if pending is not None:
                kv = pending.wait()
        dk, dv = dkv.unbind(0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring, *, scale: float | None = None):
    """Exact causal attention of this rank's zig-zag tokens over the whole sequence, passing keys and values
    around `ring` (a `GroupRing` of the context-parallel group). q: (batch, tokens, heads, head_dim), k and v:
    (batch, tokens, kv_heads, head_dim) with heads a multiple of kv_heads (grouped-query); the output like q."""
    b, s, h, d = q.shape
    g = k.shape[2]
    if s % 2:
        raise ValueError(f"ring attention needs this rank's two zig-zag chunks, got {s} tokens (an odd number)")
    if h % g:
        raise ValueError(f"{h} query heads do not share {g} key/value heads evenly")
    q5 = q.reshape(b, s, g, h // g, d).permute(0, 2, 3, 1, 4)  # (b, g, repeat, s, d)
    k5, v5 = (t.permute(0, 2, 1, 3).unsqueeze(2) for t in (k, v))  # (b, g, 1, s, d)
    out = _RingAttention.apply(q5, k5, v5, ring, d ** -0.5 if scale is None else scale)
    return out.permute(0, 3, 1, 2, 4).reshape(b, s, h, d)
