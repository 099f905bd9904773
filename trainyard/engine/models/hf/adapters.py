"""PEFT LoRA adapters over a Hugging Face causal LM (`peft.get_peft_model`; the HF PEFT library is the `peft`
extra) as a registered spec: the spec of the model underneath, with its TP plan carried onto the LoRA layers.

- Blocks, the tensor-parallel checks and the note are the base model's.
- Tensor parallelism: where the base model's plan splits a linear layer that LoRA wraps, the wrapped `base_layer`
  is split as planned and the adapter with it. A column-wise layer gets `lora_B` column-wise too (each rank adds
  its columns of B A x; A stays whole, its input gradient summed by the style over the ranks); a row-wise layer
  gets `lora_A` row-wise (A's rows of the rank's input slice, summed over the ranks) and `lora_B` stays whole.
  The whole A or B then sees the same input and gradient on every rank, so its gradient needs no reduction; which
  is why `lora_dropout` > 0 is refused under tensor parallelism (each rank would drop other inputs of A).
  Other styles on a wrapped layer are refused by name, as are adapter types other than LoRA, DoRA, and modules
  the PEFT model trains whole copies of (`modules_to_save`) under tensor parallelism.
- Meta-device builds: the base model's modules are initialised by its `_init_weights`, the adapters as PEFT's
  `init_lora_weights=True` does (A as nn.Linear's default, kaiming-uniform with a = sqrt(5); B zero: the adapted
  model starts as the base), module by module as every meta build is; then `load_pretrained` fills the base.
  Other `init_lora_weights` on a meta build are refused by name.
- Pipeline parallelism: the base model's stage split (models/hf/spec.py) under the PEFT model's prefix, each stage
  running the base model's own stage forward, into which a PEFT model's forward hands a LoRA model's inputs
  unchanged. The base model's refusals (tied embeddings, a class whose split is not exact) are the PEFT model's.
  Before the cut, a copy of the whole PEFT model on the meta device is left on the model (and so on each stage):
  the exports (adapter folder, merged weights) find every LoRA layer in it, where a stage holds only its own.
- No context parallelism (refused by name), no experts.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import tempfile

import torch
from torch import nn

from trainyard.engine.distributed.tp import _matches
from trainyard.engine.models.hf import spec as hf_spec
from trainyard.engine.components.checkpoint import filesystem
from trainyard.engine.models.hf.weights import _check_uri, _is_local, _put
from trainyard.engine.protocols import ModelSpec, StageSplit


def _peft():
    return sys.modules.get("peft")


def is_peft(model: nn.Module) -> bool:
    peft = _peft()  # a PEFT model means peft is loaded already: never import it to find out
    return peft is not None and isinstance(model, peft.PeftModel)


def inner_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model a PEFT model wraps."""
    return model.get_base_model()


def _prefix(model: nn.Module) -> str:
    """Where the Hugging Face model sits in the PEFT model (`base_model.model`)."""
    inner = inner_model(model)
    return next(n for n, m in model.named_modules() if m is inner)


def _check_adapters(model: nn.Module) -> None:
    for name, config in model.peft_config.items():
        kind = type(config).__name__
        if kind != "LoraConfig":
            raise ValueError(f"PEFT adapter {name!r} is a {kind}: the engine trains LoRA adapters (peft.LoraConfig) "
                             "only; use LoraConfig")
        if getattr(config, "use_dora", False):
            raise ValueError(f"PEFT adapter {name!r} sets use_dora=True: DoRA is not verified in the engine; set "
                             "use_dora=False")


def _check_wrapped_parameters(model: nn.Module) -> None:
    """peft's LoRA on bare parameters (`ParamWrapper`: a mixture of experts' router and packed experts, which peft
    >= 0.21 adapts under target_modules="all-linear") is not verified here: its parameters nest `base_layer` twice, and
    neither loading the base weights nor merging is exact for it."""
    wrapped = [n for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper"]
    if wrapped:
        raise ValueError(f"LoRA on {wrapped[0].rsplit('base_model.model.', 1)[-1]} (peft's ParamWrapper: LoRA on a "
                         "module's bare parameters, as peft adapts a mixture of experts' router and packed experts; "
                         f"{len(wrapped)} module(s)) is not verified in the engine; name the linear layers to adapt "
                         "instead of all-linear (e.g. q_proj,k_proj,v_proj,o_proj)")


def spec_for(model: nn.Module) -> ModelSpec | None:
    if not is_peft(model):
        return None
    _check_adapters(model)
    _check_wrapped_parameters(model)
    inner = inner_model(model)
    base = hf_spec.spec_for(inner)
    if base is None:
        raise ValueError(f"a PEFT model over {type(inner).__name__}: the engine takes PEFT adapters over Hugging Face "
                         "causal LMs (transformers.PreTrainedModel) only")
    prefix = _prefix(model)

    def tp_plan(root: nn.Module) -> dict | None:
        plan = base.tp_plan(inner_model(root))
        return None if plan is None else lora_plan(root, prefix, plan)

    def check_tp(root: nn.Module, tp: int) -> None:
        base.check_tp(inner_model(root), tp)
        dropping = sorted({n for n, c in root.peft_config.items() if getattr(c, "lora_dropout", 0)})
        if dropping:  # each rank would drop other inputs of a whole A: its copies would train apart
            raise ValueError(f"tensor_parallel_degree {tp} with lora_dropout > 0 (adapter {dropping[0]!r}): each "
                             "rank would drop other elements of the input a column-wise layer's whole A sees, and "
                             "A's copies would train apart; set lora_dropout=0 or tensor_parallel_degree to 1")
        saved = sorted({n for n, m in root.named_modules() if type(m).__name__ == "ModulesToSaveWrapper"})
        if saved:
            raise ValueError(f"tensor_parallel_degree {tp} with PEFT's modules_to_save ({', '.join(saved[:3])}): the "
                             "trained whole copies have no tensor-parallel plan here; drop modules_to_save or set "
                             "tensor_parallel_degree to 1")

    _mark_adapters(model)
    return ModelSpec(name=f"peft:{base.name}", blocks=lambda root: base.blocks(inner_model(root)), tp_plan=tp_plan,
                     tp_plan_source=f"{base.tp_plan_source}, carried onto its LoRA layers", check_tp=check_tp,
                     stages=None if base.stages is None else _stages(base.stages, prefix),
                     no_stages=_wrapped_head(inner) or base.no_stages,
                     note=base.note, init_module=lambda template: _initialiser(template, base))


def _wrapped_head(inner: nn.Module) -> str | None:
    """Why a pipeline cannot cut the model when PEFT wrapped its LM head (the base model's split wants the head an
    nn.Linear, and would say only that it is not one), else None."""
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None or isinstance(head, nn.Linear):
        return None
    how = "trains a whole copy of its LM head (modules_to_save)" if type(head).__name__ == "ModulesToSaveWrapper" \
        else "wraps its LM head in a LoRA layer" if isinstance(head, _peft().tuners.lora.LoraLayer) else None
    if how is None:
        return None
    return (f"the PEFT model {how}, and the pipeline's last stage takes the head as an nn.Linear; leave lm_head out "
            "of target_modules / lora_targets and modules_to_save to pipeline it")


def _stages(split: StageSplit, prefix: str) -> StageSplit:
    """The base model's stage split as the PEFT model's: its paths under `prefix`, and each stage running the base
    model's stage forward on the Hugging Face model inside the stage (module docstring)."""
    def under(paths: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(f"{prefix}.{p}" for p in paths)

    def forward(part: nn.Module, x):
        inner = inner_model(part)
        source = getattr(part, "trainyard_stage_input", None)  # what cut_stage gave the stage's root for the
        if source is not None:                                  # placeholders: the base forward reads it there
            inner.trainyard_stage_input = source
        return split.forward(inner, x)

    return dataclasses.replace(split, blocks=f"{prefix}.{split.blocks}", first=under(split.first),
                               last=under(split.last), identity=under(split.identity),
                               forward=forward if split.forward is not None else None,
                               verify=(lambda root: split.verify(inner_model(root))) if split.verify else None,
                               before_cut=keep_whole)


# which side of an adapter a module is, kept on the module itself: the meta build's initialiser gets copies
_SIDE = "_trainyard_lora_side"
# on each pipeline stage of a PEFT model: the whole model on the meta device (module docstring)
_WHOLE = "_trainyard_whole_model"


def _mark_adapters(model: nn.Module) -> None:
    lora_layer = _peft().tuners.lora.LoraLayer
    for module in model.modules():
        if isinstance(module, lora_layer):
            for side in ("lora_A", "lora_B"):
                for adapter in getattr(module, side).values():
                    setattr(adapter, _SIDE, side)


def keep_whole(model: nn.Module) -> None:
    """Before a PEFT model is cut into pipeline stages: a copy of it on the meta device (its weights not copied), kept
    on the model and so on every stage cut from it, unregistered (no parameters, checkpoints or hooks see it)."""
    memo: dict = {}
    for module in model.modules():
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if id(t) not in memo:
                empty = torch.empty_like(t, device="meta")
                memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    object.__setattr__(model, _WHOLE, None)  # not copied into itself
    whole = copy.deepcopy(model, memo)
    object.__setattr__(model, _WHOLE, whole)


def whole_model(model: nn.Module) -> nn.Module:
    """The whole PEFT model: `model`, or for a pipeline stage the meta copy `keep_whole` left on it. PEFT finds the
    adapters to save by visiting the model's LoRA layers, and a stage holds only its own."""
    whole = getattr(model, _WHOLE, None)
    return model if whole is None else whole


def _initialiser(template: nn.Module, base: ModelSpec):
    """The per-module initialiser of a meta-built PEFT model: LoRA's own for the adapters (module docstring), the
    base model's for the rest."""
    for name, config in template.peft_config.items():
        if config.init_lora_weights is not True:
            raise ValueError(f"PEFT adapter {name!r} has init_lora_weights={config.init_lora_weights!r} and the model "
                             "was built on the meta device, where the engine initialises adapters as "
                             "init_lora_weights=True does; use True, or build the model with weights")
    inner = base.init_module(inner_model(template)) if base.init_module else None

    def init(module: nn.Module) -> None:
        side = getattr(module, _SIDE, None)
        if side == "lora_A":
            nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        elif side == "lora_B":
            nn.init.zeros_(module.weight)
        elif inner is not None:
            inner(module)
        if side is not None and getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    return init


def lora_plan(root: nn.Module, prefix: str, plan: dict) -> dict:
    """`plan` (the base model's, its paths relative to it) as the PEFT model's: each module it matches named under
    `prefix`, and a LoRA layer's split carried onto its `base_layer` and its adapters (module docstring)."""
    lora_layer = _peft().tuners.lora.LoraLayer
    modules = dict(root.named_modules())
    out: dict = {}
    unsplit: dict[str, str] = {}  # a LoRA layer's module name -> the style the plan gives it, where not carried
    for pattern, style in plan.items():
        full = f"{prefix}.{pattern}"
        for name, module in modules.items():
            if not name or not _matches(full, name):
                continue
            if not isinstance(module, lora_layer):
                out[name] = style
                continue
            if style not in ("colwise", "rowwise"):
                unsplit[name.rsplit(".", 1)[-1]] = style
                continue
            out[f"{name}.base_layer"] = style
            side = "lora_B" if style == "colwise" else "lora_A"
            for adapter in module.lora_A:
                out[f"{name}.{side}.{adapter}"] = style
    if unsplit:
        raise ValueError(f"tensor parallelism: the plan splits the LoRA layers {', '.join(sorted(unsplit))} as "
                         f"{', '.join(sorted(set(unsplit.values())))}; the engine carries 'colwise' and 'rowwise' "
                         f"splits onto LoRA adapters only: leave {', '.join(sorted(unsplit))} out of the targets "
                         "(target_modules, lora_targets), or train with MiCS alone")
    return out


_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def is_adapter_name(name: str) -> bool:
    return any(part in name for part in _ADAPTER_PARTS)


def base_name(prefix: str, name: str) -> str:
    """A PEFT model's state-dict name as the base model's files name it (`base_model.model.X.base_layer.weight` ->
    `X.weight`; `prefix`: `_prefix(model)`)."""
    return name.removeprefix(f"{prefix}.").replace(".base_layer.", ".")


def base_tensors(model: nn.Module, tensors: dict) -> dict:
    """`tensors` (a PEFT model's, by state-dict name) without the adapters, by the base model's names: what the
    base model's safetensors hold."""
    prefix = _prefix(model)
    return {base_name(prefix, n): t for n, t in tensors.items() if not is_adapter_name(n)}


def merged_state(model: nn.Module, state: dict) -> dict:
    """The full state dict of a PEFT model (`state`, by its names) as the base model's with every LoRA adapter
    merged into the weight it wraps: W + scaling B A."""
    lora_layer = _peft().tuners.lora.LoraLayer
    prefix = _prefix(model)
    merged = {base_name(prefix, n): t.clone() for n, t in state.items() if not is_adapter_name(n)}
    for name, module in whole_model(model).named_modules():  # every LoRA layer, whichever stage holds it
        if type(module).__name__ == "ModulesToSaveWrapper":
            _merge_saved_copy(merged, base_name(prefix, name), module)
        if not isinstance(module, lora_layer):
            continue
        weight = base_name(prefix, f"{name}.base_layer.weight")
        for adapter in module.lora_A:
            a, b = state[f"{name}.lora_A.{adapter}.weight"], state[f"{name}.lora_B.{adapter}.weight"]
            delta = (b.float() @ a.float()) * module.scaling[adapter]
            if getattr(module, "fan_in_fan_out", False):
                delta = delta.T
            merged[weight] = (merged[weight].float() + delta).to(merged[weight].dtype)
    return merged


def _merge_saved_copy(merged: dict, name: str, wrapper: nn.Module) -> None:
    """A module PEFT trains a whole copy of (`modules_to_save`), in `merged` (by the base model's names) as the base
    model's module: the active adapter's copy under the module's own name, the frozen original and other copies
    dropped."""
    active = wrapper.active_adapters
    if len(active) != 1:
        raise ValueError(f"save_model(merged=True): {name} has {len(active)} active copies (modules_to_save) "
                         f"{active}; set one adapter active (model.set_adapter) before merging")
    copies, original = f"{name}.modules_to_save.", f"{name}.original_module."
    for key in [k for k in merged if k.startswith((copies, original))]:
        tensor = merged.pop(key)
        if key.startswith(f"{copies}{active[0]}."):
            merged[f"{name}.{key.removeprefix(f'{copies}{active[0]}.')}"] = tensor


def write_adapter(model: nn.Module, state: dict, out: str) -> list[str]:
    """The adapters of `state` (a PEFT model's full state dict) as PEFT writes them under `out` (a folder or an
    `s3://` prefix): adapter_config.json and adapter_model.safetensors, which `PeftModel.from_pretrained` loads
    (rank 0). Written by PEFT to a temporary folder, then each file whole as `write_pretrained` writes its own."""
    _check_uri(out)
    fs, root = filesystem(out)
    if _is_local(fs):
        os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory() as staging:
        # the whole state: PEFT selects what the adapter holds (the LoRA weights, and the biases `bias` trains)
        whole_model(model).save_pretrained(staging, state_dict=state, safe_serialization=True,
                                           save_embedding_layers=False)
        names = sorted(os.listdir(staging))
        for name in names:
            with open(os.path.join(staging, name), "rb") as f:
                _put(fs, root, name, f.read())
    return [f"{out.rstrip('/')}/{name}" for name in names]


def _check_targets(model: nn.Module, names: list[str]) -> None:
    """Every name in `names` is the last part of the name of some linear layer of `model` other than a head tied to
    its input embedding (peft matches names by their ends, and would pass over one that matches nothing)."""
    head = model.get_output_embeddings() if getattr(model.config, "tie_word_embeddings", False) else None
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    tied = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if head is not None and m is head}
    wrong = [n for n in names if n not in linear]
    if wrong:
        why = " (the head tied to the input embedding: adapting it would untie them)" if set(wrong) & tied else ""
        raise ValueError(f"lora_targets: {', '.join(wrong)} names no linear layer of {type(model).__name__}{why}; "
                         f"LoRA here wraps linear layers: choose among {', '.join(sorted(linear))}, or all-linear")


def wrap(model: nn.Module, *, r: int, alpha: float, targets: str, dropout: float) -> nn.Module:
    """`model` with LoRA adapters of rank `r` on `targets` (comma-separated module names, or "all-linear"), as
    `peft.get_peft_model` makes them (the `peft` extra)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("lora_r: LoRA adapters need the peft package: pip install 'trainyard[peft]'") from None
    names = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    if not names:
        raise ValueError("lora_targets is empty: name the linear layers to adapt (q_proj,v_proj) or all-linear")
    if names != "all-linear":
        _check_targets(model, names)
    try:
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=names,
                                                task_type="CAUSAL_LM"))
    except ValueError as e:  # peft's own message names the modules it found none of
        raise ValueError(f"lora_targets {targets!r}: {e}") from None
