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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

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
}
