"""A model's shapes for planning, torch-free: a built-in preset (`MODEL_CONFIGS`) or `ModelConfig`, a Hugging
Face `config.json` (the file, or a folder holding it) read as JSON, or a model object built for the engine (the
built-in Transformer or an HF causal LM, e.g. on the meta device), read from its config.

Parameter counts follow the built-in Llama-style block (the same counts the engine's modules have): attention
q/o of dim x dim, k/v of dim x (kv heads x head width), a gated (SwiGLU: 3 matrices) or plain (2 matrices) MLP
of hidden width `ffn_hidden`, two norms of `dim`; an embedding table, a final norm and a head of
vocab x dim (none when tied to the embedding).

Model FLOPs of one training token (forward + backward, no recomputation counted), after PaLM (Chowdhery et
al. 2022, appendix B), as torchtitan and Megatron-LM report MFU (`model_flops_per_token`, the one formula: the
planner's shapes and the engine's measured MFU both use it):

    6 N + 12 L H Q T

N: the parameters that do matrix multiplies per token: every parameter but the input embedding table (a
lookup; a tied embedding is the head's weight and counts); L layers, H attention heads of width Q, T the
sequence length: the attention scores and their weighted sum, 2 x 2 L H Q T in forward, x 3 with backward.
(The causal mask halves the useful part of that term; like PaLM and torchtitan, it is not halved.)

`PEAK_TFLOPS` is the one table of the GPUs' dense peaks (the engine's MFU; the catalog's planner figures are
checked against it by a test).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from trainyard.parallel.layout import check_tp
from trainyard.parallel.presets import MODEL_CONFIGS, ModelConfig
from trainyard.errors import ConfigError, did_you_mean


# dense tensor-core TFLOP/s from the vendors' datasheets: {device name fragment: {dtype: peak}}; fp32 runs as
# TF32. The fragments match torch.cuda.get_device_name and the catalog's accelerator names.
PEAK_TFLOPS = {
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    "H100 SXM": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    "H100 80GB HBM3": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},  # the SXM part's device name
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 60.0},
    "A10": {"bfloat16": 125.0, "float16": 125.0, "float32": 62.5},
}


def table_peak(device_name: str, dtype: str) -> tuple[float, str] | None:
    """(TFLOP/s, the table's fragment) for a device name (`NVIDIA H100 80GB HBM3`) and a dtype name
    (`bfloat16`); None when no fragment of PEAK_TFLOPS is in the name."""
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in device_name and dtype in peaks:
            return peaks[dtype], fragment
    return None


def model_flops_per_token(*, matmul_params: int, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    """6 N + 12 L H Q T (see above)."""
    return 6.0 * matmul_params + 12.0 * layers * heads * head_dim * seq_len


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    gated_mlp: bool = True
    """SwiGLU (3 matrices, Llama) or a plain MLP (2 matrices, GPT-2/MPT)."""
    tied_embeddings: bool = False
    max_seq_len: int | None = None
    head_dim_override: int | None = None
    n_experts: int = 0
    """A mixture of experts in place of the MLP (0: dense): n_experts routed SwiGLU experts of width
    `expert_hidden`, `top_k` of them per token, `n_shared_experts` every token goes through, a router."""
    top_k: int = 0
    expert_hidden: int = 0
    n_shared_experts: int = 0
    pipeline_with_cp: bool = True
    """Whether its pipeline stages run on a rank's chunks of the sequence under context parallelism: the built-in
    model's do; a Hugging Face model's positions come from its own forward, which no stage runs."""
    experts_with_tp: bool = True
    """Whether its mixture of experts takes tensor parallelism (the built-in one's tokens stay sequence-parallel
    shards, each rank routing its own; a Hugging Face one's is refused)."""
    expert_parallel: bool = True
    """Whether the engine can spread its experts (a Hugging Face family whose experts are not packed as
    Mixtral's, e.g. GPT-OSS's, cannot)."""
    context_parallel: bool = True
    """Whether its attention can be split over the sequence (not one that attends within a sliding window)."""

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        return 2 * self.dim * self.n_heads * self.head_dim + 2 * self.dim * self.kv_dim

    @property
    def expert_params(self) -> int:
        """One expert's parameters (a SwiGLU of width expert_hidden)."""
        return 3 * self.dim * self.expert_hidden

    @property
    def block_matrix_params(self) -> int:
        """Parameters of one block's matrices (what tensor parallelism splits; every expert and the router)."""
        if self.n_experts:
            return (self.attention_params + (self.n_experts + self.n_shared_experts) * self.expert_params
                    + self.dim * self.n_experts)
        return self.attention_params + (3 if self.gated_mlp else 2) * self.dim * self.ffn_hidden

    def check_tp(self, tp: int, seq_len: int | None = None) -> None:
        """ValueError unless `tp` divides what tensor parallelism splits (layout.check_tp): the heads, the vocabulary,
        the sequence, and the MLP width: the dense MLP's, or a mixture of experts' shared experts' (its routed
        experts stay whole on a rank)."""
        hidden, name = ((self.n_shared_experts * self.expert_hidden or None, "n_shared_experts x expert_hidden")
                        if self.n_experts else (self.ffn_hidden, "ffn_hidden"))
        check_tp(tp=tp, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, ffn_hidden=hidden, ffn_name=name,
                 vocab_size=self.vocab_size, seq_len=seq_len)

    def experts_held_whole(self, *, ep: int, tp: int) -> bool:
        """Whether a rank holds its n_experts / ep experts whole, outside MiCS's sharding: under expert
        parallelism, and under tensor parallelism (whose ranks route their own tokens through every expert)."""
        return bool(self.n_experts) and (ep > 1 or tp > 1)

    @property
    def block_expert_params(self) -> int:
        """One block's routed experts (0 when dense): what expert parallelism spreads."""
        return self.n_experts * self.expert_params

    @property
    def active_block_matrix_params(self) -> int:
        """One block's matrices a token multiplies by: all of them but the routed experts it is not sent to."""
        return self.block_matrix_params - max(self.n_experts - self.top_k, 0) * self.expert_params

    @property
    def idle_expert_params(self) -> int:
        """Parameters of the routed experts a token does not go through, over all blocks (0 when dense)."""
        return self.n_layers * max(self.n_experts - self.top_k, 0) * self.expert_params

    @property
    def block_params(self) -> int:
        return self.block_matrix_params + 2 * self.dim  # two norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def head_params(self) -> int:
        """The output head's own parameters (0 when tied) and the final norm."""
        return (0 if self.tied_embeddings else self.vocab_size * self.dim) + self.dim

    @property
    def total_params(self) -> int:
        return self.n_layers * self.block_params + self.embedding_params + self.head_params

    @property
    def matmul_params(self) -> int:
        """N of 6 N: every parameter a token multiplies by, so not the input embedding table (a tied one is the
        head's weight) and, in a mixture of experts, only its top_k routed experts (the active parameters)."""
        return self.total_params - (0 if self.tied_embeddings else self.embedding_params) - self.idle_expert_params

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one training token (forward + backward, no recomputation)."""
        return model_flops_per_token(matmul_params=self.matmul_params, layers=self.n_layers, heads=self.n_heads,
                                     head_dim=self.head_dim, seq_len=seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        return 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len


def from_preset(name: str) -> ModelShape:
    return from_config(MODEL_CONFIGS[name], name)


# Hugging Face config keys: Llama-family names first, then GPT-2's
_KEYS = {"dim": ("hidden_size", "n_embd", "d_model"), "n_layers": ("num_hidden_layers", "n_layer", "n_layers"),
         "n_heads": ("num_attention_heads", "n_head", "n_heads"), "vocab_size": ("vocab_size",)}


def from_hf_config(config: dict, name: str) -> ModelShape:
    """The shape of a Hugging Face causal LM's config (Llama, Mistral, Qwen2 and GPT-2 style keys, and the experts of
    a mixture of experts: Mixtral, Qwen2/3-MoE, OLMoE)."""
    def get(field: str) -> int:
        for key in _KEYS[field]:
            if isinstance(config.get(key), int):
                return config[key]
        raise ConfigError("model", f"{name}: config.json has none of {list(_KEYS[field])}; it needs the model's "
                                   f"{field} (a Llama- or GPT-2-style config)")

    dim, heads = get("dim"), get("n_heads")
    gated = "intermediate_size" in config  # Llama-style configs name the SwiGLU width so
    ffn = config.get("intermediate_size") or config.get("n_inner") or 4 * dim
    # HF's PretrainedConfig ties by default; Llama-family configs write tie_word_embeddings explicitly
    tied = bool(config.get("tie_word_embeddings", not gated))
    return ModelShape(name=name, vocab_size=get("vocab_size"), dim=dim, n_layers=get("n_layers"), n_heads=heads,
                      n_kv_heads=config.get("num_key_value_heads") or heads, ffn_hidden=ffn, gated_mlp=gated,
                      tied_embeddings=tied,
                      max_seq_len=config.get("max_position_embeddings") or config.get("n_positions"),
                      head_dim_override=config.get("head_dim"), pipeline_with_cp=False, experts_with_tp=False,
                      expert_parallel=config.get("model_type") in PACKED_EXPERTS,
                      context_parallel=not _sliding(config), **_hf_experts(config, name, ffn))


# the Hugging Face families whose experts the engine spreads (engine/models/hf/moe.py checks the class itself)
PACKED_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _sliding(config: dict) -> bool:
    """Whether the config attends within a sliding window, which context parallelism refuses."""
    window = config.get("sliding_window")
    return isinstance(window, int) and window > 0 and config.get("use_sliding_window", True) is not False


# the keys of a Hugging Face mixture of experts' config: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# keys under which some blocks keep a dense MLP, with the value that means "none do"
_DENSE_BLOCK_KEYS = {"mlp_only_layers": [], "decoder_sparse_step": 1, "first_k_dense_replace": 0,
                     "moe_layer_freq": 1}


def _hf_experts(config: dict, name: str, ffn: int) -> dict:
    """The mixture-of-experts fields of a Hugging Face config ({} for a dense model): routed experts of width
    `moe_intermediate_size` (Qwen, DeepSeek) or `intermediate_size` (Mixtral, OLMoE), top `num_experts_per_tok`,
    and the shared experts: `n_shared_experts` of the routed width (DeepSeek) or Qwen2-MoE's one shared expert of
    `shared_expert_intermediate_size`, counted as that width over the routed one, rounded up (4 for Qwen1.5/2-MoE)."""
    nested = config.get("ffn_config")
    if isinstance(nested, dict) and any("expert" in k for k in nested):  # DBRX: the experts in a nested block
        raise ConfigError("model", f"{name}: config.json keeps its experts in ffn_config ({sorted(nested)}), which "
                                   "the planner does not read; plan with a ModelShape of your own")
    n = next((config[k] for k in _EXPERT_KEYS if isinstance(config.get(k), int) and config[k] > 0), 0)
    if not n:
        return {}
    for key, dense in _DENSE_BLOCK_KEYS.items():
        if config.get(key, dense) not in (dense, None):
            raise ConfigError("model", f"{name}: config.json has {key}={config[key]!r}, a mixture of experts with some "
                                       "dense blocks; the planner models every block alike (the same experts in each): "
                                       "plan with a preset or ModelShape of your own")
    hidden = config.get("moe_intermediate_size") or ffn
    shared_width = config.get("shared_expert_intermediate_size") or 0
    shared = config.get("n_shared_experts") or -(-shared_width // hidden)
    top_k = config.get("num_experts_per_tok")
    if not isinstance(top_k, int) or not 1 <= top_k <= n:
        raise ConfigError("model", f"{name}: config.json has {n} experts but num_experts_per_tok={top_k!r}; it needs "
                                   f"the experts each token goes through, an integer from 1 to {n}")
    return dict(n_experts=n, top_k=top_k, expert_hidden=hidden, n_shared_experts=int(shared))


def from_config(config: ModelConfig, name: str = "model") -> ModelShape:
    """The shape of a built-in model's `ModelConfig`."""
    moe = dict(n_experts=config.n_experts, top_k=config.top_k, expert_hidden=config.moe_hidden,
               n_shared_experts=config.n_shared_experts) if config.n_experts else {}
    return ModelShape(name=name, vocab_size=config.vocab_size, dim=config.dim, n_layers=config.n_layers,
                      n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, ffn_hidden=config.ffn_hidden,
                      max_seq_len=config.max_seq_len, **moe)


def from_module(model: object) -> ModelShape:
    """The shape of a model object, as built for the engine (on the meta device costs nothing): the built-in
    Transformer (its `ModelConfig`) or a Hugging Face causal LM (its config). Read from attributes: no torch call."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if isinstance(config, ModelConfig):
        return from_config(config, name)
    if hasattr(config, "to_dict"):  # a Hugging Face PretrainedConfig
        return from_hf_config(config.to_dict(), name)
    raise ConfigError("model", f"{name} has no built-in ModelConfig or Hugging Face config to read its shapes "
                               "from; pass a preset, a config.json or a ModelShape")


def resolve_model(model: object) -> ModelShape:
    """A ModelShape, a preset name, a config.json path or a folder holding one, a `ModelConfig`, or a model
    object (`from_module`); ConfigError naming the choices otherwise."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, ModelConfig):
        return from_config(model)
    if not isinstance(model, str) and hasattr(model, "config"):
        return from_module(model)
    if not isinstance(model, str) or not model:
        raise ConfigError("model", f"expected a preset name ({', '.join(MODEL_CONFIGS)}), a config.json path or a "
                                   f"folder holding one, got {model!r}")
    if model in MODEL_CONFIGS:
        return from_preset(model)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ConfigError("model", f"{model!r} is neither a built-in preset ({', '.join(MODEL_CONFIGS)}) nor a "
                                   f"config.json file or a folder holding one{did_you_mean(model, MODEL_CONFIGS)}")
    try:
        with open(path) as fh:
            config = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("model", f"cannot read {path} as JSON ({e}); pass a Hugging Face config.json") from None
    if not isinstance(config, dict):
        raise ConfigError("model", f"{path} holds {type(config).__name__}, not a JSON object; pass a Hugging Face "
                                   "config.json")
    return from_hf_config(config, os.path.basename(os.path.dirname(os.path.abspath(path))) or path)
