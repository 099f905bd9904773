"""Rotary position embedding (RoPE): `apply_rope(q, k, cos, sin, *, layout, backend) -> (q, k)` rotated.

Each head vector x (length head_dim = D, even) is cut into D/2 pairs (x1, x2), and pair i at position s is
turned by the angle s * inv_freq[i]:

    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin

The two layouts differ in which elements form a pair, in the order of the dimensions and in the tables:

    layout="hf"         transformers' Llama (`apply_rotary_pos_emb` with `rotate_half`): pairs are halves,
                        (x[i], x[i + D/2]); q, k are (batch, heads, seq, D); cos, sin are (batch or 1, seq, D)
                        or (seq, D), each half repeated, as `LlamaRotaryEmbedding` returns them. Only the first
                        half of each table row is read (the second is its copy).
    layout="pairs"      the built-in model (trainyard/engine/models/llama/model.py): pairs are interleaved,
                        (x[2i], x[2i + 1]) (complex multiplication by e^{i*angle}); q, k are (batch, seq, heads,
                        D); cos, sin are its `rope_cos` / `rope_sin` buffers as they are: (max_seq_len, D/2)
                        float32 from `rope_tables`, of which the first seq rows are used.

In both layouts the tables may have more rows than seq (the first seq rows are used, positions 0..seq-1), and
k may have fewer heads than q (grouped-query attention): q and k are rotated independently.

Dtypes: q and k in any floating dtype (each keeps its own), tables in any floating dtype (transformers gives
them in the model's dtype, the built-in model in float32). The math is float32 (float64 for float64 inputs,
so that gradcheck works); outputs are in the input's dtype. The tables get no gradient: apply_rope refuses
tables that require one.

Backends (dispatch.py): "triton" runs the op `trainyard::rope_qk` (q and k in one launch; `trainyard::rope`,
one tensor a launch, when `Config.joint` is off or q and k differ in dtype), with a fake implementation and an
autograd formula: the gradient of a rotation is the rotation by the negative angle, so the backward is the
same kernel with sin negated, one launch for dq and dk, and it saves only cos and sin, never q or k. "eager"
runs `rope_reference`, plain PyTorch ops differentiated by autograd. Both return new tensors; nothing is
rotated in place (see `_rope_impl`). Each op is registered twice (dispatch.register): the custom op
(`trainyard::rope_qk`, opaque to torch.compile; the interpreter's) and the triton_op
(`trainyard::rope_qk_traceable`: torch.compile sees the kernel; CUDA's).

Kernels (launch configuration: `config_for()`, `Config`; `TUNING` overrides its defaults):
    joint (default)  grid (batch * seq,): a program loads its position's cos and sin row once and turns all
                     q heads, then all k heads, of that position, in (BLOCK_HQ, BLOCK_P) and (BLOCK_HK,
                     BLOCK_P) tiles: BLOCK_P = next_power_of_2(D/2) (masked past D/2), BLOCK_HQ =
                     min(next_power_of_2(q heads), max(1, pairs // BLOCK_P)) (masked past the heads), BLOCK_HK
                     the same for k: one tile each for Llama's shapes (32 q and 8 k heads of D = 128).
    one tensor       grid (batch * seq, cdiv(heads, BLOCK_H)), BLOCK_H as BLOCK_HQ: the same per tensor;
                     cos and sin are read once per tensor.
Any strides are accepted (the HF layout is passed as transposed views, no copy); offsets are int64.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainyard.kernels import dispatch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it every call takes the eager path (dispatch.py)
    triton = tl = None

LAYOUTS = ("hf", "pairs")

# Upper bound on the pairs one program turns: 2048 pairs are 4096 elements read and written once, enough
# work to amortise the program's cos/sin loads; its four float32 tiles (x1, x2, x1', x2') take 64 registers
# per thread with the default 4 warps, well within the budget.
_PAIRS_PER_PROGRAM = 2048


# ---------------------------------------------------------------------------------------------- eager reference


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """x rotated, in plain PyTorch: cos and sin are (..., D/2) and broadcast against x[..., :D/2].

    Pairs are (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + D/2]). Float32 math (float64 stays float64),
    the result in x's dtype, contiguous.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    c, s = cos.to(compute), sin.to(compute)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    out = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------- Triton kernel


# Kept undecorated: `triton.jit` decides at decoration time between the compiler and the interpreter
# (TRITON_INTERPRET), so `dispatch.launcher` decorates it on first use, for the mode of that moment, rather than
# at import time (a test process may set TRITON_INTERPRET after something imported this module).
def _rope_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr,
    seq, heads, half,
    sx_b, sx_s, sx_h, sx_d,  # strides of x, viewed as (batch, seq, heads, D)
    so_b, so_s, so_h, so_d,  # strides of out, same view
    sc_b, sc_s, sc_p,  # strides of cos, viewed as (batch, seq, D/2)
    ss_b, ss_s, ss_p,  # strides of sin, same view
    INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, F64: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    COMPUTE = tl.float64 if F64 else tl.float32
    row = tl.program_id(0).to(tl.int64)  # batch * seq + position; int64 so offsets cannot overflow
    b = row // seq
    s = row % seq
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ps = tl.arange(0, BLOCK_P)
    p_ok = ps < half
    c = tl.load(cos_ptr + b * sc_b + s * sc_s + ps * sc_p, mask=p_ok, other=0.0).to(COMPUTE)
    sn = tl.load(sin_ptr + b * ss_b + s * ss_s + ps * ss_p, mask=p_ok, other=0.0).to(COMPUTE)
    if INVERSE:
        sn = -sn
    if INTERLEAVED:
        first = 2 * ps
        second = first + 1
    else:
        first = ps
        second = ps + half
    mask = (hs[:, None] < heads) & p_ok[None, :]
    x_row = x_ptr + b * sx_b + s * sx_s + hs[:, None] * sx_h
    x1 = tl.load(x_row + first[None, :] * sx_d, mask=mask, other=0.0).to(COMPUTE)
    x2 = tl.load(x_row + second[None, :] * sx_d, mask=mask, other=0.0).to(COMPUTE)
    o1 = x1 * c[None, :] - x2 * sn[None, :]
    o2 = x2 * c[None, :] + x1 * sn[None, :]
    o_row = out_ptr + b * so_b + s * so_s + hs[:, None] * so_h
    tl.store(o_row + first[None, :] * so_d, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + second[None, :] * so_d, o2.to(out_ptr.dtype.element_ty), mask=mask)


def _rope_qk_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
    seq, q_heads, k_heads, half,
    sq_b, sq_s, sq_h, sq_d,  # strides of q, viewed as (batch, seq, heads, D)
    sk_b, sk_s, sk_h, sk_d,  # of k
    sqo_b, sqo_s, sqo_h, sqo_d,  # of q's output
    sko_b, sko_s, sko_h, sko_d,  # of k's output
    sc_b, sc_s, sc_p,  # strides of cos, viewed as (batch, seq, D/2)
    ss_b, ss_s, ss_p,  # strides of sin, same view
    INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, F64: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One program per (batch, position): its cos and sin row loaded once, then every q head and every k head
    of that position turned with them, BLOCK_HQ (BLOCK_HK) heads at a time."""
    COMPUTE = tl.float64 if F64 else tl.float32
    row = tl.program_id(0).to(tl.int64)  # batch * seq + position; int64 so offsets cannot overflow
    b = row // seq
    s = row % seq
    ps = tl.arange(0, BLOCK_P)
    p_ok = ps < half
    c = tl.load(cos_ptr + b * sc_b + s * sc_s + ps * sc_p, mask=p_ok, other=0.0).to(COMPUTE)[None, :]
    sn = tl.load(sin_ptr + b * ss_b + s * ss_s + ps * ss_p, mask=p_ok, other=0.0).to(COMPUTE)[None, :]
    if INVERSE:
        sn = -sn
    if INTERLEAVED:
        first = 2 * ps
        second = first + 1
    else:
        first = ps
        second = ps + half
    for h0 in range(0, q_heads, BLOCK_HQ):
        hs = h0 + tl.arange(0, BLOCK_HQ)
        mask = (hs[:, None] < q_heads) & p_ok[None, :]
        x_row = q_ptr + b * sq_b + s * sq_s + hs[:, None] * sq_h
        x1 = tl.load(x_row + first[None, :] * sq_d, mask=mask, other=0.0).to(COMPUTE)
        x2 = tl.load(x_row + second[None, :] * sq_d, mask=mask, other=0.0).to(COMPUTE)
        o_row = qo_ptr + b * sqo_b + s * sqo_s + hs[:, None] * sqo_h
        tl.store(o_row + first[None, :] * sqo_d, (x1 * c - x2 * sn).to(qo_ptr.dtype.element_ty), mask=mask)
        tl.store(o_row + second[None, :] * sqo_d, (x2 * c + x1 * sn).to(qo_ptr.dtype.element_ty), mask=mask)
    for h0 in range(0, k_heads, BLOCK_HK):
        hs = h0 + tl.arange(0, BLOCK_HK)
        mask = (hs[:, None] < k_heads) & p_ok[None, :]
        x_row = k_ptr + b * sk_b + s * sk_s + hs[:, None] * sk_h
        x1 = tl.load(x_row + first[None, :] * sk_d, mask=mask, other=0.0).to(COMPUTE)
        x2 = tl.load(x_row + second[None, :] * sk_d, mask=mask, other=0.0).to(COMPUTE)
        o_row = ko_ptr + b * sko_b + s * sko_s + hs[:, None] * sko_h
        tl.store(o_row + first[None, :] * sko_d, (x1 * c - x2 * sn).to(ko_ptr.dtype.element_ty), mask=mask)
        tl.store(o_row + second[None, :] * sko_d, (x2 * c + x1 * sn).to(ko_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Config:
    """How apply_rope launches (`config_for`).

    joint       one launch for q and k (`trainyard::rope_qk`: a program per position rotates all q and all
                k heads with one read of cos and sin), else one launch each (`trainyard::rope`)
    pairs       at most this many pairs (heads x D/2) per head tile of a program
    warps       warps per program
    """

    joint: bool = True
    pairs: int = _PAIRS_PER_PROGRAM
    warps: int = 4


# Overrides of Config's defaults, by field (the GPU sweep, bench/kernels_tune.py, sets it; empty: defaults).
TUNING: dict = {}


def config_for() -> Config:
    return replace(Config(), **TUNING)


def _tables_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of a (batch or 1, seq, D/2) table; a table shared by the batch (first dimension 1) is read with
    batch stride 0."""
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1), t.stride(2))


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, *, interleaved: bool,
            inverse: bool) -> None:
    batch, seq, heads, dim = x.shape
    if x.numel() == 0:
        return
    cfg = config_for()
    half = dim // 2
    block_p = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(heads), max(1, cfg.pairs // block_p))
    grid = (batch * seq, triton.cdiv(heads, block_h))
    # Triton launches on the current CUDA device: make it x's.
    with dispatch.on_device(x):
        dispatch.launcher(_rope_kernel)[grid](
            x, out, cos, sin,
            seq, heads, half,
            *x.stride(), *out.stride(), *_tables_strides(cos), *_tables_strides(sin),
            INTERLEAVED=interleaved, INVERSE=inverse, F64=x.dtype == torch.float64,
            BLOCK_H=block_h, BLOCK_P=block_p, num_warps=cfg.warps,
        )


def _launch_qk(q, k, cos, sin, q_out, k_out, *, interleaved: bool, inverse: bool) -> None:
    batch, seq, q_heads, dim = q.shape
    k_heads = k.shape[2]
    if batch * seq == 0:
        return
    cfg = config_for()
    half = dim // 2
    block_p = triton.next_power_of_2(half)
    per_tile = max(1, cfg.pairs // block_p)
    with dispatch.on_device(q):
        dispatch.launcher(_rope_qk_kernel)[(batch * seq,)](
            q, k, q_out, k_out, cos, sin,
            seq, q_heads, k_heads, half,
            *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), *_tables_strides(cos),
            *_tables_strides(sin),
            INTERLEAVED=interleaved, INVERSE=inverse, F64=q.dtype == torch.float64,
            BLOCK_HQ=min(triton.next_power_of_2(max(1, q_heads)), per_tile),
            BLOCK_HK=min(triton.next_power_of_2(max(1, k_heads)), per_tile),
            BLOCK_P=block_p, num_warps=cfg.warps,
        )


# ---------------------------------------------------------------------------------------------- custom ops
# Each op twice (dispatch.register): trainyard::rope / rope_qk (custom ops, opaque; the interpreter's) and
# trainyard::rope_traceable / rope_qk_traceable (triton_op: torch.compile sees the kernel; CUDA's).


def _rope_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
               inverse: bool) -> torch.Tensor:
    """The Triton kernel as a torch op: x (batch, seq, heads, D), any strides; cos and sin (batch or 1, >= seq,
    D/2). Rotates by the angle, or by its negative when `inverse` (which is the backward).

    Writes a new tensor (`empty_like(x)`, x's strides), not x in place. In place would save one q- and one
    k-sized buffer per layer for a moment, but the op would have to declare x mutated (`mutates_args`), q and
    k are views of the projections' outputs (and in the HF layout the caller's tensors, which would change
    under it), and a functional op is what torch.compile and autograd handle without special cases. The cost
    is transient: the backward needs only cos and sin, so nothing keeps the unrotated q and k alive.
    """
    dispatch.choose("triton", x)  # fails with a clear message where the kernel cannot run (no interpreter)
    _check_op_args(x, cos, sin)
    out = torch.empty_like(x)
    _launch(x, cos, sin, out, interleaved=interleaved, inverse=inverse)
    return out


def _rope_fake(x, cos, sin, interleaved, inverse):
    _check_op_args(x, cos, sin)
    return torch.empty_like(x)


def _rope_qk_impl(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                  inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated in one launch (`_rope_qk_kernel`): q (batch, seq, q heads, D), k (batch, seq, k heads,
    D), any strides, the same batch, seq and D; cos and sin as `trainyard::rope`'s. New tensors, as there."""
    dispatch.choose("triton", q)
    _check_qk_args(q, k, cos, sin)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _launch_qk(q, k, cos, sin, q_out, k_out, interleaved=interleaved, inverse=inverse)
    return q_out, k_out


def _rope_qk_fake(q, k, cos, sin, interleaved, inverse):
    _check_qk_args(q, k, cos, sin)
    return torch.empty_like(q), torch.empty_like(k)


def _check_op_args(x, cos, sin):
    """The kernel reads out of bounds where these do not hold (apply_rope's checks imply them)."""
    ok = x.dim() == 4 and x.shape[-1] % 2 == 0 and cos.dim() == 3 and cos.shape == sin.shape
    if not (ok and cos.shape[0] in (1, x.shape[0]) and cos.shape[1] >= x.shape[1] and cos.shape[2] == x.shape[3] // 2):
        raise ValueError(f"trainyard::rope: x must be (batch, seq, heads, even D) and cos, sin (batch or 1, >= seq, "
                         f"D/2); got {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")


def _check_qk_args(q, k, cos, sin):
    _check_op_args(q, cos, sin)
    if k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3] \
            or k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"trainyard::rope_qk: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must "
                         "share batch, seq, head_dim, dtype and device (batch, seq, heads, D)")


def _rope_setup_context(ctx, inputs, output):
    _, cos, sin, interleaved, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved, ctx.inverse = interleaved, inverse


def _rope_backward(ctx, grad):
    # Per pair the Jacobian is [[cos, -sin], [sin, cos]]; its transpose is the same matrix with sin negated,
    # whatever the table values (also tables scaled by HF's attention_scaling, which are no pure rotation).
    # Calling the op (not the kernel) keeps double backward differentiable too.
    cos, sin = ctx.saved_tensors
    return OPS.pick(grad)(grad, cos, sin, ctx.interleaved, not ctx.inverse), None, None, None, None


def _rope_qk_setup_context(ctx, inputs, output):
    _, _, cos, sin, interleaved, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved, ctx.inverse = interleaved, inverse


def _rope_qk_backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors  # as _rope_backward: the same rotation by the negative angle, both at once
    dq, dk = QK_OPS.pick(grad_q)(grad_q, grad_k, cos, sin, ctx.interleaved, not ctx.inverse)
    return dq, dk, None, None, None, None


OPS = dispatch.register("rope", _rope_impl, fake=_rope_fake, autograd=_rope_backward,
                        setup_context=_rope_setup_context)
QK_OPS = dispatch.register("rope_qk", _rope_qk_impl, fake=_rope_qk_fake, autograd=_rope_qk_backward,
                           setup_context=_rope_qk_setup_context)
rope_op = OPS.opaque  # trainyard::rope (tests and callers that want the one-tensor op itself)


# ---------------------------------------------------------------------------------------------- public function


def _half_tables(q, k, cos, sin, layout):
    """Checks the shapes; returns (cos, sin) as (batch or 1, seq, D/2) views and the seq dimension of q."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {', '.join(LAYOUTS)}")
    seq_dim = 2 if layout == "hf" else 1
    order = "(batch, heads, seq, head_dim)" if layout == "hf" else "(batch, seq, heads, head_dim)"
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"layout={layout!r}: q and k must be 4-D {order}, got {tuple(q.shape)} and {tuple(k.shape)}")
    dim, seq, batch = q.shape[-1], q.shape[seq_dim], q.shape[0]
    if dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {dim}")
    if k.shape[-1] != dim or k.shape[seq_dim] != seq or k.shape[0] != batch:
        raise ValueError(f"layout={layout!r}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, seq or "
                         f"head_dim {order}")
    if not (q.is_floating_point() and k.is_floating_point() and cos.is_floating_point() and sin.is_floating_point()):
        raise TypeError("q, k, cos and sin must be floating-point tensors")
    if len({q.device, k.device, cos.device, sin.device}) > 1:
        raise ValueError(f"q, k, cos and sin must be on one device, got {q.device}, {k.device}, {cos.device}, "
                         f"{sin.device}")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("cos and sin are tables and get no gradient: pass them detached (or under no_grad)")
    width = dim if layout == "hf" else dim // 2
    if cos.shape != sin.shape or cos.dim() not in (2, 3) or cos.shape[-1] != width or cos.shape[-2] < seq \
            or (cos.dim() == 3 and cos.shape[0] not in (1, batch)):
        raise ValueError(f"layout={layout!r}: cos and sin must both be (batch or 1, >= seq, {width}) or "
                         f"(>= seq, {width}) for q {tuple(q.shape)}; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    # The HF tables repeat their first half; the op reads one angle per pair.
    return cos[:, :seq, : dim // 2], sin[:, :seq, : dim // 2], seq_dim


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: str = "hf",
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by RoPE, as new tensors in the input dtypes and layout (see the module docstring).

    layout="hf": q, k (batch, heads, seq, head_dim); cos, sin as transformers' `LlamaRotaryEmbedding`
    returns them, (batch or 1, seq, head_dim). layout="pairs": q, k (batch, seq, heads, head_dim); cos, sin
    the built-in model's `rope_cos` / `rope_sin` buffers, (max_seq_len, head_dim/2), or their first seq rows.
    backend: "auto", "triton" or "eager" (dispatch.py).
    """
    cos, sin, seq_dim = _half_tables(q, k, cos, sin, layout)
    interleaved = layout == "pairs"
    if dispatch.choose(backend, q) == "eager":
        # (B, S, 1, D/2) against (B, S, H, D), or (B, 1, S, D/2) against (B, H, S, D)
        heads_dim = 2 if seq_dim == 1 else 1
        c, s = cos.unsqueeze(heads_dim), sin.unsqueeze(heads_dim)
        return rope_reference(q, c, s, interleaved=interleaved), rope_reference(k, c, s, interleaved=interleaved)
    # The kernels see (batch, seq, heads, D): the HF tensors go in as transposed views, no copy.
    qv, kv = (q, k) if seq_dim == 1 else (q.transpose(1, 2), k.transpose(1, 2))
    if config_for().joint and q.dtype == k.dtype:
        q_out, k_out = QK_OPS.pick(q)(qv, kv, cos, sin, interleaved, False)
    else:
        one = OPS.pick(q)
        q_out, k_out = one(qv, cos, sin, interleaved, False), one(kv, cos, sin, interleaved, False)
    return (q_out, k_out) if seq_dim == 1 else (q_out.transpose(1, 2), k_out.transpose(1, 2))
