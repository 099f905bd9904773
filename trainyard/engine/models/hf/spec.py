"""Hugging Face models as a registered spec (transformers is an optional extra: `trainyard[hf]`).

- Blocks: the modules of the classes named in `_no_split_modules` (`LlamaDecoderLayer`, ...).
- TP plan: the model's own `_tp_plan` (its `base_model_tp_plan` under `model.` plus the head's entries), with
  the styles transformers 5 emits mapped in `distributed/tp.py`; a style it does not map (MoE experts' packed
  ones) refuses tensor parallelism, naming this plan. With tied embeddings the embedding and the head are
  left out of the plan (one weight cannot be split two ways). Heads, widths and vocabulary are checked
  against the degree.
- Pipeline (decoder-only causal LMs with `model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`, untied):
  every stage runs the model's own forward. Blocks of other stages are `OtherStage` placeholders in the
  model's own layer list (per-layer settings such as Gemma's sliding/full attention keep their index); a
  later stage feeds what it receives in as `inputs_embeds`, and the placeholders before its blocks hand that
  on unchanged (an embedding scale is applied once, by the first stage); stages other than the last have an
  identity final norm and return the base model's hidden states; the last stage runs the causal LM's own
  forward, final-logit soft-capping and scaling included. When the pipeline is built, a 3-stage run of a
  small model of the same class is compared with that model's forward (`verify_stages`), and a difference
  refuses the layout, naming the class.
- Meta-device init: the model's `_init_weights`, module by module (`distributed.materialize`).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from trainyard.engine.distributed.pipeline import cut_stage
from trainyard.engine.models.generic import blocks_by_class
from trainyard.engine.models.hf.cp import apply_cp
from trainyard.engine.models.hf.families import unverified_note
from trainyard.engine.models.hf.moe import EXPERT_COUNTS, apply_moe, experts_modules
from trainyard.parallel.layout import TP_WITH_HF_EXPERTS
from trainyard.engine.models.hf.selfcheck import once_per_rank0, small_config
from trainyard.engine.protocols import ModelSpec, StageSplit

# A stage split of the small verification model agrees with its forward to float32 rounding (~1e-7).
STAGE_TOLERANCE = 1e-5


def _config(model: nn.Module):
    return getattr(model, "config", None)


def tp_plan(model: nn.Module) -> dict | None:
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        base = getattr(_config(model), "base_model_tp_plan", None) or {}
        prefix = "" if getattr(model, "base_model", model) is model else f"{model.base_model_prefix}."
        plan = {f"{prefix}{k}": v for k, v in base.items()}
    if getattr(_config(model), "tie_word_embeddings", False):  # the tied embedding and head stay whole
        ends = (model.get_input_embeddings(), model.get_output_embeddings())
        tied = {n for n, m in model.named_modules() if any(m is e for e in ends if e is not None)}
        plan = {k: v for k, v in plan.items() if k not in tied}
    return plan or None


def check_tp(model: nn.Module, tp: int) -> None:
    cfg = _config(model)
    experts = next((getattr(cfg, k) for k in EXPERT_COUNTS if isinstance(getattr(cfg, k, None), int)), 0)
    if experts or experts_modules(model):
        raise ValueError(TP_WITH_HF_EXPERTS.format(tp=tp, model=type(model).__name__, n=experts or "packed"))
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value % tp:
            raise ValueError(f"tensor_parallel_degree {tp} must divide the model's {key} = {value} "
                             f"({type(cfg).__name__}); choose a degree that divides {value}")


def _blocks(model: nn.Module) -> list[nn.Module]:
    return blocks_by_class(model, list(getattr(model, "_no_split_modules", None) or ()))


def _stage_forward(base: str, embed: str, head: str):
    def stage_forward(part: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One pipeline stage through the model's own forward: token ids (first stage) or hidden states in; the
        base model's hidden states out, or the causal LM's logits on the last stage."""
        model = getattr(part, base)
        if getattr(model, embed) is not None:
            inputs = {"input_ids": x}
        else:
            part.trainyard_stage_input.value = x  # what the placeholders before this stage's blocks return
            inputs = {"inputs_embeds": x}
        if getattr(part, head) is not None:
            return type(part).forward(part, use_cache=False, **inputs).logits
        return model(use_cache=False, **inputs).last_hidden_state

    return stage_forward


_FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


def stage_split(model: nn.Module) -> tuple[StageSplit | None, str | None]:
    """How the model's own forward is cut into stages, or why it cannot be: (split, None) or (None, why)."""
    name = type(model).__name__
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(base, nn.Module) or not isinstance(head, nn.Linear):
        return None, f"{name} is not a base model with an nn.Linear LM head"
    children = dict(base.named_children())
    embed = next((n for n, c in children.items() if c is base.get_input_embeddings()), None)
    blocks = {id(b) for b in _blocks(model)}
    layers = next((n for n, c in children.items() if isinstance(c, nn.ModuleList) and len(c) and
                   all(id(b) in blocks for b in c)), None)
    norm = next((n for n in _FINAL_NORMS if n in children), None)
    if None in (embed, layers, norm):
        return None, f"{name}'s base model has no input embedding, list of decoder layers and final norm to cut"
    extra = [n for n, c in children.items() if n not in (embed, layers, norm) and any(True for _ in c.parameters())]
    if extra:
        return None, f"{name}'s forward uses {', '.join(extra)} beside its layers, which would sit on every stage"
    if getattr(model.config, "tie_word_embeddings", False):
        return None, (f"{name} ties its input embedding and LM head (tie_word_embeddings), which would sit on the "
                      "first and the last stage; build it with tie_word_embeddings=False to pipeline it")
    head_name = next(n for n, c in model.named_children() if c is head)
    return StageSplit(blocks=f"{prefix}.{layers}", first=(f"{prefix}.{embed}",), last=(f"{prefix}.{norm}", head_name),
                      identity=(f"{prefix}.{norm}",), placeholders=True,
                      forward=_stage_forward(prefix, embed, head_name), verify=verify_stages), None


# ---- the pipeline's self-check ----------------------------------------------------------------------------

def _stage_difference(model: nn.Module) -> str | None:
    """Why the stages of `model`'s class are not exact, from a small model of the class on this process; None
    when a 3-stage split run of it equals its own forward."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            small = type(model)(small_config(model.config)).eval()
            tokens = torch.randint(0, small.config.vocab_size, (2, 8))
            with torch.no_grad():
                want = small(tokens, use_cache=False).logits
                split, why = stage_split(small)
                if split is None:
                    return why
                h = tokens
                for stage in range(3):
                    h = cut_stage(small, split, stage, 3, [2, 1, 1])(h)
    except Exception as e:  # any failure of a model we did not write means: not verified
        return f"a 3-stage run of a small {type(model).__name__} failed: {type(e).__name__}: {e}"
    err = ((h - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not err <= STAGE_TOLERANCE:
        return f"a 3-stage run of a small {type(model).__name__} differs from its own forward by {err:.2e} (relative)"
    return None


def verify_stages(model: nn.Module) -> None:
    """ValueError naming the class when its stages are not exact (checked once per class, on the first rank,
    whose verdict every rank takes)."""
    why = once_per_rank0(("stages", type(model)), lambda: _stage_difference(model))
    if why is not None:
        raise ValueError(f"pipeline parallelism is refused for {type(model).__name__}: {why}; use tensor or MiCS "
                         "sharding for this model")


def spec_for(model: nn.Module) -> ModelSpec | None:
    # an HF model means transformers is loaded already: never import it (~1 s per rank) to find out
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    name = type(model).__name__
    stages, no_stages = stage_split(model)
    return ModelSpec(name=f"hf:{name}", blocks=_blocks, tp_plan=tp_plan, check_tp=check_tp,
                     tp_plan_source=f"{name}._tp_plan (transformers {transformers.__version__})",
                     stages=stages, no_stages=no_stages, apply_cp=apply_cp, apply_moe=apply_moe, init_module=lambda m: m._init_weights,
                     note=unverified_note(model, transformers.__version__))
