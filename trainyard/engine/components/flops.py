"""Model FLOPs per token, the device's peak FLOPs, and MFU.

Model FLOPs of one training token (forward + backward, no recomputation counted), after PaLM (Chowdhery et
al. 2022, appendix B), as torchtitan and Megatron-LM report MFU:

    6 N + 12 L H Q T

N: the parameters that do matrix multiplies per token: every parameter but the input embedding table (a
lookup; a tied embedding is the head's weight and counts); L layers, H attention heads of width Q, T the
sequence length: the attention scores and their weighted sum, 2 x 2 L H Q T in forward, x 3 with backward.
(The causal mask halves the useful part of that term; like PaLM and torchtitan, it is not halved.)

MFU = model FLOPs per second per device / the device's peak. Peak: from `PEAK_TFLOPS` for a known GPU and
the compute dtype (dense, no sparsity), else measured: a fp32/bf16 matmul timed at start-up on every rank
at once (what the ranks of this host can do together), stated as measured in `peak_source`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

# dense tensor-core TFLOP/s from the vendors' datasheets: {name fragment: {dtype: peak}}; fp32 runs as TF32
PEAK_TFLOPS = {
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    "H100 SXM": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    "H100 80GB HBM3": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},  # the SXM part's device name
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 60.0},
    "A10": {"bfloat16": 125.0, "float16": 125.0, "float32": 62.5},
}


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    head_dim: int
    matmul_params: int
    """N: every parameter but the input embedding table."""

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.heads * self.head_dim * seq_len


def shape_of(model: nn.Module) -> Shape | None:
    """The shape of the built-in Transformer or a Hugging Face causal LM (on any device, meta included); None
    for a model whose layers and heads are unknown."""
    total = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):  # Hugging Face
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        embedding = model.get_input_embeddings().weight
        tied = embedding is getattr(model.get_output_embeddings(), "weight", None)
        return Shape(config.num_hidden_layers, heads, head_dim, total - (0 if tied else embedding.numel()))
    if config is not None and hasattr(config, "n_heads") and hasattr(model, "tok_embeddings"):  # the built-in model
        return Shape(config.n_layers, config.n_heads, config.head_dim, total - model.tok_embeddings.weight.numel())
    return None


def table_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str] | None:
    """(TFLOP/s, source) from PEAK_TFLOPS for this GPU and dtype; None when the GPU is not in it."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = str(dtype).removeprefix("torch.")
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in name and key in peaks:
            return peaks[key], f"datasheet: {fragment} {key} dense ({name})"
    return None


def measured_peak(device: torch.device, dtype: torch.dtype, *, size: int = 1024, seconds: float = 0.3) -> tuple[float, str]:
    """TFLOP/s of a `size`^3 matmul in `dtype`, best of repeated timings for about `seconds`. Every rank of the
    job runs it at the same moment (a collective when torch.distributed is up): the result, averaged over the
    ranks, is what one rank gets while all of them compute, the peak MFU is measured against."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    if dist.is_initialized():
        dist.barrier()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2.0 * size ** 3 / (time.perf_counter() - t0))
    tflops = torch.tensor([best / 1e12], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tflops)
        tflops /= dist.get_world_size()
    threads = torch.get_num_threads()
    return float(tflops), (f"measured at start-up: {size}^3 {str(dtype).removeprefix('torch.')} matmul on "
                           f"{device.type}, {threads} thread(s) per rank, all ranks at once, mean over ranks")


def peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The peak TFLOP/s one device (rank) is measured against, and where it comes from. A collective on CPU
    or an unknown GPU (every rank measures)."""
    return table_peak(device, dtype) or measured_peak(device, dtype)
