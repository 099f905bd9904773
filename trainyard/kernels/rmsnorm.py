"""RMSNorm over the last dimension as the custom op `trainyard::rms_norm`, with its eager reference.

    y = (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype) * weight          x: (..., N), weight: (N,)

Numerics follow the built-in model's `RMSNorm` (trainyard/engine/models/llama/model.py) exactly: the mean
of squares, rsqrt and the normalisation are computed in float32 whatever the input dtype (bf16/fp16/fp32),
the normalised x is cast back to x's dtype, then multiplied by `weight`; the output dtype is
`torch.promote_types(x.dtype, weight.dtype)` (bf16 x with bf16 weight -> bf16). HF's `LlamaRMSNorm`
computes the same thing (`weight * hidden.to(input_dtype)`: the same operations, only the operands of the
last multiplication swapped, which is exact), so both are served by this op. One deliberate difference
from both: float64 inputs are normalised in float64 (they cast to float32), so that gradcheck can run.
`rms_norm_reference` is the model's code; the kernels take the same steps with the same casts, so they
differ only by float32 summation order and rsqrt (and, under TRITON_INTERPRET=1, by the interpreter's
float32 -> bf16 cast, which truncates where GPUs round to nearest even).

Which implementation runs is `dispatch.choose(backend, x)`: the Triton kernels below (CUDA, or CPU under
TRITON_INTERPRET=1) through the custom op, or `rms_norm_reference` (plain PyTorch, autograd by torch).
`backend="auto"` also takes the reference when N > MAX_HIDDEN (a row must fit one program).

Both kernels read each tensor once: the forward reads x and weight and writes y and rstd; the backward
reads dy, x, weight and rstd and writes dx and the dweight partial sums (nothing is recomputed from a second
read, no intermediate goes through memory).

Triton kernels (launch configuration: `config_for(N)`, `Config`; `TUNING` overrides its defaults):
    forward   a (fwd_rows, BLOCK) tile per program, BLOCK = next_power_of_2(N) columns (masked past N and
              past the last row); writes y and each row's rstd (float32, float64 for float64 x), saved for
              the backward. Default: one row per program.
    backward  G = bwd_waves x the SM count programs on CUDA (at most CPU_PROGRAMS under the interpreter),
              each over a contiguous run of rows: dx per row, and a float32 (float64 for float64 x) partial
              sum of dweight over its rows; the (G, N) partials are summed in that dtype on the host and
              cast to weight's dtype. Default warps: 4 / 8 / 16 / 32 from 2048 / 8192 / 32768 columns.

Registered twice (dispatch.register): `trainyard::rms_norm` / `rms_norm_backward` (custom ops, opaque to
torch.compile; what the interpreter runs on CPU) and `trainyard::rms_norm_traceable` /
`rms_norm_backward_traceable` (triton_op: torch.compile traces into them and sees the kernels; CUDA).
              dx = rstd * (g - n * mean(g * n)),  g = dy * weight,  n = x * rstd
              dweight = sum over rows of dy * n.to(x.dtype)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainyard.kernels import dispatch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency: without it every call takes the eager reference
    triton = tl = None

# Widest row the kernels take: the whole row sits in one program's registers (Liger-Kernel's limit too).
MAX_HIDDEN = 65536
# Backward programs on CPU under the interpreter, which runs programs one after another: a few suffice.
CPU_PROGRAMS = 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """RMSNorm of `x` over its last dimension, scaled by `weight` (see the module docstring).

    backend: "auto" (Triton where it runs, else eager), "triton" (fails where it cannot run) or "eager".
    """
    impl = dispatch.choose(backend, x)
    if impl == "triton":
        _check(x, weight)
        if x.shape[-1] > MAX_HIDDEN:
            if backend == "triton":
                raise ValueError(f"rms_norm: hidden size {x.shape[-1]} > {MAX_HIDDEN}, the widest row the "
                                 "Triton kernel takes; use backend='auto' or 'eager'")
            impl = "eager"
    if impl == "eager":
        return rms_norm_reference(x, weight, eps)
    y, _ = OPS.pick(x)(x, weight, float(eps))
    return y


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager reference: the built-in model's RMSNorm, line for line (float64 stays float64)."""
    xf = x.to(_compute_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.type_as(x) * weight


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 (the built-in model's `.float()`), float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for x of shape {tuple(x.shape)}; "
                         "weight must be (hidden,) with hidden = x.shape[-1]")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: x is on {x.device}, weight on {weight.device}")


# ---- the custom ops -------------------------------------------------------------------------------------
# Each op twice (dispatch.register): trainyard::rms_norm (custom_op, opaque; the interpreter's) and
# trainyard::rms_norm_traceable (triton_op: torch.compile sees its kernels; CUDA's).

def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y as `rms_norm`, rstd of shape x.shape[:-1] saved for the backward."""
    return _forward_triton(x, weight, eps)


def _rms_norm_fake(x, weight, eps):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(x.shape[:-1], dtype=_compute_dtype(x.dtype))


def _rms_norm_backward_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of `trainyard::rms_norm` from the output gradient dy and the saved rstd."""
    return _backward_triton(dy, x, weight, rstd)


def _rms_norm_backward_fake(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    if dy is None:  # y unused: rstd is not differentiable
        return None, None, None
    dx, dweight = BACKWARD_OPS.pick(x)(dy, x, weight, rstd)
    return dx, dweight, None


BACKWARD_OPS = dispatch.register("rms_norm_backward", _rms_norm_backward_impl, fake=_rms_norm_backward_fake)
OPS = dispatch.register("rms_norm", _rms_norm_impl, fake=_rms_norm_fake, autograd=_backward,
                        setup_context=_setup_context)


# ---- configurations ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """How the kernels are launched for one row width (`config_for`).

    fwd_rows      rows per forward program (a (fwd_rows, BLOCK) tile; more rows: fewer, fuller programs for
                  narrow rows)
    fwd_warps     warps per forward program
    bwd_warps     warps per backward program
    bwd_waves     backward programs = bwd_waves x the SM count (each over a contiguous run of rows; more
                  programs: more parallelism, more (G, N) float32 partial sums of dweight to add up)
    """

    fwd_rows: int
    fwd_warps: int
    bwd_warps: int
    bwd_waves: int = 1


# Overrides of `config_for`'s defaults, by field (the GPU sweep, bench/kernels_tune.py, sets it; empty: the
# defaults). A plain dict, read at each launch.
TUNING: dict = {}


def config_for(n: int) -> Config:
    """The launch configuration for rows of `n` columns: the defaults (one row per forward program, warps
    as Liger-Kernel's `calculate_settings`: 4 up to 2048 columns, 8 to 8192, 16 to 32768, then 32; one
    backward program per SM), with `TUNING`'s fields over them."""
    _, warps = _block(n)
    return replace(Config(fwd_rows=1, fwd_warps=warps, bwd_warps=warps, bwd_waves=1), **TUNING)


# ---- launching the Triton kernels -------------------------------------------------------------------------

def _forward_triton(x, weight, eps):
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(rows, dtype=_compute_dtype(x.dtype), device=x.device)
    if rows and n:
        block, _ = _block(n)
        cfg = config_for(n)
        with _device(x):
            _launcher(_rms_norm_fwd_kernel)[(triton.cdiv(rows, cfg.fwd_rows),)](
                x2, weight.contiguous(), y, rstd, rows, n, eps, BLOCK=block, ROWS=cfg.fwd_rows,
                X64=x.dtype == torch.float64, Y64=y.dtype == torch.float64, num_warps=cfg.fwd_warps)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _backward_triton(dy, x, weight, rstd):
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    dy2 = dy.reshape(-1, n).contiguous()
    rows = x2.shape[0]
    dx = torch.empty_like(x2)
    if not (rows and n):
        return dx.view(x.shape), torch.zeros_like(weight)
    cfg = config_for(n)
    programs = min(rows, dispatch.sm_count(x) * cfg.bwd_waves if x.is_cuda else CPU_PROGRAMS)
    per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, per_program)
    partial = torch.empty((programs, n), dtype=_compute_dtype(x.dtype), device=x.device)
    block, _ = _block(n)
    with _device(x):
        _launcher(_rms_norm_bwd_kernel)[(programs,)](
            dy2, x2, weight.contiguous(), rstd.reshape(-1).contiguous(), dx, partial, rows, n, per_program,
            BLOCK=block, X64=x.dtype == torch.float64, num_warps=cfg.bwd_warps)
    return dx.view(x.shape), partial.sum(0).to(weight.dtype)


def _block(n: int) -> tuple[int, int]:
    """BLOCK (the row padded to a power of two) and the default warps: more warps for wider rows, as
    Liger-Kernel's `calculate_settings` (4 up to 2048 columns, 8 to 8192, 16 to 32768, then 32)."""
    block = triton.next_power_of_2(n)
    return block, 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


_device = dispatch.on_device
_launcher = dispatch.launcher


# Flags rather than dtypes as constexprs (X64: x is float64, so the norm is computed in float64; Y64: y is
# float64, so the product with the weight is): plain bools are what every torch.compile version passes into
# a traced user kernel as it is.
def _rms_norm_fwd_kernel(X, W, Y, RSTD, M, N, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr, X64: tl.constexpr,
                         Y64: tl.constexpr):
    NORM = tl.float64 if X64 else tl.float32
    PRODUCT = tl.float64 if Y64 else tl.float32
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64: rows * N may pass 2**31
    cols = tl.arange(0, BLOCK)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(NORM)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    normed = (x * rstd[:, None]).to(X.dtype.element_ty)  # cast back to x's dtype before the weight, as the model
    w = tl.load(W + cols, mask=cols < N, other=0.0)
    y = normed.to(PRODUCT) * w.to(PRODUCT)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, M, N, rows_per_program, BLOCK: tl.constexpr,
                         X64: tl.constexpr):
    NORM = tl.float64 if X64 else tl.float32
    pid = tl.program_id(0).to(tl.int64)  # int64 row offsets: rows * N may pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(NORM)
    dw = tl.zeros([BLOCK], dtype=NORM)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in range(row_start, row_end):
        offs = row * N + cols
        x = tl.load(X + offs, mask=mask, other=0.0).to(NORM)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(NORM)
        rstd = tl.load(RSTD + row)
        normed = x * rstd
        g = dy * w
        dx = rstd * (g - normed * (tl.sum(g * normed, axis=0) / N))
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * normed.to(X.dtype.element_ty).to(NORM)
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)
