"""SwiGLU's gate, silu(a) * b elementwise, as the custom op `trainyard::swiglu`, with its eager reference.

    out = silu(a) * b = a * sigmoid(a) * b                a, b: the same shape (any), no broadcasting
    da  = dout * b * s * (1 + a * (1 - s)),  s = sigmoid(a)
    db  = dout * silu(a)

Computed in float32 whatever the input dtype (float64 in float64), stored in the inputs' dtypes: out in
`torch.promote_types(a.dtype, b.dtype)`, da in a's, db in b's. silu(a) is rounded to a's dtype before the
product, as the eager `F.silu(a) * b` rounds it, so bf16/fp16 results match the reference to about an ulp.

Which implementation runs is `dispatch.choose(backend, a)`: the Triton kernels below (CUDA, or CPU under
TRITON_INTERPRET=1) through the custom op, or `swiglu_reference` (plain PyTorch, autograd by torch).

Triton kernels: elementwise over the flattened inputs, int64 offsets; the forward and the backward (da and
db in one pass, each input read once) are separate kernels. Elements per program and warps: `config_for()`
(default BLOCK = 1024 and 4 warps for both; `TUNING` overrides them, as the GPU sweep does).

Registered twice (dispatch.register): `trainyard::swiglu` / `swiglu_backward` (custom ops, opaque to
torch.compile; the interpreter's) and `trainyard::swiglu_traceable` / `swiglu_backward_traceable`
(triton_op: torch.compile sees the kernels; CUDA's).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from trainyard.kernels import dispatch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency: without it every call takes the eager reference
    triton = tl = None

# Elements per program: 1024 is the usual elementwise block (4 warps x 32 threads x 8 elements each).
BLOCK = 1024


def swiglu(a: torch.Tensor, b: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """silu(a) * b elementwise (see the module docstring).

    backend: "auto" (Triton where it runs, else eager), "triton" (fails where it cannot run) or "eager".
    """
    if dispatch.choose(backend, a) == "eager":
        return swiglu_reference(a, b)
    if a.shape != b.shape or a.device != b.device:
        raise ValueError(f"swiglu: a {tuple(a.shape)} on {a.device} and b {tuple(b.shape)} on {b.device}: the "
                         "kernel takes two tensors of the same shape on the same device (no broadcasting)")
    return OPS.pick(a)(a, b)


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The eager reference, as a Llama MLP writes it."""
    return F.silu(a) * b


# ---- the custom ops -------------------------------------------------------------------------------------
# Each op twice (dispatch.register): trainyard::swiglu (custom_op, opaque; the interpreter's) and
# trainyard::swiglu_traceable (triton_op: torch.compile sees its kernels; CUDA's).

def _swiglu_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _forward_triton(a, b)


def _swiglu_fake(a, b):
    return a.new_empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype))


def _swiglu_backward_impl(dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of `trainyard::swiglu` from the output gradient."""
    return _backward_triton(dout, a, b)


def _swiglu_backward_fake(dout, a, b):
    return torch.empty_like(a), torch.empty_like(b)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dout):
    a, b = ctx.saved_tensors
    return BACKWARD_OPS.pick(a)(dout, a, b)


BACKWARD_OPS = dispatch.register("swiglu_backward", _swiglu_backward_impl, fake=_swiglu_backward_fake)
OPS = dispatch.register("swiglu", _swiglu_impl, fake=_swiglu_fake, autograd=_backward, setup_context=_setup_context)


# ---- configurations ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """Elements per program and warps, forward and backward (`config_for`)."""

    fwd_block: int = BLOCK
    fwd_warps: int = 4
    bwd_block: int = BLOCK
    bwd_warps: int = 4


# Overrides of Config's defaults, by field (the GPU sweep, bench/kernels_tune.py, sets it; empty: defaults).
TUNING: dict = {}


def config_for() -> Config:
    return replace(Config(), **TUNING)


# ---- launching the Triton kernels -------------------------------------------------------------------------

def _forward_triton(a, b):
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    n = a.numel()
    if n:
        cfg = config_for()
        with _device(a):
            _launcher(_swiglu_fwd_kernel)[(triton.cdiv(n, cfg.fwd_block),)](
                a, b, out, n, BLOCK=cfg.fwd_block, F64=_f64(a, b), num_warps=cfg.fwd_warps)
    return out


def _backward_triton(dout, a, b):
    dout, a, b = dout.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    if n:
        cfg = config_for()
        with _device(a):
            _launcher(_swiglu_bwd_kernel)[(triton.cdiv(n, cfg.bwd_block),)](
                dout, a, b, da, db, n, BLOCK=cfg.bwd_block, F64=_f64(a, b), num_warps=cfg.bwd_warps)
    return da, db


def _f64(a, b) -> bool:
    """Whether the maths is float64 (either input is float64), else float32."""
    return torch.float64 in (a.dtype, b.dtype)


_device = dispatch.on_device
_launcher = dispatch.launcher


def _swiglu_fwd_kernel(A, B, OUT, n, BLOCK: tl.constexpr, F64: tl.constexpr):
    COMPUTE = tl.float64 if F64 else tl.float32
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(COMPUTE)
    b = tl.load(B + offs, mask=mask, other=0.0).to(COMPUTE)
    silu = (a * tl.sigmoid(a)).to(A.dtype.element_ty).to(COMPUTE)  # rounded to a's dtype, as F.silu(a) is
    tl.store(OUT + offs, (silu * b).to(OUT.dtype.element_ty), mask=mask)


def _swiglu_bwd_kernel(DOUT, A, B, DA, DB, n, BLOCK: tl.constexpr, F64: tl.constexpr):
    COMPUTE = tl.float64 if F64 else tl.float32
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(COMPUTE)
    a = tl.load(A + offs, mask=mask, other=0.0).to(COMPUTE)
    b = tl.load(B + offs, mask=mask, other=0.0).to(COMPUTE)
    s = tl.sigmoid(a)
    silu = (a * s).to(A.dtype.element_ty).to(COMPUTE)
    tl.store(DA + offs, (dout * b * s * (1.0 + a * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dout * silu).to(DB.dtype.element_ty), mask=mask)
