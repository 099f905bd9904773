"""What the self-checks of a Hugging Face class share (the pipeline's stages in spec.py, context parallelism in
cp.py): a small model of the class (`small_config`), and a verdict computed once per process group (the first
rank runs the check, every rank takes its verdict: the ranks do not all pay for it, and they cannot disagree)."""
from __future__ import annotations

import copy
from typing import Callable, Hashable

_verdicts: dict[Hashable, str | None] = {}  # key -> why the check failed (None: it passed)


def once_per_rank0(key: Hashable, check: Callable[[], str | None]) -> str | None:
    """`check()` on the first rank, broadcast to every rank and kept under `key`."""
    if key not in _verdicts:
        import torch.distributed as dist

        verdict = [check() if not dist.is_initialized() or dist.get_rank() == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(verdict, src=0)
        _verdicts[key] = verdict[0]
    return _verdicts[key]


def small_config(config, layers: int = 4):
    """A copy of `config` small enough to build in a blink on a CPU, keeping what shapes the code paths: the head
    dimension, grouped-query attention, every kind of layer (`layer_types`), a sliding window shorter than the
    check's sequence. Lists with one entry per layer are cut to `layers` entries; attention is the eager one."""
    cfg = copy.deepcopy(config)
    n_layers = getattr(config, "num_hidden_layers")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    small = {"num_attention_heads": 4, "vocab_size": 96, "num_hidden_layers": layers}
    if hasattr(config, "num_key_value_heads"):
        small["num_key_value_heads"] = 4 if kv == heads else (1 if kv == 1 else 2)
    if getattr(config, "head_dim", None):
        small["hidden_size"] = 64
    else:
        small["hidden_size"] = 4 * head_dim
    for key, value in vars(config).items():
        if "intermediate_size" in key and isinstance(value, int):
            small[key] = 2 * small["hidden_size"]
        elif isinstance(value, list) and len(value) == n_layers and key != "layer_types":
            small[key] = [value[i % len(value)] for i in range(layers)]
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or ()))
    if kinds:
        small["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    if isinstance(getattr(config, "sliding_window", None), int):
        small["sliding_window"] = 3
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, key, None), int):
            small[key] = min(getattr(config, key), small["vocab_size"] - 1)
    for key, value in small.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = "eager"  # what the check tests is the split, not a GPU attention kernel
    return cfg
