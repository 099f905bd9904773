"""Expert parallelism for Hugging Face mixtures of experts: transformers 5's packed experts modules (Mixtral's,
Qwen2-MoE's, Qwen3-MoE's: `gate_up_proj` (experts, 2 x hidden, dim), `down_proj` (experts, dim, hidden), an
`act_fn`, called as `experts(hidden_states, top_k_index, top_k_weights)` by the model's own sparse MoE block).

`apply_moe(model, dims, balance_group, layout)` with an `ExpertLayout` spreads each such module's experts over the ep
group (DTensor `Shard(0)`, as the built-in model's: distributed/experts.py) and gives the module a forward that
sends every assignment to its expert's rank and back (`dispatch`), then weighs and sums the results as the
module's own forward does. The router, the shared experts and everything else stay the model's own code.

Whether a class qualifies is checked, not assumed (once per class and configuration, on the first rank): a small
model of it (`small_config`) runs once with its own experts forward and once with this one computing every expert
locally, and the logits must agree to 1e-5; a class whose experts differ (transposed or interleaved weights,
biases, no gate) or whose module is not found is refused by name. The router's load-balancing loss of these
families (`output_router_logits`, `router_aux_loss_coef`) is the model's own and counts its rank's tokens only:
a run that adds it to the loss differs from one process's by that term.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from trainyard.engine.distributed.experts import ExpertGroup, dispatch, local_part, shard_experts
from trainyard.engine.models.hf.selfcheck import once_per_rank0, small_config

TOLERANCE = 1e-5
WEIGHTS = ("gate_up_proj", "down_proj")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")  # config keys of a mixture of experts


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The packed experts modules of `model` (3-D gate_up_proj and down_proj, experts on dim 0)."""
    found = []
    for m in model.modules():
        params = dict(m.named_parameters(recurse=False))
        if all(n in params and params[n].dim() == 3 for n in WEIGHTS) and hasattr(m, "act_fn") and \
                params["gate_up_proj"].shape[0] == params["down_proj"].shape[0]:
            found.append(m)
    return found


def _compute(module: nn.Module, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each (local) expert's SwiGLU-style MLP on its rows: gate and up from gate_up_proj, act_fn(gate) x up, down."""
    gate_up, down = (local_part(getattr(module, n)).to(x.dtype) for n in WEIGHTS)
    outs = []
    for e, part in enumerate(x.split(counts)):
        gate, up = F.linear(part, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(module.act_fn(gate) * up, down[e]))
    return torch.cat(outs)


def ep_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward with its experts where `module.trainyard_ep` says (None: all of them here)."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    n_experts = module.gate_up_proj.shape[0]
    counts = torch.bincount(flat, minlength=n_experts)
    order = torch.argsort(flat, stable=True)  # assignments by expert, in token order within each
    rows = hidden_states[order // k]
    ep: ExpertGroup | None = module.trainyard_ep
    if ep is None:
        y = _compute(module, rows, counts.tolist())
    else:
        y = dispatch(rows, counts, ep, lambda x, c: _compute(module, x, c))
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    return torch.zeros_like(hidden_states).index_add(0, order // k, y.to(hidden_states.dtype))


def _difference(model: nn.Module) -> str | None:
    """Why this forward is not the class's own on a small model of it; None when the logits agree."""
    name = type(model).__name__
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            small = type(model)(small_config(model.config)).eval()
            modules = experts_modules(small)
            if not modules:
                return f"{name} has no packed experts module (gate_up_proj and down_proj with experts on dim 0)"
            tokens = torch.randint(0, small.config.vocab_size, (2, 8))
            with torch.no_grad():
                want = small(tokens, use_cache=False).logits
                for m in modules:
                    m.trainyard_ep = None
                    m.forward = types.MethodType(ep_forward, m)
                got = small(tokens, use_cache=False).logits
    except Exception as e:  # any failure of a model we did not write means: not verified
        return f"a small {name} with Trainyard's experts forward failed: {type(e).__name__}: {e}"
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not err <= TOLERANCE:
        return (f"a small {name} with Trainyard's experts forward differs from its own by {err:.2e} (relative): its "
                "experts are not packed as gate_up_proj / down_proj SwiGLUs")
    return None


def apply_moe(model: nn.Module, dims, balance_group, layout) -> int:
    """Spread the experts of `model` over `layout`'s ep group (nothing without a layout: the model's own forward
    runs). Returns the number of experts modules; ValueError naming the class when it does not qualify."""
    modules = experts_modules(model)
    cfg = model.config
    if layout is not None and not modules and any(getattr(cfg, k, None) for k in EXPERT_COUNTS):
        raise ValueError(f"expert_parallel_degree {layout.ep}: the engine cannot spread the experts of "
                         f"{type(model).__name__}: they are not packed as gate_up_proj / down_proj SwiGLUs with the "
                         "experts on dim 0 (Mixtral's, Qwen2-MoE's, Qwen3-MoE's, OLMoE's); set "
                         "expert_parallel_degree to 1")
    if layout is None or not modules:
        return len(modules)
    key = ("moe", type(model), cfg.to_json_string(use_diff=False) if hasattr(cfg, "to_json_string") else repr(cfg))
    why = once_per_rank0(key, lambda: _difference(model))
    if why is not None:
        raise ValueError(f"expert_parallel_degree {layout.ep}: the engine cannot spread the experts of "
                         f"{type(model).__name__}: {why}; set expert_parallel_degree to 1")
    for m in modules:
        shard_experts(m, WEIGHTS, layout)
        m.trainyard_ep = ExpertGroup(group=layout.ep_group, size=layout.ep, rank=layout.ep_rank)
        m.forward = types.MethodType(ep_forward, m)
    return len(modules)
