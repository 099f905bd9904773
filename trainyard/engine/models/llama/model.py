"""A Llama-style decoder: RMSNorm, rotary position embedding, SwiGLU MLP, grouped-query attention.

The model code knows nothing about parallelism. It is built on the meta device (no memory), the
`apply_*` functions of the engine shard it block by block (`model.layers`), and only then are the
weights materialised and filled by `init_weights`, which gives the same values whatever the layout:
each parameter's full value comes from a generator seeded by (seed, parameter name), and a sharded
parameter keeps only its own piece of it.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from trainyard.engine.models.llama.moe import MoE
from trainyard.parallel.presets import MODEL_CONFIGS, ModelConfig  # noqa: F401 (re-exported)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 for stability under bfloat16 and cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_seq_len, head_dim // 2), in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of the last dimension; x is (batch, seq, heads, head_dim)."""
    seq = x.shape[1]
    cos = cos[:seq].view(1, seq, 1, -1)
    sin = sin[:seq].view(1, seq, 1, -1)
    xf = x.float().unflatten(-1, (-1, 2))
    even, odd = xf[..., 0], xf[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q and k rotated (trainyard/engine/models/fused.py puts trainyard.kernels.apply_rope here)."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 instead of the head counts keeps this valid when tensor parallelism splits the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = self.rope(q, k, cos, sin)
        return self.wo(self.attend(q, k, v).reshape(bsz, seq, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q (batch, seq, heads, head_dim) over k and v (batch, seq, kv_heads, head_dim), the
        output like q (context parallelism puts ring attention here: engine/models/llama/cp.py)."""
        # Each key/value head serves n_heads / n_kv_heads query heads.
        repeat = q.shape[2] // k.shape[2]
        if repeat > 1:
            k = k.repeat_interleave(repeat, dim=2)
            v = v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # a mixture of experts in place of the MLP when the config has experts (moe.py)
        if cfg.n_experts:
            shared = FeedForward(cfg.dim, cfg.moe_hidden * cfg.n_shared_experts) if cfg.n_shared_experts else None
            self.feed_forward = MoE(cfg, shared)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model; `forward(tokens[batch, seq]) -> logits[batch, seq, vocab]`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0".."n-1" keeps parameter names stable when pipeline parallelism
        # removes the blocks a stage does not own.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Rotary tables are derived data, not state: non-persistent, recomputed by init_weights.
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states (after the last norm): what the LM head reads."""
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        return self.norm(h) if self.norm is not None else h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.hidden(tokens)
        return self.output(h) if self.output is not None else h


def build_model(cfg: ModelConfig) -> Transformer:
    """The model on the meta device: shapes only, no memory; materialise with init_weights."""
    with torch.device("meta"):
        return Transformer(cfg)


def build(config: str | ModelConfig) -> Transformer:
    """`te.build_model`: the built-in model of a preset name (a key of MODEL_CONFIGS: tiny, moe-tiny, llama3-8b, ...)
    or a ModelConfig, on the meta device (`te.transform` initialises its weights, layout-independently)."""
    if isinstance(config, str):
        if config not in MODEL_CONFIGS:
            raise ValueError(f"model: unknown preset {config!r}; choose one of {sorted(MODEL_CONFIGS)}")
        config = MODEL_CONFIGS[config]
    return build_model(config)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters of the full (unsharded) model; works on meta and sharded models."""
    return sum(p.numel() for p in model.parameters())


# Standard deviation of the normal init of linears and embeddings (GPT-2 / Llama practice).
INIT_STD = 0.02
# Projections that write into the residual stream; their std is scaled by 1/sqrt(2 * n_layers)
# so the residual variance does not grow with depth (two such writes per block).
_RESIDUAL_OUT = ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.experts.w2",
                 "feed_forward.shared.w2.weight")


def param_seed(seed: int, name: str) -> int:
    """Generator seed for one parameter: stable across processes and runs (crc32, not hash())."""
    # 32 bits on purpose: the CPU generator (mt19937) keeps only the low 32 bits of its seed, so
    # seed and name must both be mixed into them.
    return zlib.crc32(f"{seed}/{name}".encode())


def full_init_value(name: str, shape: torch.Size, seed: int, n_layers: int) -> torch.Tensor:
    """The full float32 initial value of parameter `name`, on the CPU."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = INIT_STD / math.sqrt(2 * n_layers) if name.endswith(_RESIDUAL_OUT) else INIT_STD
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(model: Transformer, seed: int, *, device: torch.device | str | None = None) -> None:
    """Fill every parameter with its layout-independent initial value and recompute the rope tables.

    With `device`, meta parameters are first materialised there (`to_empty`). A DTensor parameter
    keeps only its local piece of the full value (`distribute_tensor` with src_data_rank=None does
    no communication), so 1 process and N processes start from identical weights.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if device is not None:
        model.to_empty(device=device)
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(f"parameter {name} is still on the meta device: pass device= to init_weights")
        full = full_init_value(name, param.shape, seed, model.config.n_layers)
        if isinstance(param, DTensor):
            piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(piece.to_local())
        else:
            param.copy_(full)
    for module in model.modules():
        if isinstance(module, MoE):
            module.expert_bias.zero_()  # a buffer: to_empty left it uninitialised
    cfg = model.config
    dev = model.rope_cos.device
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=dev)
    model.rope_cos = cos
    model.rope_sin = sin
