"""Expert parallelism for Hugging Face mixtures of experts: transformers 5's packed experts modules (Mixtral's,
Qwen2-MoE's, Qwen3-MoE's: `gate_up_proj` (experts, 2 x hidden, dim), `down_proj` (experts, dim, hidden), an
`act_fn`, called as `experts(hidden_states, top_k_index, top_k_weights)` by the model's own sparse MoE block).

`apply_moe(model, dims, balance_group, layout)` under expert parallelism (`layout()`: the `ExpertLayout`) spreads each such module's experts over the ep
group (DTensor `Shard(0)`, as the built-in model's: distributed/experts.py) and gives the module a forward that
sends every assignment to its expert's rank and back (`dispatch`), then weighs and sums the results as the
module's own forward does. The router, the shared experts and everything else stay the model's own code.

Whether a class qualifies is checked, not assumed (once per class and configuration, on the first rank): a small
model of it (`small_config`) runs once with its own experts forward and once with this one computing every expert
locally, and the logits must agree to 1e-5; a class whose experts differ (transposed or interleaved weights,
biases, no gate) or whose module is not found is refused by name.

The router's load-balancing loss (`output_router_logits=True`: the model's `aux_loss`, which its own `labels=` loss
adds times `router_aux_loss_coef`) is Switch Transformer's over every layer's rows, E x sum_e f_e P_e. A rank
sees only its own tokens, and the loss is not linear in them: the mean of the ranks' own losses is not the loss
of their tokens together. So while a transformed model runs its forward, its family's `load_balancing_loss_func`
counts the assignments f and the rows over the balance group (the ranks whose tokens make the micro-batch) and
keeps P its rank's, over the group's mean rows (`switch_loss`): the ranks' mean, and the mean of their gradients
(what data parallelism averages), are then exactly one process's on the whole micro-batch. The family's own
function must equal `switch_loss` on one process (checked once per class), or `output_router_logits` is
refused by name; so is it under pipeline parallelism, whose stages do not run the forward that computes it.
"""
from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist
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


# -- the load-balancing loss over the micro-batch's global tokens -------------------------------------------------

AUX_TOLERANCE = 1e-6
_ACTIVE: list = [None]  # the balance group while a transformed model runs its forward (None: the family's own)


def switch_loss(gate_logits, num_experts: int, top_k: int, attention_mask: torch.Tensor | None = None,
                group: dist.ProcessGroup | None = None):
    """Switch Transformer's load-balancing loss over every layer's rows, as transformers' mixtures of experts
    compute it (`load_balancing_loss_func`: softmax, the top_k choice, padding rows weighted 0 by
    `attention_mask`), with the assignments per expert C and the rows N counted over `group`:
    E x sum_e (C_e / N) x (S_e / (N / R)), S_e this rank's sum of the router's probabilities of e and R the
    group's size. Without a group (or one of 1) it is the family's own loss."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    # every layer's rows are the same tokens: one weight per row (0 for padding), and its top_k assignments'
    mask = torch.ones(gate_logits[0].shape[0], dtype=torch.float32, device=device) if attention_mask is None else \
        attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    per_assignment = mask.repeat_interleave(top_k)
    for layer in gate_logits:
        weights = F.softmax(layer.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), per_assignment)
        probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + mask.sum()
    share = 1
    if group is not None and dist.get_world_size(group) > 1:
        both = torch.cat([counts.detach(), rows.detach().reshape(1)])
        dist.all_reduce(both, group=group)
        counts, rows, share = both[:-1], both[-1], dist.get_world_size(group)
    return (counts / rows * probs / (rows / share)).sum() * num_experts


def _counted_over_the_group(original):
    """The family's `load_balancing_loss_func`, counted over the balance group while a transformed model runs."""
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if _ACTIVE[0] is None:
            return original(gate_logits, num_experts, top_k, attention_mask)
        return switch_loss(gate_logits, num_experts, top_k, attention_mask, _ACTIVE[0])

    load_balancing_loss_func.trainyard_original = original
    return load_balancing_loss_func


def _aux_difference(original) -> str | None:
    """Why the family's load-balancing loss is not `switch_loss` (on random router logits, with and without a
    padding mask); None when they agree."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        logits = tuple(torch.randn(12, 4) for _ in range(2))
        mask = (torch.rand(3, 4) > 0.3).long()
    try:
        for m in (None, mask):
            want, got = original(logits, 4, 2, m), switch_loss(logits, 4, 2, m)
            err = abs(float(got) - float(want)) / max(abs(float(want)), 1e-30)
            if not err <= AUX_TOLERANCE:
                return f"its load_balancing_loss_func differs from Switch Transformer's loss by {err:.2e} (relative)"
    except Exception as e:  # any failure of a function we did not write means: not verified
        return f"its load_balancing_loss_func failed on router logits: {type(e).__name__}: {e}"
    return None


def _global_aux(model: nn.Module, dims, group) -> None:
    """With `output_router_logits`, the model's load-balancing loss counted over `group` (see the module's
    docstring); ValueError naming the class and the field where that cannot be exact."""
    name = type(model).__name__
    if dims is not None and dims.pp > 1:
        raise ValueError(f"output_router_logits with pipeline_parallel_degree {dims.pp}: {name}'s load-balancing loss "
                         "is computed by its own forward, which no pipeline stage runs; set output_router_logits=False "
                         "in the model's config or pipeline_parallel_degree to 1")
    if group is None:
        return  # one process: the family's own loss is the whole micro-batch's
    module = sys.modules.get(type(model).__module__)
    found = getattr(module, "load_balancing_loss_func", None)
    original = getattr(found, "trainyard_original", found)
    why = f"{type(model).__module__} has no load_balancing_loss_func" if original is None else \
        once_per_rank0(("aux", original), lambda: _aux_difference(original))
    if why is not None:
        raise ValueError(f"output_router_logits: the engine cannot count {name}'s load-balancing loss over the ranks' "
                         f"tokens ({why}), and each rank's own would differ from one process's; set "
                         "output_router_logits=False in the model's config, or train on one process")
    if found is original:
        module.load_balancing_loss_func = _counted_over_the_group(original)
    model.register_forward_pre_hook(lambda _m, _a: _ACTIVE.__setitem__(0, group))
    model.register_forward_hook(lambda _m, _a, _o: _ACTIVE.__setitem__(0, None), always_call=True)


def apply_moe(model: nn.Module, dims, balance_group, layout) -> int:
    """Spread the experts of `model` over `layout`'s ep group (nothing without a layout: the model's own forward
    runs), and count its load-balancing loss over `balance_group` when it has one (`_global_aux`). Returns the
    number of experts modules; ValueError naming the class when it does not qualify."""
    modules = experts_modules(model)
    cfg = model.config
    if getattr(cfg, "output_router_logits", False):
        _global_aux(model, dims, balance_group)
    layout = layout() if dims.ep > 1 else None
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
