"""Triton kernels as torch custom ops (filled by later issues)."""
