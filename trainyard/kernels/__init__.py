"""trainyard.kernels: Triton kernels as torch custom ops, each with an eager reference in its module.

    rms_norm(x, weight, eps)                         rmsnorm.py
    swiglu(a, b)                                     swiglu.py   silu(a) * b
    apply_rope(q, k, cos, sin)                       rope.py     returns the rotated (q, k)
    fused_linear_cross_entropy(hidden, weight, targets, *, ignore_index=-100, reduction="mean")
                                                     cross_entropy.py: logits never materialised in full

Which implementation runs is decided per call (dispatch.py): Triton on CUDA tensors and, under
TRITON_INTERPRET=1, on CPU tensors; the eager reference otherwise. Imported by the engine only.
"""
from trainyard.kernels.rope import apply_rope
from trainyard.kernels.cross_entropy import fused_linear_cross_entropy, vocab_parallel_fused_linear_cross_entropy
from trainyard.kernels.rmsnorm import rms_norm
from trainyard.kernels.swiglu import swiglu
