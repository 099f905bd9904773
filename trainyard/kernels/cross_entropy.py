"""Fused LM head + cross-entropy as the custom op `trainyard::fused_linear_cross_entropy`: the (N, V) logits
are never materialised in full.

    loss = cross_entropy(hidden @ weight.T, targets)    hidden (N, H) or (..., H), weight (V, H), targets (N,)

Protocol. Tokens are processed in chunks of C rows. For each chunk the forward pass computes the chunk's
logits (torch.matmul / cuBLAS) into one (C, V) buffer in hidden's dtype (bf16 for a bf16 model), reused by
every chunk; the Triton row kernel reads them once for the row's max and sum of exponentials (float32) and
once more to overwrite them, in place, with the gradient of the logits, (softmax - onehot(target)) * scale,
rounded to that dtype. From that buffer it writes the chunk's rows of grad_hidden (dlogits @ weight) into a
preallocated (N, H) buffer in hidden's dtype and accumulates grad_weight (dlogits.T @ hidden_chunk) in place
into one (V, H) buffer. The backward pass only scales the two stored gradients by the loss's incoming
gradient (a no-op, and no (V, H) product, for `loss.backward()`). Liger-Kernel's FusedLinearCrossEntropy
works the same way; like it, only the per-chunk softmax / loss / gradient of the logits is a Triton kernel,
the three matmuls stay torch.matmul (cuBLAS on GPUs).

    scale       mean: 1 / (number of rows whose target is not ignore_index); sum: 1
    ignored     rows with target == ignore_index have loss 0 and gradient 0, and are not counted in the
                mean's denominator (torch's convention; all rows ignored: loss nan, gradients 0, as torch)
    none        reduction="none" returns the (N,) float32 row losses; its gradients need the incoming
                per-row gradient, so they are computed in the backward pass by a second chunked pass
                (`trainyard::fused_linear_cross_entropy_backward`), which recomputes the logits
    dtypes      hidden and weight of one dtype (fp32, bf16, fp16, fp64); the softmax and the loss in
                float32 (float64 for float64 inputs); the loss is returned in float32 (float64); bf16/fp16
                logits' gradients are rounded to the input dtype before their two matmuls, as Liger does
    grad_weight `accumulate="weight"` (the default): in the weight's dtype, as Liger-Kernel (bf16: each
                chunk's product is summed in float32 by cuBLAS and rounded once into the buffer; the
                backward hands the buffer over as the gradient, no copy); "float32": a float32 buffer
                (float32-exact sums over the chunks) cast to the weight's dtype in the backward: for a bf16
                head 2 V H bytes more while it is held, and one more V H-sized cast

Memory above the inputs (bf16, "weight"): grad_weight 2 V H + one chunk's logits 2 C V + grad_hidden 2 N H
bytes. Llama 3 8B's head (H 4096, V 128256) at 8192 tokens and C = 1024: 1,051 + 263 + 67 = 1,381 MB
(Liger-Kernel's measured 1,183 MB: 1.17x); C = 512: 1,249 MB (1.06x). With "float32": 2,101 + 263 + 67 MB
during the forward, and the bf16 cast on top in the backward (the 3,219 MB measured before it existed).

Chunk size (`chunk_size_for`): C = the largest power of two <= H / 4, at most N (`TUNING["chunk_size"]`
overrides it; bench/kernels_tune.py measures C in 256..2048). Why that size: grad_weight's accumulation reads
and writes the (V, H) buffer once per chunk (4 V H bytes in bf16, 8 in float32) for 2 C V H flops, an
arithmetic intensity of C / 2 (bf16; C / 4 float32) flops/byte: 512 at C = 1024, above an H100's ridge
(~300 flops/byte), so the accumulation stays compute-bound; Liger's rule (chunk logits about the size of
hidden: C = N H / V, 256 tokens for Llama 3 8B's 8k tokens) gives 128 (memory-bound: 32 passes over the
buffer). The chunk's logits, 2 C V bytes in bf16, are then at most half of the bf16 buffer (a quarter of the
float32 one) whatever V and N.

Soft-capping (`softcap=c`, Gemma 2/3's `final_logit_softcapping`): each chunk's logits are replaced by
c * tanh(z / c) before the row losses, and the gradient of the logits is multiplied by 1 - tanh(z / c)^2
before the matmuls; one more (C, V) float32 buffer per chunk.

Registered once, as a custom op (opaque to torch.compile), on every device, unlike the other ops (which
have a triton_op for CUDA, dispatch.register): its body is three cuBLAS matmuls per chunk around one row
kernel, writing into buffers it reuses in place; traced into inductor's graph the in-place reuse would be
functionalised (a copy of the logits buffer per chunk) for nothing to fuse (the loss sits after the model's
last block, outside its compiled regions).

Which implementation runs is `dispatch.choose(backend, hidden)`: "triton" (CUDA, or CPU under
TRITON_INTERPRET=1) runs `_ce_rows_kernel` per chunk; "eager" (the chunked eager mode: what CPU runs without
the interpreter) does the same per-chunk maths in torch, in place on one reused chunk buffer.

Tensor parallelism: `vocab_parallel_fused_linear_cross_entropy` takes this rank's rows of a head sharded
by vocabulary (rows vocab_start .. vocab_start + V_local) and the full targets; per chunk it all-reduces the
rows' max (MAX) and then their sum of exponentials and target logit (one SUM), so every rank forms the same
loss; grad_hidden is summed over the group once at the end, grad_weight stays the shard's.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from trainyard.kernels import dispatch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency: without it every call takes the eager path
    triton = tl = None

REDUCTIONS = ("mean", "sum", "none")
ACCUMULATE = ("weight", "float32")
# Overrides of the defaults (the GPU sweep, bench/kernels_tune.py, sets them): "chunk_size" (tokens per chunk,
# instead of chunk_size_for), "accumulate" ("weight" or "float32"), "warps" (of the row kernel, instead of
# the width rule). Empty: the defaults.
TUNING: dict = {}
# The Triton kernel walks a row of V logits in blocks of at most this many columns (Liger-Kernel's
# MAX_FUSED_SIZE, 65536 // 2); a module attribute so that tests can make V span several blocks.
MAX_BLOCK = 32768


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               ignore_index: int = -100, reduction: str = "mean", backend: str = "auto",
                               chunk_size: int | None = None, softcap: float | None = None,
                               accumulate: str | None = None) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight), targets, ignore_index=..., reduction=...)` without the
    full logits (see the module docstring). `softcap` c: the logits are soft-capped first, c * tanh(z / c)
    (Gemma 2 and 3's final-logit soft-capping).

    hidden (..., H), weight (V, H) (the LM head, no bias), targets of hidden.shape[:-1] (int64).
    Returns a float32 scalar for "mean"/"sum", float32 of targets' shape for "none".
    backend: "auto" (Triton where it runs, else the chunked eager path), "triton" or "eager".
    chunk_size: tokens per chunk; default `TUNING["chunk_size"]`, else `chunk_size_for(H, N)`.
    accumulate: the dtype grad_weight is accumulated in over the chunks: "weight" (the weight's own dtype,
    as Liger-Kernel: a bf16 head gets a bf16 (V, H) buffer, rounded once per chunk) or "float32" (float32,
    float64 for float64, then cast to the weight's dtype in the backward: exact to float32, 2x (bf16) the
    memory); default `TUNING["accumulate"]`, else "weight". For float32/float64 weights both are the same.
    """
    h2, t1 = _flatten(hidden, weight, targets, reduction)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"fused_linear_cross_entropy: softcap must be > 0 (or None), got {softcap!r}")
    accumulate = accumulate or TUNING.get("accumulate", "weight")
    if accumulate not in ACCUMULATE:
        raise ValueError(f"fused_linear_cross_entropy: accumulate={accumulate!r}: use one of {', '.join(ACCUMULATE)}")
    impl = dispatch.choose(backend, hidden)
    chunk = chunk_size or TUNING.get("chunk_size") or chunk_size_for(h2.shape[1], h2.shape[0])
    loss, _, _ = torch.ops.trainyard.fused_linear_cross_entropy(h2, weight, t1, ignore_index, reduction, impl,
                                                                chunk, float(softcap or 0.0),
                                                                accumulate == "weight")
    return loss.view(targets.shape) if reduction == "none" else loss


def chunk_size_for(hidden_size: int, tokens: int) -> int:
    """Tokens per chunk: the largest power of two <= hidden_size / 4, at most `tokens` (the module docstring
    says why: grad_weight's accumulation stays compute-bound, and a chunk's logits stay <= half of the (V, H)
    gradient buffer in the same dtype)."""
    c = 1 << max(0, (max(1, hidden_size // 4)).bit_length() - 1)
    return max(1, min(c, tokens))


def _flatten(hidden, weight, targets, reduction):
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: use one of {', '.join(REDUCTIONS)}")
    if weight.dim() != 2 or hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} and weight "
                         f"{tuple(weight.shape)}: weight must be (vocab, H) with H = hidden.shape[-1]")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"fused_linear_cross_entropy: targets {tuple(targets.shape)} for hidden "
                         f"{tuple(hidden.shape)}: one target per row of hidden")
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise ValueError(f"fused_linear_cross_entropy: hidden is {hidden.dtype} on {hidden.device}, weight "
                         f"{weight.dtype} on {weight.device}: give both the same dtype and device")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"fused_linear_cross_entropy: targets are {targets.dtype}: class indices (int64)")
    # the Triton kernel reads targets at unit stride
    return hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).long().contiguous()


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32, float64 for float64 (so that gradcheck can run)."""
    return torch.promote_types(dtype, torch.float32)


def _grad_weight_dtype(weight_dtype: torch.dtype, in_weight_dtype: bool) -> torch.dtype:
    """grad_weight's accumulation dtype: the weight's own (`accumulate="weight"`) or the math dtype."""
    return weight_dtype if in_weight_dtype else _math_dtype(weight_dtype)


# ---- the custom ops ------------------------------------------------------------------------------------

@torch.library.custom_op("trainyard::fused_linear_cross_entropy", mutates_args=())
def _flce_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
             reduction: str, backend: str, chunk_size: int, softcap: float,
             in_weight_dtype: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight): the loss as reduced, and for "mean"/"sum" the gradients of that
    loss ((N, H) in hidden's dtype, (V, H) in weight's dtype when `in_weight_dtype`, else float32; empty for
    "none"), saved for the backward. softcap 0: none."""
    gdtype = _grad_weight_dtype(weight.dtype, in_weight_dtype)
    if reduction == "none":
        rows, _, _ = _chunked(hidden, weight, targets, None, ignore_index, backend, chunk_size, softcap)
        return rows, hidden.new_empty(0), hidden.new_empty(0, dtype=gdtype)
    count = (targets != ignore_index).sum()
    scale = 1.0 / count.clamp(min=1).to(_math_dtype(hidden.dtype)) if reduction == "mean" \
        else torch.ones((), dtype=_math_dtype(hidden.dtype), device=hidden.device)
    rows, grad_hidden, grad_weight = _chunked(hidden, weight, targets, scale, ignore_index, backend, chunk_size,
                                              softcap, gdtype)
    loss = rows.sum()
    return (loss / count if reduction == "mean" else loss), grad_hidden, grad_weight


@_flce_op.register_fake
def _(hidden, weight, targets, ignore_index, reduction, backend, chunk_size, softcap, in_weight_dtype):
    math = _math_dtype(hidden.dtype)
    gdtype = _grad_weight_dtype(weight.dtype, in_weight_dtype)
    if reduction == "none":
        return hidden.new_empty(hidden.shape[0], dtype=math), hidden.new_empty(0), hidden.new_empty(0, dtype=gdtype)
    return hidden.new_empty((), dtype=math), hidden.new_empty(hidden.shape), weight.new_empty(weight.shape,
                                                                                              dtype=gdtype)


@torch.library.custom_op("trainyard::fused_linear_cross_entropy_backward", mutates_args=())
def _flce_backward_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_rows: torch.Tensor,
                      ignore_index: int, backend: str, chunk_size: int, softcap: float,
                      in_weight_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight) of sum(grad_rows * row_losses): reduction="none"'s backward; grad_weight
    in weight's dtype when `in_weight_dtype`, else float32."""
    _, grad_hidden, grad_weight = _chunked(hidden, weight, targets, grad_rows.to(_math_dtype(hidden.dtype)),
                                           ignore_index, backend, chunk_size, softcap,
                                           _grad_weight_dtype(weight.dtype, in_weight_dtype))
    return grad_hidden, grad_weight


@_flce_backward_op.register_fake
def _(hidden, weight, targets, grad_rows, ignore_index, backend, chunk_size, softcap, in_weight_dtype):
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape,
                                                            dtype=_grad_weight_dtype(weight.dtype, in_weight_dtype))


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, ignore_index, reduction, backend, chunk_size, softcap, in_weight_dtype = inputs
    _, grad_hidden, grad_weight = output
    ctx.mark_non_differentiable(grad_hidden, grad_weight)
    ctx.set_materialize_grads(False)  # else backward would get (V, H) zeros for the unused outputs
    ctx.reduction, ctx.weight_dtype = reduction, weight.dtype
    if reduction == "none":
        ctx.args = (ignore_index, backend, chunk_size, softcap, in_weight_dtype)
        ctx.save_for_backward(hidden, weight, targets)
    else:
        ctx.save_for_backward(grad_hidden, grad_weight)


def _backward(ctx, grad_loss, _grad_hidden, _grad_weight):
    if grad_loss is None:
        return (None,) * 9
    if ctx.reduction == "none":
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden, grad_weight = torch.ops.trainyard.fused_linear_cross_entropy_backward(
            hidden, weight, targets, grad_loss, *ctx.args)
        return (grad_hidden, grad_weight.to(ctx.weight_dtype)) + (None,) * 7
    grad_hidden, grad_weight = ctx.saved_tensors
    return (_scaled(grad_hidden, grad_loss), _scaled(grad_weight, grad_loss, ctx.weight_dtype)) + (None,) * 7


_flce_op.register_autograd(_backward, setup_context=_setup_context)


def _scaled(grad: torch.Tensor, grad_loss: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """grad * grad_loss in `dtype`, never in place. `loss.backward()` passes exactly 1: the stored gradient
    is then returned as it is (no (V, H) product; the check costs one device sync, as in Liger), and autograd
    makes it the parameter's .grad without a copy when .grad was None. Traced (torch.compile, fake tensors)
    the product is always taken. torch.autograd.grad may run through a retained graph any number of times;
    `.backward(retain_graph=True)` twice accumulates correctly, a third time raises torch's "modified by an
    inplace operation" error (the .grad that the first made of the stored buffer was added to in place)."""
    dtype = dtype or grad.dtype
    if type(grad_loss) is torch.Tensor and not torch.compiler.is_compiling() and grad.dtype == dtype \
            and bool(grad_loss == 1):
        return grad
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    return torch.mul(grad, grad_loss.to(grad.dtype), out=out)


# ---- the chunked loop (both backends) ------------------------------------------------------------------

def _chunked(hidden, weight, targets, scale, ignore_index, backend, chunk, softcap=0.0, grad_weight_dtype=None):
    """Row losses (N,), and when `scale` is given (a 0-d tensor, or (N,) per-row factors) the gradients of
    sum(scale * row_losses): grad_hidden (N, H) in hidden's dtype and grad_weight (V, H) in
    `grad_weight_dtype` (default the math dtype, float32), accumulated in place over the chunks. With
    `softcap` c > 0 each chunk's logits z become c * tanh(z / c) before the loss, and their gradient is
    multiplied by the cap's derivative, 1 - tanh(z / c)^2, before the two matmuls."""
    n, h = hidden.shape
    v = weight.shape[0]
    math = _math_dtype(hidden.dtype)
    grads = scale is not None
    rows = torch.empty(n, dtype=math, device=hidden.device)
    grad_hidden = hidden.new_empty(hidden.shape) if grads else None  # contiguous: chunks are written with out=
    grad_weight = torch.zeros((v, h), dtype=grad_weight_dtype or math, device=hidden.device) if grads else None
    chunk = max(1, min(chunk, n))
    # one chunk's logits, reused by every chunk (on CPU a fresh buffer per chunk costs a page-faulting mmap);
    # the eager path of bf16/fp16 inputs also keeps a float32 copy for the softmax
    logits_buf = hidden.new_empty((chunk, v))
    math_buf = logits_buf if (backend == "triton" or hidden.dtype == math) else hidden.new_empty((chunk, v),
                                                                                                 dtype=math)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h_c, t_c = hidden[start:end], targets[start:end]
        logits = torch.mm(h_c, weight.t(), out=logits_buf[: end - start])
        s_c = None if not grads else scale if scale.dim() == 0 else scale[start:end]
        capped = _soft_cap(logits, softcap) if softcap else None  # tanh(z / c), in the math dtype
        if backend == "triton":
            rows[start:end] = _rows_triton(logits, t_c, s_c, ignore_index)
            dlogits = dmath = logits  # the kernel wrote the gradient over the logits
            if grads and capped is not None:
                dlogits.mul_(capped.square_().neg_().add_(1.0))
        else:
            dmath = math_buf[: end - start]
            if math_buf is not logits_buf:
                dmath.copy_(logits)
            rows[start:end] = _rows_eager(dmath, t_c, s_c, ignore_index)
            if grads and capped is not None:
                dmath.mul_(capped.square_().neg_().add_(1.0))
            dlogits = logits.copy_(dmath) if dmath.dtype != logits.dtype else dmath
        if grads:
            torch.mm(dlogits, weight, out=grad_hidden[start:end])
            _accumulate(grad_weight, dlogits, dmath, h_c)
    return rows, grad_hidden, grad_weight


def _soft_cap(logits, cap):
    """Overwrite `logits` (z) with cap * tanh(z / cap); returns tanh(z / cap) in the math dtype, for the gradient."""
    t = torch.tanh(logits.to(_math_dtype(logits.dtype)) / cap)
    logits.copy_(t * cap)
    return t


def _rows_eager(logits, targets, scale, ignore_index):
    """Row losses of the (C, V) logits (float32/64); with `scale`, overwrites the logits with the gradient
    of sum(scale * losses), in place (no (C, V) temporary)."""
    valid = targets != ignore_index
    t = torch.where(valid, targets, 0)
    target_logit = logits.gather(1, t[:, None]).squeeze(1)
    m = logits.amax(1, keepdim=True)
    e = logits.sub_(m).exp_()  # in place: logits are now exp(x - max)
    total = e.sum(1, keepdim=True)
    lse = (m + total.log()).squeeze(1)
    losses = torch.where(valid, lse - target_logit, 0.0)
    if scale is not None:
        e.div_(total)  # softmax
        e[torch.arange(len(t), device=t.device), t] -= 1.0
        e.mul_((torch.where(valid, scale, 0.0) if scale.dim() else valid * scale)[:, None])
    return losses


def _accumulate(grad_weight, dlogits, dmath, h_c):
    """grad_weight (V, H) += dlogits.T @ h_c, in place: one addmm in the operands' dtype when grad_weight has
    it (bf16 into a bf16 buffer: cuBLAS sums each product in float32 and rounds once), else into float32."""
    if dlogits.dtype == grad_weight.dtype:
        grad_weight.addmm_(dlogits.t(), h_c)
    elif dlogits.is_cuda and _mixed_addmm_works(dlogits.device):  # bf16 operands, fp32 output (cuBLAS)
        torch.addmm(grad_weight, dlogits.t(), h_c, out_dtype=grad_weight.dtype, out=grad_weight)
    else:  # CPU (no mixed-dtype addmm): the chunk's operands in float32
        grad_weight.addmm_((dmath if dmath.dtype == grad_weight.dtype else dlogits.to(grad_weight.dtype)).t(),
                           h_c.to(grad_weight.dtype))


@functools.cache
def _mixed_addmm_works(device: torch.device) -> bool:
    """aten::addmm.dtype_out (bf16 operands into an fp32 output, in place) exists and is right on `device`."""
    try:
        one = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device)
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
        return bool((acc == 3).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


# ---- the Triton kernel ---------------------------------------------------------------------------------

def _rows_triton(logits, targets, scale, ignore_index):
    """`_rows_eager` by `_ce_rows_kernel`: one program per row of the contiguous (C, V) logits."""
    c, v = logits.shape
    losses = torch.empty(c, dtype=_math_dtype(logits.dtype), device=logits.device)
    block = min(MAX_BLOCK, triton.next_power_of_2(v))
    # warps as Liger-Kernel's calculate_settings: 4 up to 2048 columns, 8 to 8192, 16 to 32768, then 32
    warps = TUNING.get("warps") or (32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4)
    grads = scale is not None
    scale_arg = scale if grads else losses  # unread when GRAD is off
    with _device(logits):
        _kernel(_ce_rows_kernel)[(c,)](
            logits, logits.stride(0), targets, scale_arg, scale_arg.stride(0) if scale_arg.dim() else 0, losses, v,
            ignore_index, GRAD=grads, BLOCK=block, MATH=tl.float64 if losses.dtype == torch.float64 else tl.float32,
            num_warps=warps)
    return losses


_device = dispatch.on_device
_kernel = dispatch.jit


def _ce_rows_kernel(LOGITS, stride_row, TARGETS, SCALE, stride_scale, LOSSES, V, ignore_index,
                    GRAD: tl.constexpr, BLOCK: tl.constexpr, MATH: tl.constexpr):
    """Row `program_id`: loss = logsumexp(x) - x[target] (0 for ignored rows), by an online max / sum of
    exponentials over blocks of the row; with GRAD, a second pass overwrites x with
    (softmax(x) - onehot(target)) * scale (0 for ignored rows)."""
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: C * V passes 2**31 for large chunks
    base = LOGITS + row * stride_row
    target = tl.load(TARGETS + row)
    m = tl.full((), float("-inf"), MATH)
    total = tl.zeros((), MATH)
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(MATH)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(total)
    valid = target != ignore_index
    x_target = tl.load(base + target, mask=valid, other=0.0).to(MATH)
    tl.store(LOSSES + row, tl.where(valid, lse - x_target, 0.0))
    if GRAD:
        scale = tl.load(SCALE + row * stride_scale).to(MATH)
        scale = tl.where(valid, scale, 0.0)
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=0.0).to(MATH)
            g = tl.exp(x - lse)
            g = tl.where(cols == target, g - 1.0, g) * scale
            tl.store(base + cols, g.to(LOGITS.dtype.element_ty), mask=mask)


# ---- vocabulary-parallel (a head sharded by vocabulary under tensor parallelism) ------------------------

def vocab_parallel_fused_linear_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor,
                                              targets: torch.Tensor, *, vocab_start: int, group=None,
                                              ignore_index: int = -100, reduction: str = "mean",
                                              chunk_size: int | None = None) -> torch.Tensor:
    """The same loss when this rank holds rows vocab_start .. vocab_start + V_local of the head.

    hidden (..., H) and targets (global class indices) are the same on every rank of `group` (a process
    group; None: the default one); every rank returns the same float32 loss ("mean" or "sum"). Gradients:
    hidden's summed over the group (each rank's is its shard's contribution), weight_shard's its own.
    The per-chunk maths is eager (torch): the collectives sit between the max and the sums of each row.
    """
    if reduction == "none":
        raise ValueError("vocab_parallel_fused_linear_cross_entropy: reduction='none' is not supported; "
                         "use 'mean' or 'sum'")
    h2, t1 = _flatten(hidden, weight_shard, targets, reduction)
    chunk = chunk_size or chunk_size_for(h2.shape[1], h2.shape[0])
    return _VocabParallel.apply(h2, weight_shard, t1, vocab_start, group, ignore_index, reduction, chunk)


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, group, ignore_index, reduction, chunk):
        loss, grad_hidden, grad_weight = _vocab_parallel_chunked(hidden, weight, targets, vocab_start, group,
                                                                 ignore_index, reduction, chunk)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return _scaled(grad_hidden, grad_loss), _scaled(grad_weight, grad_loss, ctx.weight_dtype), \
            None, None, None, None, None, None


def _vocab_parallel_chunked(hidden, weight, targets, vocab_start, group, ignore_index, reduction, chunk):
    n, h = hidden.shape
    v_local = weight.shape[0]
    math = _math_dtype(hidden.dtype)
    valid_all = targets != ignore_index
    count = valid_all.sum()
    scale = 1.0 / count.clamp(min=1).to(math) if reduction == "mean" else torch.ones((), dtype=math,
                                                                                      device=hidden.device)
    rows = torch.empty(n, dtype=math, device=hidden.device)
    grad_hidden = hidden.new_empty(hidden.shape)
    grad_weight = torch.zeros((v_local, h), dtype=math, device=hidden.device)
    chunk = max(1, min(chunk, n))
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h_c, t_c, valid = hidden[start:end], targets[start:end], valid_all[start:end]
        logits = torch.mm(h_c, weight.t())
        x = logits if logits.dtype == math else logits.to(math)
        local = valid & (t_c >= vocab_start) & (t_c < vocab_start + v_local)
        t_local = torch.where(local, t_c - vocab_start, 0)
        m = x.amax(1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        stats = torch.stack([torch.zeros_like(m), torch.where(local, x.gather(1, t_local[:, None]).squeeze(1), 0.0)])
        e = x.sub_(m[:, None]).exp_()  # in place: exp(x - global max)
        stats[0] = e.sum(1)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)  # sum of exponentials, target logit
        total, target_logit = stats
        rows[start:end] = torch.where(valid, m + total.log() - target_logit, 0.0)
        e.div_(total[:, None])
        e[torch.arange(end - start, device=e.device), t_local] -= local.to(math)
        e.mul_((valid * scale)[:, None])
        dlogits = logits.copy_(e) if e.dtype != logits.dtype else e
        torch.mm(dlogits, weight, out=grad_hidden[start:end])
        _accumulate(grad_weight, dlogits, e, h_c)
    dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=group)
    loss = rows.sum()
    return (loss / count if reduction == "mean" else loss), grad_hidden, grad_weight
