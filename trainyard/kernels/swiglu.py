"""SwiGLU's gate, silu(a) * b elementwise, as the custom op `trainyard::swiglu`, with its eager reference.

    out = silu(a) * b = a * sigmoid(a) * b                a, b: the same shape (any), no broadcasting
    da  = dout * b * s * (1 + a * (1 - s)),  s = sigmoid(a)
    db  = dout * silu(a)

Computed in float32 whatever the input dtype (float64 in float64), stored in the inputs' dtypes: out in
`torch.promote_types(a.dtype, b.dtype)`, da in a's, db in b's. silu(a) is rounded to a's dtype before the
product, as the eager `F.silu(a) * b` rounds it, so bf16/fp16 results match the reference to about an ulp.

Which implementation runs is `dispatch.choose(backend, a)`: the Triton kernels below (CUDA, or CPU under
TRITON_INTERPRET=1) through the custom op, or `swiglu_reference` (plain PyTorch, autograd by torch).

Triton kernels: elementwise over the flattened inputs, BLOCK = 1024 elements per program (masked tail),
int64 offsets; the forward and the backward (da and db in one pass) are separate kernels.
"""
from __future__ import annotations


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
    return torch.ops.trainyard.swiglu(a, b)


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The eager reference, as a Llama MLP writes it."""
    return F.silu(a) * b


# ---- the custom ops -------------------------------------------------------------------------------------

@torch.library.custom_op("trainyard::swiglu", mutates_args=())
def _swiglu_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _forward_triton(a, b)


@_swiglu_op.register_fake
def _(a, b):
    return a.new_empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype))


@torch.library.custom_op("trainyard::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of `trainyard::swiglu` from the output gradient."""
    return _backward_triton(dout, a, b)


@_swiglu_backward_op.register_fake
def _(dout, a, b):
    return torch.empty_like(a), torch.empty_like(b)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dout):
    a, b = ctx.saved_tensors
    return torch.ops.trainyard.swiglu_backward(dout, a, b)


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


# ---- launching the Triton kernels -------------------------------------------------------------------------

def _forward_triton(a, b):
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    n = a.numel()
    if n:
        with _device(a):
            _kernel(_swiglu_fwd_kernel)[(triton.cdiv(n, BLOCK),)](
                a, b, out, n, BLOCK=BLOCK, COMPUTE=_compute(a, b))
    return out


def _backward_triton(dout, a, b):
    dout, a, b = dout.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    if n:
        with _device(a):
            _kernel(_swiglu_bwd_kernel)[(triton.cdiv(n, BLOCK),)](
                dout, a, b, da, db, n, BLOCK=BLOCK, COMPUTE=_compute(a, b))
    return da, db


def _compute(a, b):
    """float64 when either input is float64, else float32."""
    return tl.float64 if torch.float64 in (a.dtype, b.dtype) else tl.float32


_device = dispatch.on_device
_kernel = dispatch.jit


def _swiglu_fwd_kernel(A, B, OUT, n, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(COMPUTE)
    b = tl.load(B + offs, mask=mask, other=0.0).to(COMPUTE)
    silu = (a * tl.sigmoid(a)).to(A.dtype.element_ty).to(COMPUTE)  # rounded to a's dtype, as F.silu(a) is
    tl.store(OUT + offs, (silu * b).to(OUT.dtype.element_ty), mask=mask)


def _swiglu_bwd_kernel(DOUT, A, B, DA, DB, n, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(COMPUTE)
    a = tl.load(A + offs, mask=mask, other=0.0).to(COMPUTE)
    b = tl.load(B + offs, mask=mask, other=0.0).to(COMPUTE)
    s = tl.sigmoid(a)
    silu = (a * s).to(A.dtype.element_ty).to(COMPUTE)
    tl.store(DA + offs, (dout * b * s * (1.0 + a * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dout * silu).to(DB.dtype.element_ty), mask=mask)
