"""The device's peak FLOPs and a model's shape, for MFU (model FLOPs per second per device / the device's peak).

The formula and the peak table are `trainyard/parallel/shapes.py`'s (`model_flops_per_token`, `PEAK_TFLOPS`).
Peak: from that table for a known GPU and the compute dtype (dense, no sparsity), else measured: a fp32/bf16
matmul timed at start-up on every rank at once (what the ranks of this host can do together), stated as
measured in `peak_source`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainyard.parallel import shapes
from trainyard.parallel.shapes import model_flops_per_token


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    head_dim: int
    matmul_params: int
    """N: every parameter but the input embedding table."""

    def flops_per_token(self, seq_len: int) -> float:
        return model_flops_per_token(matmul_params=self.matmul_params, layers=self.layers, heads=self.heads,
                                     head_dim=self.head_dim, seq_len=seq_len)


def shape_of(model: nn.Module) -> Shape | None:
    """The shape of the built-in Transformer or a Hugging Face causal LM (on any device, meta included); None
    for a model whose layers and heads are unknown. N counts the model's own parameters but the input embedding
    table and, in a mixture of experts, the routed experts a token is not sent to (`ModelShape.matmul_params`:
    a token multiplies by its top_k experts only)."""
    total = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):  # Hugging Face
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        embedding = model.get_input_embeddings().weight
        tied = embedding is getattr(model.get_output_embeddings(), "weight", None)
        return Shape(config.num_hidden_layers, heads, head_dim,
                     total - (0 if tied else embedding.numel()) - _idle_experts(model))
    if config is not None and hasattr(config, "n_heads") and hasattr(model, "tok_embeddings"):  # the built-in model
        return Shape(config.n_layers, config.n_heads, config.head_dim,
                     total - model.tok_embeddings.weight.numel() - _idle_experts(model))
    return None


def _idle_experts(model: nn.Module) -> int:
    """The parameters of the routed experts a token does not go through: in each `experts` module (the built-in
    model's, transformers' packed ones (experts, ...) or a list of experts), all but top_k of its experts'. Read
    from the modules, so a model whose blocks are partly dense counts its sparse blocks only; 0 for a dense model."""
    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None)
    if not isinstance(top_k, int) or top_k < 1:
        return 0
    idle = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        params = list(module.parameters())
        if isinstance(module, nn.ModuleList):
            n = len(module)
        else:  # packed: every tensor's first dimension the experts, and a 3-D weight among them
            n = params[0].shape[0] if params and any(p.dim() == 3 for p in params) else 0
            n = n if all(p.shape[0] == n for p in params) else 0
        if n > top_k:
            idle += sum(p.numel() for p in params) * (n - top_k) // n
    return idle


def table_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str] | None:
    """(TFLOP/s, source) from PEAK_TFLOPS for this GPU and dtype; None when the GPU is not in it."""
    if device.type != "cuda":
        return None
    name, key = torch.cuda.get_device_name(device), str(dtype).removeprefix("torch.")
    found = shapes.table_peak(name, key)
    return None if found is None else (found[0], f"datasheet: {found[1]} {key} dense ({name})")


def measured_peak(device: torch.device, dtype: torch.dtype, *, size: int = 1024, seconds: float = 0.1) -> tuple[float, str]:
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
