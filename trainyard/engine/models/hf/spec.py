"""Hugging Face models as a registered spec (transformers is an optional extra: `trainyard[hf]`).

- Blocks: the modules of the classes named in `_no_split_modules` (`LlamaDecoderLayer`, ...).
- TP plan: the model's own `_tp_plan` (its `base_model_tp_plan` under `model.` plus the head's entries):
  q/k/v and gate/up column-parallel, o and down row-parallel, the embedding split over the vocabulary and
  the head column-parallel with its logits gathered, so the forward returns plain full logits and HF
  output classes. With tied embeddings the head is left out of the plan (one weight cannot be split two
  ways). Heads, widths and vocabulary are checked against the degree.
- Pipeline (decoder-only causal LMs with `model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`):
  stage 0 holds the embedding, the last stage the final norm and head; each stage recomputes the rotary
  embedding and the causal mask from its input, so only hidden states cross stages.
- Meta-device init: the model's `_init_weights`, module by module (`distributed.materialize`).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from trainyard.engine.models.generic import blocks_by_class
from trainyard.engine.models.spec import ModelSpec, StageSplit


def _config(model: nn.Module):
    return getattr(model, "config", None)


def tp_plan(model: nn.Module) -> dict | None:
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        base = getattr(_config(model), "base_model_tp_plan", None) or {}
        prefix = "" if getattr(model, "base_model", model) is model else f"{model.base_model_prefix}."
        plan = {f"{prefix}{k}": v for k, v in base.items()}
    if getattr(_config(model), "tie_word_embeddings", False):
        plan = {k: v for k, v in plan.items() if k not in ("lm_head", "model.embed_tokens", "embed_tokens")}
    return plan or None


def check_tp(model: nn.Module, tp: int) -> None:
    cfg = _config(model)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value % tp:
            raise ValueError(f"tensor_parallel_degree {tp} must divide the model's {key} = {value} "
                             f"({type(cfg).__name__}); choose a degree that divides {value}")


def _blocks(model: nn.Module) -> list[nn.Module]:
    return blocks_by_class(model, list(getattr(model, "_no_split_modules", None) or ()))


def stage_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One pipeline stage of a decoder-only causal LM: token ids (first stage) or hidden states in; hidden
    states, or logits on the last stage, out."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    base = model.model
    h = base.embed_tokens(x) if base.embed_tokens is not None else x
    position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    masks: dict = {}
    kinds = getattr(model.config, "layer_types", None)
    sliding = getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True)
    position_embeddings = base.rotary_emb(h, position_ids=position_ids)
    for index, layer in base.layers.items():
        kind = kinds[int(index)] if kinds else ("sliding_attention" if sliding else "full_attention")
        kind = kind if kind in makers else "full_attention"
        if kind not in masks:
            masks[kind] = makers[kind](config=model.config, inputs_embeds=h, attention_mask=None,
                                       past_key_values=None, position_ids=position_ids)
        h = layer(h, attention_mask=masks[kind], position_embeddings=position_embeddings, position_ids=position_ids)
    if base.norm is not None:
        h = base.norm(h)
    return model.lm_head(h) if model.lm_head is not None else h


def _decoder_only(model: nn.Module) -> bool:
    base = getattr(model, "model", None)
    return all(hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")) and \
        isinstance(getattr(model, "lm_head", None), nn.Linear)


def spec_for(model: nn.Module) -> ModelSpec | None:
    # an HF model means transformers is loaded already: never import it (~1 s per rank) to find out
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    stages = None
    if _decoder_only(model) and not getattr(model.config, "tie_word_embeddings", False):
        stages = StageSplit(blocks="model.layers", first=("model.embed_tokens",), last=("model.norm", "lm_head"),
                            forward=stage_forward)
    return ModelSpec(name=f"hf:{model.__class__.__name__}", blocks=_blocks, tp_plan=tp_plan, check_tp=check_tp,
                     stages=stages, init_module=lambda m: m._init_weights)
