"""trainyard.kernels: Triton kernels as torch custom ops, each with an eager reference in its module.

    rms_norm(x, weight, eps)                         rmsnorm.py
    swiglu(a, b)                                     swiglu.py   silu(a) * b
    apply_rope(q, k, cos, sin)                       rope.py     returns the rotated (q, k)
    fused_linear_cross_entropy(hidden, weight, targets, *, ignore_index=-100, reduction="mean")
                                                     cross_entropy.py: logits never materialised in full

Which implementation runs is decided per call (dispatch.py): Triton on CUDA tensors and, under
TRITON_INTERPRET=1, on CPU tensors; the eager reference otherwise. Imported by the engine only.

No AdamW here: `torch.optim.AdamW(fused=True)` (what the built-in trainer uses on CUDA) already updates every
parameter of a group in one multi-tensor kernel, fp32 math, over FSDP2's local shards. The step is one
memory-bound pass (read parameter, gradient and both moments, write three of them back: 28 bytes per fp32
element), with no neighbouring op to fuse it with; a Triton version could at best tie it.
"""
from trainyard.kernels.cross_entropy import fused_linear_cross_entropy, vocab_parallel_fused_linear_cross_entropy
from trainyard.kernels.rmsnorm import rms_norm
from trainyard.kernels.rope import apply_rope
from trainyard.kernels.swiglu import swiglu

__all__ = ["rms_norm", "swiglu", "apply_rope", "fused_linear_cross_entropy", "vocab_parallel_fused_linear_cross_entropy"]
