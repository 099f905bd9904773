"""The built-in Llama-style model's shapes: `ModelConfig` and the presets of `MODEL_CONFIGS`. Torch-free, so
that the SDK's planner (`trainyard.job.plan`) and layout checks read the shapes without loading torch;
`model.py` builds the modules from them."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the decoder."""

    vocab_size: int
    """Number of token ids; the embedding and the output head have this many rows."""
    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of query heads; dim must be a multiple of it."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention); must divide n_heads."""
    ffn_hidden: int
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (10000 is the value of the original RoPE paper)."""
    norm_eps: float = 1e-5
    """Epsilon added to the mean square in RMSNorm."""
    n_experts: int = 0
    """Routed experts per block (a mixture of experts in place of the MLP); 0: a dense SwiGLU MLP."""
    top_k: int = 2
    """Experts each token is routed to (mixture of experts only)."""
    expert_hidden: int | None = None
    """Hidden width of each expert's SwiGLU; None: ffn_hidden."""
    n_shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek-MoE's shared experts)."""
    capacity_factor: float | None = None
    """None: dropless routing. Else each expert takes at most capacity_factor x tokens x top_k / n_experts of a
    rank's tokens per micro-batch, in token order; the rest of its assignments are dropped (counted)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss n_experts x sum_e f_e P_e (Switch Transformer), f and P over the
    micro-batch's global tokens; 0: none."""
    norm_topk: bool = True
    """Renormalise each token's top-k gate weights to sum to 1 (Mixtral); False: the raw softmax weights."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the choice only,
    moved by this rate towards the mean load after each step; 0: off."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dimension dim/n_heads ({self.dim // self.n_heads}) must be even for RoPE")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps!r}")
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"n_experts must be an integer >= 0, got {self.n_experts!r}")
        if self.n_experts:
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_experts:
                raise ValueError(f"top_k must be an integer in 1..n_experts ({self.n_experts}), got {self.top_k!r}")
            if self.expert_hidden is not None and (not isinstance(self.expert_hidden, int) or self.expert_hidden < 1):
                raise ValueError(f"expert_hidden must be a positive integer or None, got {self.expert_hidden!r}")
            if not isinstance(self.n_shared_experts, int) or self.n_shared_experts < 0:
                raise ValueError(f"n_shared_experts must be an integer >= 0, got {self.n_shared_experts!r}")
            if self.capacity_factor is not None and not self.capacity_factor > 0:
                raise ValueError(f"capacity_factor must be positive or None (dropless), got {self.capacity_factor!r}")
            for name in ("aux_loss_coef", "bias_update_rate"):
                if not getattr(self, name) >= 0:
                    raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def moe_hidden(self) -> int:
        """Each expert's hidden width."""
        return self.expert_hidden or self.ffn_hidden

    def to_dict(self) -> dict:
        return asdict(self)


MODEL_CONFIGS: dict[str, ModelConfig] = {
    # ~0.5M parameters: for tests and smoke runs.
    "tiny": ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=352, max_seq_len=512),
    # The seed's 6-layer shape at tiny width: 6 blocks so that 3 pipeline stages hold 2 each.
    "6l": ModelConfig(vocab_size=512, dim=128, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=352, max_seq_len=512),
    # ~10M parameters (9.96M): 2.1M in the untied embedding and head, 0.79M per block.
    # ffn_hidden 768 = 3 * dim, close to Llama's 8/3 * dim rounded up to a multiple of 256.
    "10m": ModelConfig(vocab_size=4096, dim=256, n_layers=10, n_heads=8, n_kv_heads=4, ffn_hidden=768, max_seq_len=2048),
    # The published shapes of Meta's Llama 3 family (model cards and config.json of Llama 3.2 1B, Llama 3 8B
    # and 70B): 128,256-token vocabulary, RoPE base 500,000, grouped-query attention with 8 key/value heads.
    # Built on the meta device they cost no memory: for planning and layout checks. The built-in model does
    # not tie its head to the embedding, so "llama3.2-1b" has 1.50B parameters where the tied original has 1.24B.
    "llama3.2-1b": ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                               max_seq_len=8192, rope_theta=500000.0),
    "llama3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                             max_seq_len=8192, rope_theta=500000.0),
    # An 8B-shaped slice for one GPU: Llama 3 8B's layer (hidden 4096, 32/8 heads, SwiGLU 14,336) and its full
    # 128,256-token vocabulary, but 4 of its 32 layers: 1.92B parameters (1.05B of them the embedding and head),
    # 31 GB of fp32 weights, gradients and AdamW states, so a micro-batch of 4 x 2,048 tokens fits an 80 GB H100.
    # The per-layer matmul shapes are 8B's (what bench/mfu.py's bf16 / fp8 / fp16 rows measure); the vocabulary
    # weighs more than in the whole model (55% of the parameters instead of 13%).
    "llama3-8b-4l": ModelConfig(vocab_size=128256, dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                                max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                              max_seq_len=8192, rope_theta=500000.0),
    # Mixtures of experts. "moe-tiny" for tests and smoke runs: 4 routed experts (top 2) and a shared one per
    # block, ~0.72M parameters. "mixtral-8x7b": the published shapes of Mistral's Mixtral 8x7B (its config.json:
    # 32,000-token vocabulary, 8 experts of SwiGLU 14,336, top 2, RoPE base 1e6, router aux coefficient 0.001):
    # 46.7B parameters, 12.9B of them active per token; for planning and layout checks.
    "moe-tiny": ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=352,
                            max_seq_len=512, n_experts=4, top_k=2, expert_hidden=128, n_shared_experts=1),
    "mixtral-8x7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                                max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2, aux_loss_coef=0.001),
}
