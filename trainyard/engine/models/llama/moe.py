"""The built-in model's mixture of experts (`ModelConfig.n_experts > 0`): the MLP of every block becomes a router
over `n_experts` SwiGLU experts, each token going through its `top_k` (and through `n_shared_experts` shared
ones); expert parallelism (`apply_moe` with a layout) spreads the experts over ranks and moves the tokens with
all-to-all (engine/distributed/experts.py).

Routing, per token: softmax over the router's logits (in float32); the top_k experts by score (plus the
per-expert bias of auxiliary-loss-free balancing, for the choice only); gate weights the softmax scores of the
chosen experts, renormalised to sum to 1 (`norm_topk`). The output is the gate-weighted sum of the chosen
experts' outputs, plus the shared experts'.

- Dropless (`capacity_factor` None): every assignment is computed. Capacity-limited: each expert takes at most
  ceil(capacity_factor x tokens x top_k / n_experts) of a rank's assignments per micro-batch, first come (token
  order); the others are dropped (that expert adds nothing for that token) and counted.
- Load-balancing loss (Switch Transformer): aux_loss_coef x n_experts x sum_e f_e P_e, f_e the fraction of the
  assignments routed to expert e and P_e the mean router probability of e. f is counted over the micro-batch's
  global tokens (an all-reduce of the counts over the ranks that split the batch, `balance_group`), P over the
  rank's own: the ranks' mean is then exactly the loss of the global micro-batch, whatever the layout. It joins
  the gradient through the block's output (`_AddAux`), weighted like the micro-batch's loss (the engine sets
  1 / micro-batches x the fp16 loss scale around each forward: distributed/experts.py's `aux_weight`).
- Auxiliary-loss-free balancing (DeepSeek-V3): after each step `balance(model)` moves each expert's bias by
  bias_update_rate towards the mean load (up when the expert got fewer assignments than the mean).
- Router statistics (`router_stats(model)`): the assignments per expert over the blocks, the dropped ones and the
  mean auxiliary loss since the last read, for the job's metrics.

Experts are computed by `torch._grouped_mm` on CUDA in bfloat16 (one grouped GEMM per projection), else by a
loop over the experts; tests check the two against each other on the CPU.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainyard.engine.distributed.experts import ExpertGroup, aux_loss_weight, dispatch, local_part, shard_experts


class _AddAux(torch.autograd.Function):
    """Returns `out` unchanged; its backward also sends `aux_loss_weight()` as the gradient of the scalar `aux`, so
    the auxiliary loss is minimised with the model's loss without the loss function knowing of it."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.weight = aux_loss_weight()
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device)


USE_GROUPED_MM: bool | None = None  # None: on CUDA in bfloat16; True/False forces it (tests)


class Experts(nn.Module):
    """`n` SwiGLU experts, packed: w1 and w3 (n, hidden, dim), w2 (n, dim, hidden). Under expert parallelism a
    rank holds a slice of them along dim 0 (DTensor Shard(0) over the ep group)."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: tokens grouped by (local) expert, `counts[e]` of them for expert e."""
        w1, w2, w3 = (local_part(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))  # MiCS leaves them unsharded
        grouped = USE_GROUPED_MM if USE_GROUPED_MM is not None else (x.is_cuda and x.dtype == torch.bfloat16)
        if grouped:
            offs = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * \
                torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        # empty groups still join the graph: every expert's weights get a (zero) gradient on every rank
        outs = [(F.silu(part @ w1[e].t()) * (part @ w3[e].t())) @ w2[e].t()
                for e, part in enumerate(x.split(counts))]
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, cfg, shared: nn.Module | None = None) -> None:
        """`shared`: the shared experts as one MLP of their summed width (model.py's SwiGLU FeedForward), or None."""
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor, self.aux_loss_coef = cfg.capacity_factor, cfg.aux_loss_coef
        self.norm_topk, self.bias_update_rate = cfg.norm_topk, cfg.bias_update_rate
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.moe_hidden)
        self.shared = shared
        # auxiliary-loss-free balancing's bias: state (checkpointed), moved by balance() only
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.ep: ExpertGroup | None = None  # expert parallelism (apply_moe)
        # tensor parallelism: the rank routes its sequence-parallel shard, one of `token_shards` of the rows (the
        # router's gradient is summed over them: each shard's load-balancing term weighs 1 / token_shards)
        self.token_shards = 1
        self.balance_group: dist.ProcessGroup | None = None  # the ranks whose tokens make a micro-batch
        # the statistics stay on the device the forward runs on (read by router_stats and balance, not per layer)
        self.step_load: torch.Tensor | None = None  # global assignments per expert since the last balance()
        self._reset_stats()

    def _reset_stats(self) -> None:
        self.load: torch.Tensor | None = None  # global assignments per expert since the last router_stats()
        self.dropped: torch.Tensor | int = 0  # this rank's dropped assignments
        self.aux_sum: torch.Tensor | float = 0.0
        self.aux_count = 0

    def _route(self, t: torch.Tensor):
        probs = self.router(t).float().softmax(-1)
        with torch.no_grad():
            choice = probs + self.expert_bias.float() if self.bias_update_rate else probs
            idx = choice.topk(self.top_k, dim=-1).indices  # (tokens, top_k)
        gates = probs.gather(-1, idx)
        if self.norm_topk:
            gates = gates / gates.sum(-1, keepdim=True)
        return probs, idx, gates

    def _global_counts(self, counts: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The assignments per expert and the tokens over the balance group (one all-reduce, no host sync)."""
        both = torch.cat([counts.double(), counts.new_tensor([tokens], dtype=torch.float64)])
        if self.balance_group is not None and dist.get_world_size(self.balance_group) > 1:
            dist.all_reduce(both, group=self.balance_group)
        return both[:-1], both[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        probs, idx, gates = self._route(t)
        flat = idx.flatten()  # assignment a = token a // top_k, its (a % top_k)-th choice
        counts = torch.bincount(flat, minlength=self.n_experts)
        order = torch.argsort(flat, stable=True)  # the assignments by expert, in token order within each
        dropped: torch.Tensor | int = 0
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * t.shape[0] * self.top_k / self.n_experts)
            starts = torch.cumsum(counts, 0) - counts
            position = torch.arange(order.numel(), device=t.device) - starts[flat[order]]
            kept = position < capacity
            dropped = (~kept).sum()
            order, routed = order[kept], counts.clamp(max=capacity)
        else:
            routed = counts
        global_counts, global_tokens = self._global_counts(counts.detach(), t.shape[0])
        y = self._experts(t[order // self.top_k], routed)
        weighted = y * gates.flatten()[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(t).index_add(0, order // self.top_k, weighted.to(t.dtype))
        if self.shared is not None:
            out = out + self.shared(t)
        aux = None
        if self.aux_loss_coef:
            f = (global_counts / (global_tokens * self.top_k)).to(probs.dtype)
            aux = self.aux_loss_coef * self.n_experts * (f * probs.mean(0)).sum()
            out = _AddAux.apply(out, aux / self.token_shards if self.token_shards > 1 else aux)
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # not a recompute in backward
            self.load = global_counts if self.load is None else self.load + global_counts
            self.step_load = global_counts if self.step_load is None else self.step_load + global_counts
            self.dropped = self.dropped + dropped
            if aux is not None:
                self.aux_sum = self.aux_sum + aux.detach()
                self.aux_count += 1
        return out.reshape(shape)

    def _experts(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The chosen experts' outputs for `tokens` (grouped by expert, `counts` per global expert), computed
        where the experts are: here, or on the ranks of the ep group (distributed/experts.py's `dispatch`)."""
        if self.ep is None:
            return self.experts(tokens, counts.tolist())
        return dispatch(tokens, counts, self.ep, self.experts)


def apply_moe(model: nn.Module, dims, balance_group: dist.ProcessGroup | None, layout) -> int:
    """Set every MoE layer's balance group and its token shards (the tp degree: `tp_plan.py` hands it the rank's
    sequence shard); under expert or tensor parallelism, put its experts in the `ExpertLayout` that `layout()`
    makes (engine/distributed/experts.py): spread over the ep group, or held whole outside MiCS with ep 1 (the
    tensor-parallel ranks' gradients of them are summed there). Returns the number of MoE layers."""
    layers = moe_layers(model)
    # alike on every rank (a collective): by the config, which every stage has, not by the layers a stage holds
    spread = layout() if model.config.n_experts and (dims.ep > 1 or dims.tp > 1) else None
    for m in layers:
        m.balance_group = balance_group
        m.token_shards = dims.tp
        if spread is not None:
            shard_experts(m.experts, ("w1", "w2", "w3"), spread)
            if spread.ep > 1:
                m.ep = ExpertGroup(group=spread.ep_group, size=spread.ep, rank=spread.ep_rank)
    return len(layers)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def router_stats(model: nn.Module) -> dict | None:
    """The router's figures since the last call, summed over the blocks (the same on every rank); None for a dense
    model. `expert_load`: each expert's share of the assignments; `expert_imbalance`: the busiest expert's load
    over the mean; `dropped_assignments` (this rank's); `aux_loss`: the mean auxiliary loss of a block."""
    layers = moe_layers(model)
    if not layers:
        return None
    load = sum((m.load.cpu() for m in layers if m.load is not None),
               torch.zeros(layers[0].n_experts, dtype=torch.float64))
    total = float(load.sum())
    stats = {"expert_load": [round(float(v) / total, 4) for v in load] if total else [0.0] * len(load),
             "expert_imbalance": round(float(load.max()) / (total / len(load)), 4) if total else 0.0,
             "dropped_assignments": int(sum(int(m.dropped) for m in layers))}
    counted = sum(m.aux_count for m in layers)
    if counted:
        stats["aux_loss"] = sum(float(m.aux_sum) for m in layers) / counted
    for m in layers:
        m._reset_stats()
    return stats


@torch.no_grad()
def balance(model: nn.Module) -> None:
    """Auxiliary-loss-free balancing after a step: each expert's bias moves by bias_update_rate towards the mean
    load of its block (up when it had fewer assignments than the mean), from the step's global counts."""
    for m in moe_layers(model):
        if m.step_load is None:
            continue
        if m.bias_update_rate:  # no step moves a bias when no assignment was counted (every load equals the mean)
            step = torch.sign(m.step_load.mean() - m.step_load).to(m.expert_bias.dtype).to(m.expert_bias.device)
            m.expert_bias += m.bias_update_rate * step
        m.step_load.zero_()
