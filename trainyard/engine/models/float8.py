"""FP8 training through torchao's float8 (`torchao.float8.convert_to_float8_training`): `nn.Linear` layers
become `Float8Linear`, whose matmuls run in FP8 with dynamic tensorwise scaling (inputs and weights e4m3,
output gradients e5m2, one scale per tensor from its current absolute maximum); everything else computes in
bfloat16 with fp32 master weights, as `mixed_precision="bf16"` does.

Left in bfloat16, as torchao recommends: the LM head (its logits feed the loss and are the most sensitive to
rounding) and every layer whose input or output width, divided by the tensor-parallel degree, is not a multiple
of 16 (the FP8 GEMM's alignment; torchao would otherwise pad). The conversion runs before tensor parallelism and
MiCS (FSDP2) sharding. With MiCS over more than one rank the weights are all-gathered in FP8
(`enable_fsdp_float8_all_gather`: half the bytes of bf16), and after every optimizer step one all-reduce
computes the next step's weight scales for all layers at once (`precompute_scales`,
torchao's `precompute_float8_dynamic_scale_for_fsdp`).

FP8 needs tensor cores that have it: NVIDIA compute capability 8.9 or newer (Ada: L4, L40S; Hopper: H100,
H200; Blackwell). `require_float8` refuses anything else, and a missing torchao, before any model work,
naming the setting that asked for it. torchao is imported only here, and only for float8.
"""
from __future__ import annotations

import torch
from torch import nn

from trainyard.engine.config import FP8_MIN_CAPABILITY as MIN_CAPABILITY  # the SDK checks instance types by it too

ALIGNMENT = 16  # the FP8 GEMM (torch._scaled_mm) wants both widths multiples of 16
FP8_EXTRA = "pip install 'trainyard[fp8]'"


def capability(device: torch.device) -> tuple[int, int] | None:
    """The device's CUDA compute capability, None when it is no CUDA GPU (tests replace this)."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def require_float8(device: torch.device, field: str) -> None:
    """Refuse float8 where it cannot run: not an NVIDIA GPU of compute capability >= 8.9, or torchao missing.
    `field` is the setting that asked for it (`dtype` for the built-in trainer, `mixed_precision` for
    transform), named in the error with the fix."""
    bf16 = "bfloat16" if field == "dtype" else "bf16"
    fp16 = "float16" if field == "dtype" else "fp16"
    fix = f"set {field} to {bf16!r} (or {fp16!r} on GPUs without bfloat16)"
    cap = capability(device)
    if cap is None:
        raise ValueError(f"{field} 'float8' needs an NVIDIA GPU with FP8 tensor cores (compute capability "
                         f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer: L4, L40S, H100, H200, B200); this process "
                         f"runs on {device.type}: {fix}")
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        raise ValueError(f"{field} 'float8' needs FP8 tensor cores (compute capability {MIN_CAPABILITY[0]}."
                         f"{MIN_CAPABILITY[1]} or newer: L4, L40S, H100, H200, B200); {device} ({name}) has "
                         f"compute capability {cap[0]}.{cap[1]}: {fix}")
    try:
        import torchao.float8  # noqa: F401 - torchao is optional (the fp8 extra)
    except ImportError as e:
        raise ImportError(f"{field} 'float8' needs torchao's float8 training: {FP8_EXTRA} ({e})") from None


def output_head(model: nn.Module) -> nn.Module | None:
    """The LM head: a Hugging Face model's output embeddings, the built-in Transformer's `output`, else the last
    `nn.Linear` whose width is the vocabulary of one of the model's embeddings; None when there is none."""
    get = getattr(model, "get_output_embeddings", None)
    if callable(get) and isinstance(get(), nn.Linear):
        return get()
    if isinstance(getattr(model, "output", None), nn.Linear):
        return model.output
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features in vocab]
    return heads[-1] if heads else None


def convert(model: nn.Module, *, tp: int = 1, fp8_all_gather: bool = False) -> dict[str, list[str]]:
    """Swap `model`'s eligible `nn.Linear` layers for torchao's `Float8Linear`, in place (on any device, meta
    included). Returns {"float8": converted names, "head": the head's name(s), "unaligned": the names left out
    for widths that are not multiples of 16 x tp}."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    head = output_head(model)
    report: dict[str, list[str]] = {"float8": [], "head": [], "unaligned": []}

    def eligible(module: nn.Module, fqn: str) -> bool:
        if module is head:
            report["head"].append(fqn)
            return False
        if module.in_features % (ALIGNMENT * tp) or module.out_features % (ALIGNMENT * tp):
            report["unaligned"].append(fqn)
            return False
        report["float8"].append(fqn)
        return True

    convert_to_float8_training(model, module_filter_fn=eligible,
                               config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather))
    return report


def describe(report: dict[str, list[str]], fp8_all_gather: bool) -> str:
    """One line for the log: what was converted and what was left in bfloat16."""
    kept = [f"{', '.join(report['head'])} (the LM head)"] if report["head"] else []
    if report["unaligned"]:
        more = f" and {len(report['unaligned']) - 3} more" if len(report["unaligned"]) > 3 else ""
        kept.append(f"{', '.join(report['unaligned'][:3])}{more} (widths not multiples of {ALIGNMENT})")
    gather = "FP8 all-gather" if fp8_all_gather else "bf16 all-gather"
    return (f"float8 (torchao, dynamic tensorwise scaling, {gather}): {len(report['float8'])} Linear layer(s) in FP8"
            + (f"; left in bfloat16: {'; '.join(kept)}" if kept else ""))


def precompute_scales(model: nn.Module) -> None:
    """After an optimizer step of a model whose weights are all-gathered in FP8: the next step's weight scales,
    for all Float8Linear layers in one all-reduce (a collective over the model's mesh)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
