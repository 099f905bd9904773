"""Context parallelism for Hugging Face causal LMs: ring attention through transformers' attention interface.

`apply_cp(model, cp_mesh)` makes the model run on its rank's zig-zag chunks of every sequence
(`engine/distributed/context.py`), exactly, without touching the model's code:

- attention: the model's config names an attention function registered in transformers'
  `AttentionInterface` that runs Trainyard's ring attention over the context-parallel group (keys and values
  without the grouped-query repeat, the module's own `scaling`). Such a name has no mask function, so the model
  builds no mask: the ring applies the causal mask by chunk;
- positions: a forward pre-hook passes `position_ids`, the global positions of the rank's tokens, so that
  rotary (or learned) position embeddings are those of the whole sequence. It refuses a padding
  `attention_mask` and caller-given `position_ids`, which the ring would ignore, and `labels=` (the model's own
  loss would shift the labels inside the rank's chunks).

A model qualifies when everything but its attention is token-wise, its positions come from `position_ids`,
and its attention is plain causal softmax attention. That is checked, not assumed (`verify_cp`, once per class
and configuration, on the first rank): a small model of the same class and configuration (`small_config`) is run
once on a sequence in zig-zag order with those positions and an attention that masks by position, and its
logits, put back in order, must equal its own forward. Sliding windows, soft-capped attention logits, attention
sinks, attention dropout and position tables that depend on the sequence length seen (dynamic and long rope
scaling) are refused by name before that.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from trainyard.engine.distributed.context import GroupRing, ring_attention, zigzag_positions
from trainyard.engine.models.hf.selfcheck import once_per_rank0, small_config

# The zig-zag run of the small verification model agrees with its forward to float32 rounding (~1e-7).
CP_TOLERANCE = 1e-5
_CHECK = "trainyard_cp_check"
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
_UNSUPPORTED_KWARGS = {"sliding_window": "a sliding window", "softcap": "soft-capped attention logits",
                       "s_aux": "attention sinks"}


def refusal(model: nn.Module) -> str | None:
    """Why context parallelism cannot split this model's attention, read from its configuration; None when
    nothing there refuses it (the run-time check then decides)."""
    cfg = getattr(model, "config", None)
    name = type(model).__name__
    if cfg is None:
        return f"{name} has no configuration"
    if isinstance(getattr(cfg, "sliding_window", None), int) and getattr(cfg, "use_sliding_window", True):
        return (f"{name} attends within a sliding window (sliding_window={cfg.sliding_window}), which the ring "
                "does not apply (a config with sliding_window=None attends over whole sequences and is taken)")
    for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(cfg, key, None):
            return f"{name} soft-caps its attention logits ({key}={getattr(cfg, key)}), which the ring does not"
    for key in ("attention_dropout", "attn_pdrop"):
        if getattr(cfg, key, 0) or 0:
            return f"{name} has attention dropout ({key}={getattr(cfg, key)}), which the ring does not apply"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    # one set of parameters, or one per layer type
    kinds = [r.get("rope_type", r.get("type")) for r in [rope, *rope.values()] if isinstance(r, dict)]
    bad = [k for k in kinds if k in _LENGTH_DEPENDENT_ROPE]
    if bad:
        return (f"{name}'s rotary tables depend on the sequence length each rank sees (rope_type {bad[0]!r}), "
                "not on the global positions alone")
    return None


# --- the attention functions -----------------------------------------------------------------------------------

def _refuse_kwargs(kwargs: dict, dropout: float) -> None:
    if dropout:
        raise ValueError(f"context parallelism: attention dropout {dropout} is not applied by the ring attention; "
                         "set the model's attention dropout to 0")
    for key, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"context parallelism: the model's attention uses {what} ({key}), which the ring "
                             "attention does not apply; set context_parallel_degree to 1")


def _ring(ring: GroupRing, module, query, key, value, attention_mask, dropout: float = 0.0,
          scaling: float | None = None, **kwargs):
    """transformers' attention-function signature: q (b, heads, s, d), k and v (b, kv heads, s, d); returns the
    output as (b, s, heads, d) and no weights."""
    _refuse_kwargs(kwargs, dropout)
    out = ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), ring, scale=scaling)
    return out, None


_CHECK_POSITIONS: list[torch.Tensor] = []  # the positions of the verification run's tokens (one at a time)


def _causal_by_position(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: float | None = None, **kwargs):
    """What the ring computes, in one process on the whole sequence in any order: softmax attention of every
    token over the tokens at or before its position."""
    _refuse_kwargs(kwargs, dropout)
    positions = _CHECK_POSITIONS[-1]
    repeat = query.shape[1] // key.shape[1]
    k, v = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query.float() @ k.float().transpose(-1, -2)) * scale
    allowed = positions[None, :] <= positions[:, None]
    scores = scores.masked_fill(~allowed, -math.inf)
    out = torch.softmax(scores, dim=-1) @ v.float()
    return out.to(query.dtype).transpose(1, 2), None


def _register(name: str, fn) -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    return name


# --- the positions ---------------------------------------------------------------------------------------------

def _positions_hook(cp: int, rank: int, module: nn.Module, args: tuple, kwargs: dict):
    if kwargs.get("position_ids") is not None:
        raise ValueError("context parallelism sets position_ids itself (the global positions of this rank's "
                         "zig-zag chunks); call the model with the tokens of te.sequence_shard only")
    if kwargs.get("labels") is not None:
        raise ValueError("context parallelism: the model's own labels= loss shifts the labels inside this rank's "
                         "zig-zag chunks and would score the wrong token pairs; compute the loss from the logits "
                         "against te.sequence_shard's targets (te.lm_loss(output, targets), or te.forward_backward), "
                         "plus router_aux_loss_coef x output.aux_loss for a mixture of experts with "
                         "output_router_logits, as labels= would add it")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("context parallelism: a padding attention_mask is not applied by the ring attention (it is "
                         "causal over whole sequences); pass sequences without padding")
    tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    rows, local = tokens.shape[:2]
    kwargs["position_ids"] = zigzag_positions(local * cp, cp, rank, device=tokens.device).expand(rows, -1)
    kwargs["attention_mask"] = None
    kwargs.setdefault("use_cache", False)
    return args, kwargs


# --- the check and the transformation ------------------------------------------------------------------------

def _difference(model: nn.Module) -> str | None:
    """Why the zig-zag run of a small model of the class and configuration differs from its forward; None when
    it does not."""
    name = type(model).__name__
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            small = type(model)(small_config(model.config)).eval()
            tokens = torch.randint(0, small.config.vocab_size, (2, 8))
            order = torch.cat([zigzag_positions(8, 2, r) for r in range(2)])
            with torch.no_grad():
                want = small(tokens, use_cache=False).logits
                small.config._attn_implementation = _register(_CHECK, _causal_by_position)
                _CHECK_POSITIONS.append(order)
                try:
                    got = small(tokens[:, order], position_ids=order.expand(2, -1), use_cache=False).logits
                finally:
                    _CHECK_POSITIONS.pop()
    except Exception as e:  # any failure of a model we did not write means: not verified
        return f"a zig-zag run of a small {name} failed: {type(e).__name__}: {e}"
    back = torch.empty_like(got)
    back[:, order] = got
    err = ((back - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not err <= CP_TOLERANCE:
        return (f"a small {name} run on its tokens in zig-zag order, at their positions, differs from its own "
                f"forward by {err:.2e} (relative): something besides its attention mixes tokens, or its positions "
                "do not come from position_ids")
    return None


def verify_cp(model: nn.Module) -> None:
    """ValueError naming the class, and why, when the ring cannot split its attention exactly."""
    cfg = model.config
    key = (type(model), cfg.to_json_string(use_diff=False) if hasattr(cfg, "to_json_string") else repr(cfg))
    why = once_per_rank0(("cp",) + key, lambda: refusal(model) or _difference(model))
    if why is not None:
        raise ValueError(f"context_parallel_degree: the engine cannot split the attention of {type(model).__name__} "
                         f"over the sequence: {why}; set context_parallel_degree to 1 and use MiCS or tensor "
                         "parallelism")


def apply_cp(model: nn.Module, cp_mesh) -> nn.Module:
    """Make the HF causal LM `model` run on its rank's zig-zag chunks over the 1-D `cp_mesh`, exactly."""
    verify_cp(model)
    ring = GroupRing(cp_mesh.get_group())
    model.config._attn_implementation = _register(f"trainyard_ring_{id(ring)}", functools.partial(_ring, ring))
    model.register_forward_pre_hook(functools.partial(_positions_hook, ring.size, ring.rank), with_kwargs=True)
    return model
