"""Which spec a model gets: the built-in Llama-style `Transformer`, a Hugging Face causal LM (when
transformers is installed) or PEFT LoRA adapters over one, else the generic spec for any `nn.Module`; then the user's overrides."""
from __future__ import annotations

from torch import nn

from trainyard.engine.models import generic
from trainyard.engine.models.hf import adapters, spec as hf_spec
from trainyard.engine.models.llama import spec as llama_spec
from trainyard.engine.protocols import ModelSpec

FAMILIES = (llama_spec.spec_for, hf_spec.spec_for, adapters.spec_for)


def resolve_spec(model: nn.Module, *, blocks=None, tp_plan: dict | None = None) -> ModelSpec:
    """The spec of `model`, with the user's `blocks` (classes, names or a callable) and `tp_plan` applied."""
    spec = next((s for s in (f(model) for f in FAMILIES) if s is not None), None) or generic.spec_for(model)
    if blocks is not None:
        spec.blocks = generic.blocks_selector(blocks)
    if tp_plan is not None:
        plan = dict(tp_plan)
        spec.tp_plan, spec.apply_tp, spec.tp_plan_source = (lambda m: plan), None, "tp_plan"
    return spec
