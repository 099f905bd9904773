"""`transform(model, kernels=...)`: a model's norms, MLPs, rotary embeddings and loss as trainyard.kernels ops.

    kernels         what runs
    off / None      the model's own modules (nothing is swapped)
    eager           the ops' eager references: the same maths, the loss chunked over tokens so that the
                    logits are never materialised in full ("eager-chunked" is the same)
    triton          the Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1); an error elsewhere
    auto / True     Triton where it runs, else eager

What is swapped, in the built-in Llama and in Hugging Face Llama-family models (a module qualifies by its
shape, not its class: Mistral, Qwen2 and the like match too):

    RMSNorm         built-in RMSNorm, HF *RMSNorm (weight, eps / variance_epsilon)   -> rms_norm
    SwiGLU MLP      built-in FeedForward (w1, w2, w3), HF MLP with silu (gate/up/down) -> swiglu
    rotary          built-in Attention (consecutive pairs), HF apply_rotary_pos_emb    -> apply_rope
    loss            the LM head and cross-entropy                                     -> fused_linear_cross_entropy

Each swap replaces the instance's `forward` (names, parameters and checkpoints are unchanged; the model's
class and its other instances are not touched), except HF's rotary function, which is a function of the
model family's module: it is replaced in that module once (every model of the family in the process then
uses the op, which computes the same values). The loss swap makes the model return `LMHidden` (the final
hidden states and the head's weight) instead of logits; `lm_loss(output, targets)` turns either into the
mean token cross-entropy. It is made only where the head's weight is a plain tensor on the rank: without
tensor parallelism (a vocab-sharded head keeps DTensor's loss-parallel cross-entropy) and without pipeline
parallelism (stages exchange tensors only).

Under tensor parallelism the ops see local tensors: an input DTensor is unwrapped and the result wrapped
with the input's placements; a replicated weight (sequence-parallel norms) gives its gradient back as a
partial sum over the mesh, which DTensor reduces, as its own ops would.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from trainyard import kernels

MODES = {None: None, False: None, "off": None, "eager": "eager", "eager-chunked": "eager", "triton": "triton",
         "auto": "auto", True: "auto"}


def backend_of(kernels_arg) -> str | None:
    """The ops' backend for `transform(kernels=...)` / the `kernels` hyperparameter; None: nothing swapped."""
    if not isinstance(kernels_arg, (str, bool, type(None))) or kernels_arg not in MODES:
        raise ValueError(f"kernels={kernels_arg!r}: use one of off, eager (eager-chunked), triton, auto")
    return MODES[kernels_arg]


@dataclass
class LMHidden:
    """What a model with the fused loss returns: its final hidden states and its LM head's weight."""

    hidden: torch.Tensor
    head_weight: torch.Tensor
    backend: str

    @property
    def logits(self) -> torch.Tensor:
        """The full logits, for a loss function that wants them (this gives up the fused loss's memory)."""
        return F.linear(self.hidden, self.head_weight)


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens from logits, an HF output, or `LMHidden` (fused: no full logits)."""
    if isinstance(output, LMHidden):
        hidden = output.hidden.flatten(0, -2)
        return kernels.fused_linear_cross_entropy(hidden, output.head_weight, targets.flatten(),
                                                  backend=output.backend)
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ---- local tensors under tensor parallelism --------------------------------------------------------------


def _local(t: torch.Tensor, *, weight: bool = False) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return t
    if weight and all(p.is_replicate() for p in t.placements):
        # each rank's gradient covers its own rows (its sequence shard): a partial sum over the mesh
        return t.to_local(grad_placements=[Partial()] * len(t.placements))
    return t.to_local()


def _like(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return DTensor.from_local(out, ref.device_mesh, ref.placements, run_check=False) if isinstance(ref, DTensor) \
        else out


# ---- the swaps ---------------------------------------------------------------------------------------


def _norm_eps(module: nn.Module) -> float | None:
    if not (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)):
        return None
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _swap_norm(module: nn.Module, eps: float, backend: str) -> None:
    def forward(self, x):
        return _like(kernels.rms_norm(_local(x), _local(self.weight, weight=True), eps, backend=backend), x)

    module.forward = types.MethodType(forward, module)


def _is_builtin_ffn(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in ("w1", "w2", "w3"))


def _is_hf_silu_mlp(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")) \
        and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")  # torch's, transformers'


def _swiglu(a: torch.Tensor, b: torch.Tensor, backend: str) -> torch.Tensor:
    return _like(kernels.swiglu(_local(a), _local(b), backend=backend), a)


def _swap_builtin_ffn(module: nn.Module, backend: str) -> None:
    def forward(self, x):
        return self.w2(_swiglu(self.w1(x), self.w3(x), backend))

    module.forward = types.MethodType(forward, module)


def _swap_hf_mlp(module: nn.Module, backend: str) -> None:
    def forward(self, x):
        return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x), backend))

    module.forward = types.MethodType(forward, module)


def _swap_builtin_rope(attention: nn.Module, backend: str) -> None:
    def rope(self, q, k, cos, sin):
        seq = q.shape[1]  # the model's tables cover max_seq_len
        return kernels.apply_rope(q, k, cos[:seq], sin[:seq], layout="pairs", backend=backend)

    attention.rope = types.MethodType(rope, attention)


def _patch_hf_rope(attention: nn.Module, backend: str) -> bool:
    """Replace `apply_rotary_pos_emb` in the attention's module (once per module and backend)."""
    module = sys.modules.get(type(attention).__module__)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if getattr(original, "trainyard_backend", None) == backend:
        return True
    reference = getattr(original, "trainyard_original", original)

    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        if args or kwargs or unsqueeze_dim != 1:  # a call form the op does not serve: the model's own
            return reference(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        return kernels.apply_rope(q, k, cos, sin, layout="hf", backend=backend)

    apply_rotary_pos_emb.trainyard_backend = backend
    apply_rotary_pos_emb.trainyard_original = reference
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def _swap_loss(model: nn.Module, backend: str) -> bool:
    """The model returns LMHidden instead of logits: the built-in Transformer (`output`) or an HF causal LM
    (`lm_head` over `model`)."""
    head = getattr(model, "output", None) if hasattr(model, "hidden") else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return False
    if hasattr(model, "hidden"):  # the built-in Transformer
        def forward(self, tokens):
            return LMHidden(self.hidden(tokens), self.output.weight, backend)
    else:
        def forward(self, input_ids=None, **kwargs):
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            return LMHidden(hidden, self.lm_head.weight, backend)

    model.forward = types.MethodType(forward, model)
    return True


def swap_kernels(model: nn.Module, backend: str, *, fused_loss: bool) -> dict[str, int]:
    """Swap the model's modules for the ops (see the module docstring). Returns what was swapped, by kind."""
    swapped = {"rms_norm": 0, "swiglu": 0, "rope": 0, "loss": 0}
    for module in model.modules():
        eps = _norm_eps(module)
        if eps is not None:
            _swap_norm(module, eps, backend)
            swapped["rms_norm"] += 1
        elif _is_builtin_ffn(module):
            _swap_builtin_ffn(module, backend)
            swapped["swiglu"] += 1
        elif _is_hf_silu_mlp(module):
            _swap_hf_mlp(module, backend)
            swapped["swiglu"] += 1
        elif hasattr(module, "rope") and hasattr(module, "wq"):  # the built-in Attention
            _swap_builtin_rope(module, backend)
            swapped["rope"] += 1
        elif type(module).__name__.endswith("Attention") and hasattr(module, "q_proj"):
            swapped["rope"] += _patch_hf_rope(module, backend)
    if fused_loss and _swap_loss(model, backend):
        swapped["loss"] = 1
    return swapped
