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

Backends (dispatch.py): "triton" runs the custom op `torch.ops.trainyard.rope` (registered fake, autograd:
the gradient of a rotation is the rotation by the negative angle, so the backward is the same kernel with
sin negated, and it saves only cos and sin, never q or k); "eager" runs `rope_reference`, plain PyTorch ops
differentiated by autograd. Both return new tensors; nothing is rotated in place (see `rope_op`).

Kernel: grid (batch * seq, cdiv(heads, BLOCK_H)); a program loads its position's cos and sin row once and
turns a (BLOCK_H heads, BLOCK_P pairs) tile with them, BLOCK_P = next_power_of_2(D/2) (masked past D/2),
BLOCK_H = min(next_power_of_2(heads), max(1, 2048 // BLOCK_P)) (masked past heads): all heads of a position in
one program for Llama's shapes (32 heads of D = 128). Any strides are accepted (the HF layout is passed as a
transposed view, no copy); offsets are int64.
"""
from __future__ import annotations


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
# (TRITON_INTERPRET), so `_kernel` decorates it on first use, for the mode of that moment, rather than at
# import time (a test process may set TRITON_INTERPRET after something imported this module).
def _rope_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr,
    seq, heads, half,
    sx_b, sx_s, sx_h, sx_d,  # strides of x, viewed as (batch, seq, heads, D)
    so_b, so_s, so_h, so_d,  # strides of out, same view
    sc_b, sc_s, sc_p,  # strides of cos, viewed as (batch, seq, D/2)
    ss_b, ss_s, ss_p,  # strides of sin, same view
    INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
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


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, *, interleaved: bool,
            inverse: bool) -> None:
    batch, seq, heads, dim = x.shape
    if x.numel() == 0:
        return
    half = dim // 2
    block_p = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(heads), max(1, _PAIRS_PER_PROGRAM // block_p))
    grid = (batch * seq, triton.cdiv(heads, block_h))
    # Tables shared by the batch (first dimension 1) are read with batch stride 0.
    c_strides = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), cos.stride(2))
    s_strides = (sin.stride(0) if sin.shape[0] > 1 else 0, sin.stride(1), sin.stride(2))
    # Triton launches on the current CUDA device: make it x's.
    with dispatch.on_device(x):
        dispatch.jit(_rope_kernel)[grid](
            x, out, cos, sin,
            seq, heads, half,
            *x.stride(), *out.stride(), *c_strides, *s_strides,
            INTERLEAVED=interleaved, INVERSE=inverse,
            COMPUTE=tl.float64 if x.dtype == torch.float64 else tl.float32,
            BLOCK_H=block_h, BLOCK_P=block_p,
        )


# ---------------------------------------------------------------------------------------------- custom op


@torch.library.custom_op("trainyard::rope", mutates_args=())
def rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inverse: bool) -> torch.Tensor:
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


@rope_op.register_fake
def _rope_fake(x, cos, sin, interleaved, inverse):
    _check_op_args(x, cos, sin)
    return torch.empty_like(x)


def _check_op_args(x, cos, sin):
    """The kernel reads out of bounds where these do not hold (apply_rope's checks imply them)."""
    ok = x.dim() == 4 and x.shape[-1] % 2 == 0 and cos.dim() == 3 and cos.shape == sin.shape
    if not (ok and cos.shape[0] in (1, x.shape[0]) and cos.shape[1] >= x.shape[1] and cos.shape[2] == x.shape[3] // 2):
        raise ValueError(f"trainyard::rope: x must be (batch, seq, heads, even D) and cos, sin (batch or 1, >= seq, "
                         f"D/2); got {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")


def _rope_setup_context(ctx, inputs, output):
    _, cos, sin, interleaved, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved, ctx.inverse = interleaved, inverse


def _rope_backward(ctx, grad):
    # Per pair the Jacobian is [[cos, -sin], [sin, cos]]; its transpose is the same matrix with sin negated,
    # whatever the table values (also tables scaled by HF's attention_scaling, which are no pure rotation).
    # Calling the op (not the kernel) keeps double backward differentiable too.
    cos, sin = ctx.saved_tensors
    return torch.ops.trainyard.rope(grad, cos, sin, ctx.interleaved, not ctx.inverse), None, None, None, None


rope_op.register_autograd(_rope_backward, setup_context=_rope_setup_context)


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
    if seq_dim == 1:
        return rope_op(q, cos, sin, interleaved, False), rope_op(k, cos, sin, interleaved, False)
    # The kernel sees (batch, seq, heads, D): the HF tensors go in as transposed views, no copy.
    q_out = rope_op(q.transpose(1, 2), cos, sin, interleaved, False).transpose(1, 2)
    k_out = rope_op(k.transpose(1, 2), cos, sin, interleaved, False).transpose(1, 2)
    return q_out, k_out
