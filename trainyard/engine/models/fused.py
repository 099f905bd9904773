"""`transform(model, kernels=...)`: a model's norms, MLPs, rotary embeddings and loss as trainyard.kernels ops,
where, and only where, the ops compute what the model's own modules compute.

    kernels         what runs
    off / None      the model's own modules (nothing is swapped)
    eager           the ops' eager references: the same maths, the loss chunked over tokens so that the
                    logits are never materialised in full ("eager-chunked" is the same)
    triton          the Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1); an error elsewhere
    auto / True     Triton where it runs, else eager; with compile=True on CUDA, per op: ours or the eager
                    reference compiled by inductor, whichever a startup measurement finds faster at the
                    model's shapes (`plan_backends`, trainyard/kernels/auto.py)

What may be swapped (the built-in Llama, Hugging Face models of any family):

    a norm          a module with one 1-D `weight` and an `eps` / `variance_epsilon`   -> rms_norm, as x * w
                    (Llama) or x * (1 + w) (Gemma, whose weights start at 0)
    a SwiGLU MLP    built-in FeedForward (w1, w2, w3), HF gate/up/down projections    -> swiglu
    rotary          built-in Attention (consecutive pairs), HF apply_rotary_pos_emb    -> apply_rope
    the loss        the LM head and cross-entropy, with the model's final-logit       -> fused_linear_cross_entropy
                    soft-capping (Gemma 2/3) or scale (Cohere, Granite)

A module qualifies by what it computes, not by its class name. Before anything is swapped, each module's own
forward runs once in float32 on a small random input (every instance: two norms of one class may differ in eps
or in a flag), on a stand-in with random weights (for an MLP, small
random projections in place of its own: no copy of its weights), and its output is compared with the op's; a
module whose maths differs (Gemma's GELU MLP, Cohere's interleaved rotary, a LayerNorm) is left alone and named
once in transform's line. The rotary function is compared the same way before it is patched, and at each call
it takes the op only in the form the comparison covered (tables as wide as the head, no extra arguments). The
loss: the causal LM's own forward runs with a stand-in base model and head, which return known tensors; its
logits must be the head's output, or that capped or scaled by the model's numbers, else the loss is left to the
model (named in the line).

Each swap replaces the instance's `forward` (names, parameters and checkpoints are unchanged; the model's
class and its other instances are not touched), except HF's rotary function, which is a function of the
model family's module: it is replaced in that module once (every model of the family in the process then
uses the op, which computes the same values). The loss swap makes the model return `LMHidden` (the final
hidden states, the head's weight and the soft-cap) instead of logits; `lm_loss(output, targets)` turns either
into the mean token cross-entropy, and `LMHidden.logits` gives the model's logits. It is made only where the
head's weight is a plain tensor on the rank: without tensor parallelism (a vocab-sharded head keeps DTensor's
loss-parallel cross-entropy) and without pipeline parallelism (stages exchange tensors only).

Under tensor parallelism the ops see local tensors: an input DTensor is unwrapped and the result wrapped
with the input's placements; a replicated weight (sequence-parallel norms) gives its gradient back as a
partial sum over the mesh, which DTensor reduces, as its own ops would.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

if TYPE_CHECKING:
    from trainyard.kernels.auto import Choice, OpShapes

MODES = {None: None, False: None, "off": None, "eager": "eager", "eager-chunked": "eager", "triton": "triton",
         "auto": "auto", True: "auto"}
# An op and the module it replaces agree to float32 rounding on the probes (~1e-7); a different formula is off
# by O(1).
PROBE_TOLERANCE = 1e-5


kernels = None  # trainyard.kernels once `_ops()` imported it (every swap does, before any op runs)


def _ops():
    """trainyard.kernels, imported at the first swap and not with the engine: registering its ops imports
    torch._inductor and torch._dynamo (1.2 s of CPU), which a process that swaps nothing never needs
    (components/lazy_dynamo.py). The swapped forwards read the module global, as a compiled graph traces it."""
    global kernels
    if kernels is None:
        from trainyard import kernels as imported

        kernels = imported
    return kernels


def _auto():
    """trainyard.kernels.auto, imported where kernels are asked for (as `_ops`)."""
    from trainyard.kernels import auto

    return auto


def backend_of(kernels_arg) -> str | None:
    """The ops' backend for `transform(kernels=...)` / the `kernels` hyperparameter; None: nothing swapped."""
    if not isinstance(kernels_arg, (str, bool, type(None))) or kernels_arg not in MODES:
        raise ValueError(f"kernels={kernels_arg!r}: use one of off, eager (eager-chunked), triton, auto")
    return MODES[kernels_arg]


@dataclass
class LMHidden:
    """What a model with the fused loss returns: its final hidden states (already multiplied by the model's
    logit scale) and its LM head's weight; `lm_loss(output, targets)` is its loss, `.logits` its logits."""

    hidden: torch.Tensor
    head_weight: torch.Tensor
    backend: str
    softcap: float | None = None
    """The model's final-logit soft-cap c (logits c * tanh(z / c)), None without."""

    @property
    def logits(self) -> torch.Tensor:
        """The model's logits, for a loss function that wants them (this gives up the fused loss's memory)."""
        z = F.linear(self.hidden, self.head_weight)
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens from logits, an HF output, or `LMHidden` (fused: no full logits)."""
    if isinstance(output, LMHidden):
        hidden = output.hidden.flatten(0, -2)
        return kernels.fused_linear_cross_entropy(hidden, output.head_weight, targets.flatten(),
                                                  backend=output.backend, softcap=output.softcap)
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


# ---- the ops as forwards ---------------------------------------------------------------------------------


def _norm_forward(eps: float, offset: float, backend: str):
    def forward(self, x):
        w = _local(self.weight, weight=True)
        return _like(kernels.rms_norm(_local(x), w + offset if offset else w, eps, backend=backend), x)

    return forward


def _swiglu(a: torch.Tensor, b: torch.Tensor, backend: str) -> torch.Tensor:
    return _like(kernels.swiglu(_local(a), _local(b), backend=backend), a)


def _builtin_ffn_forward(backend: str):
    def forward(self, x):
        return self.w2(_swiglu(self.w1(x), self.w3(x), backend))

    return forward


def _hf_mlp_forward(backend: str):
    def forward(self, x):
        return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x), backend))

    return forward


# ---- probes: does the op compute what the module computes? ---------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(torch.isfinite(want).all()) and \
        (got - want).abs().max().item() <= PROBE_TOLERANCE * max(1.0, want.abs().max().item())


def _stand_in(module: nn.Module, params: dict | None = None, children: dict | None = None) -> nn.Module:
    """A shallow copy of `module` with other parameters and/or children: its class's forward runs on it without
    touching the module, its weights (which may be on the meta device or a GPU) or its hooks."""
    probe = object.__new__(type(module))
    probe.__dict__ = dict(module.__dict__)
    probe._parameters = dict(module._parameters) if params is None else params
    probe._modules = {**module._modules, **(children or {})}
    probe._forward_hooks, probe._forward_pre_hooks = {}, {}
    return probe


def _run(fn, *args):
    try:
        with torch.no_grad():
            return fn(*args)
    except Exception:  # a module we did not write failing on a stand-in: not the op's maths
        return None


def _norm_offset(module: nn.Module, gen: torch.Generator) -> tuple[float, float] | None:
    """(eps, offset) when `module` is an RMSNorm x * (offset + w) over its last dimension; None otherwise."""
    weight = module._parameters.get("weight")
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    if weight is None or weight.dim() != 1 or set(module._parameters) != {"weight"} or module._buffers \
            or not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return None
    n = weight.shape[0]
    w = torch.randn(n, generator=gen) * 0.5 + 0.2
    x = torch.randn(2, 3, n, generator=gen)
    want = _run(type(module).forward, _stand_in(module, {"weight": nn.Parameter(w)}), x)
    if want is None:
        return None
    for offset in (0.0, 1.0):
        if _close(_ops().rmsnorm.rms_norm_reference(x, w + offset, float(eps)), want):
            return float(eps), offset
    return None


def _tiny_linear(like: nn.Linear, n_in: int, n_out: int, gen: torch.Generator) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=like.bias is not None)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=gen) / n_in ** 0.5)
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(n_out, generator=gen) * 0.1)
    return lin


def _mlp_matches(module: nn.Module, names: tuple[str, str, str], forward, gen: torch.Generator) -> bool:
    """Whether `forward` (the swiglu form) computes what `module`'s own forward does: both run on a stand-in
    whose three projections are small random ones."""
    gate, up, down = (getattr(module, n, None) for n in names)
    if not all(isinstance(m, nn.Linear) for m in (gate, up, down)):
        return False
    width, inner = 6, 10
    probe = _stand_in(module, children={names[0]: _tiny_linear(gate, width, inner, gen),
                                        names[1]: _tiny_linear(up, width, inner, gen),
                                        names[2]: _tiny_linear(down, inner, width, gen)})
    x = torch.randn(2, 3, width, generator=gen)
    want, got = _run(type(module).forward, probe, x), _run(forward, probe, x)
    return want is not None and got is not None and _close(got, want)


def _rope_tables(seq: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(seq, dim // 2, generator=gen) * 6.0
    emb = torch.cat((angles, angles), dim=-1)[None]  # as transformers' rotary embeddings return them
    return emb.cos(), emb.sin()


def _rope_matches(fn, gen: torch.Generator) -> bool:
    """Whether `apply_rotary_pos_emb` of a family computes the op's HF-layout rotation."""
    q, k = torch.randn(1, 4, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)
    cos, sin = _rope_tables(5, 8, gen)
    want = _run(fn, q, k, cos, sin)
    if not isinstance(want, tuple) or len(want) != 2:
        return False
    got = _ops().apply_rope(q, k, cos, sin, layout="hf", backend="eager")
    return all(_close(g, w) for g, w in zip(got, want))


@dataclass(frozen=True)
class HeadMaths:
    """What a causal LM does between its head and its logits: logits = cap(scale * z), z = head(hidden)."""

    scale: float | None = None
    softcap: float | None = None


def _hf_head_maths(model: nn.Module, gen: torch.Generator) -> HeadMaths | str:
    """How an HF causal LM turns its base model's hidden states into logits, read by running its own forward
    with a stand-in base model (returns a known hidden state) and head (records what it gets, returns known
    logits z): HeadMaths, or why the fused loss cannot reproduce it."""
    base_name, head = getattr(model, "base_model_prefix", ""), model.get_output_embeddings()
    head_name = next((n for n, c in model.named_children() if c is head), None)
    if not isinstance(head, nn.Linear) or head.bias is not None or not hasattr(model, base_name) or head_name is None:
        return "its LM head is not a bias-free nn.Linear after its base model"
    # the widest base-model output: families read cross_attentions, attentions, ... from it
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions as BaseOutput

    width = head.in_features
    hidden = torch.randn(1, 3, width, generator=gen)
    z = torch.randn(1, 3, 7, generator=gen) * 8.0  # logits far from tanh's linear range
    seen: list[torch.Tensor] = []

    class Base(nn.Module):
        def forward(self, *args, **kwargs):
            return BaseOutput(last_hidden_state=hidden)

    class Head(nn.Module):
        def forward(self, x):
            seen.append(x)
            return z

    probe = _stand_in(model, children={base_name: Base(), head_name: Head()})
    out = _run(lambda: type(model).forward(probe, input_ids=torch.zeros(1, 3, dtype=torch.long)))
    logits = getattr(out, "logits", None)
    if logits is None or len(seen) != 1 or not torch.equal(seen[0], hidden):
        return "its forward does not apply the head to the base model's last hidden states"
    if _close(logits, z):
        return HeadMaths()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if isinstance(cap, (int, float)) and cap > 0 and _close(logits, torch.tanh(z / cap) * cap):
        return HeadMaths(softcap=float(cap))
    ratio = logits / z
    scale = ratio.flatten()[0].item()
    if _close(logits, z * scale):
        return HeadMaths(scale=scale)
    return "its logits are not the head's output, soft-capped or scaled"


def _fused_loss_forward(model: nn.Module, backend: str, maths: HeadMaths):
    """The forward that returns LMHidden: the built-in Transformer (`hidden`, `output`) or an HF causal LM."""
    if hasattr(model, "hidden"):
        def forward(self, tokens):
            return LMHidden(self.hidden(tokens), self.output.weight, backend)
        return forward
    base_name = model.base_model_prefix
    head_name = next(n for n, c in model.named_children() if c is model.get_output_embeddings())

    def forward(self, input_ids=None, **kwargs):
        hidden = getattr(self, base_name)(input_ids=input_ids, **kwargs).last_hidden_state
        if maths.scale is not None:
            hidden = hidden * maths.scale  # (scale * h) W^T = scale * (h W^T)
        return LMHidden(hidden, getattr(self, head_name).weight, backend, maths.softcap)

    return forward


# ---- the rotary function of a family ------------------------------------------------------------------


def _patch_hf_rope(attention: nn.Module, backend: str, gen: torch.Generator) -> bool | None:
    """Replace `apply_rotary_pos_emb` in the attention's module (once per module and backend) when it computes
    the op's rotation. None: the module has no such function; False: it does something else."""
    module = sys.modules.get(type(attention).__module__)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None:
        return None
    if getattr(original, "trainyard_backend", None) == backend:
        return True
    reference = getattr(original, "trainyard_original", original)
    if not _rope_matches(reference, gen):
        return False
    halves = {"checked": False}

    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        # only the call form the probe covered: HF layout, tables as wide as the head, nothing else passed
        if args or kwargs or unsqueeze_dim != 1 or cos.shape[-1] != q.shape[-1] or cos.dim() != 3:
            return reference(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        if not halves["checked"]:  # the op reads half of each table row: the halves must repeat (once a process)
            h = cos.shape[-1] // 2
            halves["ok"] = torch.equal(cos[..., :h], cos[..., h:]) and torch.equal(sin[..., :h], sin[..., h:])
            halves["checked"] = True
        if not halves["ok"]:
            return reference(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return kernels.apply_rope(q, k, cos, sin, layout="hf", backend=backend)

    apply_rotary_pos_emb.trainyard_backend = backend
    apply_rotary_pos_emb.trainyard_original = reference
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def _swap_builtin_rope(attention: nn.Module, backend: str) -> None:
    def rope(self, q, k, cos, sin):
        seq = q.shape[1]  # the model's tables cover max_seq_len
        return kernels.apply_rope(q, k, cos[:seq], sin[:seq], layout="pairs", backend=backend)

    attention.rope = types.MethodType(rope, attention)


# ---- the swap ----------------------------------------------------------------------------------------


@dataclass
class Swapped:
    """What `swap_kernels` did: modules swapped by kind, and what it left alone (by class, with a count)."""

    counts: dict[str, int] = field(default_factory=lambda: {"rms_norm": 0, "swiglu": 0, "rope": 0, "loss": 0})
    left: dict[str, int] = field(default_factory=dict)
    loss_note: str | None = None

    def leave(self, module: nn.Module | str) -> None:
        name = module if isinstance(module, str) else type(module).__name__
        self.left[name] = self.left.get(name, 0) + 1

    def __str__(self) -> str:
        line = ", ".join(f"{k} {n}" for k, n in self.counts.items())
        if self.left:
            line += "; left alone (their maths is not the ops'): " + ", ".join(
                f"{name} x{n}" if n > 1 else name for name, n in self.left.items())
        if self.loss_note:
            line += f"; loss left to the model: {self.loss_note}"
        return line


def _looks_like_norm(module: nn.Module) -> bool:
    """A norm with a weight and nothing else (LayerNorms with a bias are not candidates for rms_norm)."""
    return "Norm" in type(module).__name__ and set(k for k, v in module._parameters.items() if v is not None) == {"weight"}


def swap_kernels(model: nn.Module, backend: str, *, fused_loss: bool, seed: int = 0,
                 backends: dict[str, str] | None = None) -> Swapped:
    """Swap the model's modules for the ops where they compute the same (see the module docstring).
    `backends`: a backend per op ("rms_norm", "swiglu", "rope", "loss") over `backend` (kernels=auto under
    compile: the ops left to inductor run their eager reference)."""
    _ops()  # the swapped forwards call its ops
    gen = torch.Generator().manual_seed(seed)
    done = Swapped()
    per_op = {op: (backends or {}).get(op, backend) for op in ("rms_norm", "swiglu", "rope", "loss")}
    rotary: dict = {}  # family module -> whether its apply_rotary_pos_emb was patched (a function: probed once)

    for module in model.modules():
        cls = type(module)
        if _looks_like_norm(module):  # every instance is probed: its eps, a per-instance flag, may differ
            found = _norm_offset(module, gen)
            if found is None:
                done.leave(module)
                continue
            module.forward = types.MethodType(_norm_forward(*found, per_op["rms_norm"]), module)
            done.counts["rms_norm"] += 1
        elif all(isinstance(getattr(module, n, None), nn.Linear) for n in ("w1", "w2", "w3")):  # built-in FFN
            module.forward = types.MethodType(_builtin_ffn_forward(per_op["swiglu"]), module)
            done.counts["swiglu"] += 1
        elif all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            forward = _hf_mlp_forward(per_op["swiglu"])
            if not _mlp_matches(module, ("gate_proj", "up_proj", "down_proj"), _hf_mlp_forward("eager"), gen):
                done.leave(module)
                continue
            module.forward = types.MethodType(forward, module)
            done.counts["swiglu"] += 1
        elif hasattr(module, "rope") and hasattr(module, "wq"):  # the built-in Attention
            _swap_builtin_rope(module, per_op["rope"])
            done.counts["rope"] += 1
        elif cls.__name__.endswith("Attention") and hasattr(module, "q_proj"):
            if cls.__module__ not in rotary:
                rotary[cls.__module__] = _patch_hf_rope(module, per_op["rope"], gen)
            patched = rotary[cls.__module__]
            if patched is False:
                done.leave(f"{cls.__name__}'s apply_rotary_pos_emb")
            elif patched:
                done.counts["rope"] += 1  # an attention module that now rotates with the op
    if fused_loss:
        _swap_loss(model, per_op["loss"], gen, done)
    return done


# ---- kernels=auto under compile: which ops to leave to inductor (trainyard/kernels/auto.py) ---------------


def op_shapes(model: nn.Module) -> OpShapes:
    """The shapes the ops would see in `model` (the first norm, MLP and attention found; meta is fine)."""
    hidden = ffn = q_heads = kv_heads = head_dim = None
    layout = "hf"
    for module in model.modules():
        if hidden is None and _looks_like_norm(module) and module.weight.dim() == 1:
            hidden = module.weight.shape[0]
        for gate in ("w1", "gate_proj"):
            if ffn is None and isinstance(getattr(module, gate, None), nn.Linear):
                ffn = getattr(module, gate).out_features
        for q, k in (("wq", "wk"), ("q_proj", "k_proj")):
            if head_dim is None and isinstance(getattr(module, q, None), nn.Linear) \
                    and isinstance(getattr(module, k, None), nn.Linear) and isinstance(getattr(module, "head_dim", None), int):
                head_dim = module.head_dim
                q_heads, kv_heads = getattr(module, q).out_features // head_dim, getattr(module, k).out_features // head_dim
                layout = "pairs" if q == "wq" else "hf"
    return _auto().OpShapes(hidden, ffn, q_heads, kv_heads, head_dim, layout)


def plan_backends(model: nn.Module, backend: str, *, compile: bool, device: torch.device,
                  dtype: torch.dtype | None) -> tuple[dict[str, Choice], dict[str, str]]:
    """Each op's backend for `transform(kernels=backend, compile=compile)` and the measurement's errors:
    with "auto", compile and a CUDA device, measured (auto.measure at the model's shapes, auto.decide);
    otherwise every op takes `backend` as before."""
    if backend != "auto" or not compile or device.type != "cuda":
        why = "not compiled" if not compile else "not measured off CUDA" if backend == "auto" else f"kernels={backend}"
        return _auto().unmeasured(backend, device, why), {}
    auto = _auto()
    times, errors = auto.measure(op_shapes(model), device, dtype or torch.float32)
    choices = auto.decide(times)
    choices["loss"] = auto.Choice("loss", "triton", why="not measured: outside the compiled blocks; saves memory")
    return choices, errors


def record_choices(choices: dict[str, Choice]) -> dict[str, dict]:
    """The choices as the job's metrics row keeps them (empty without kernels)."""
    return _auto().as_record(choices) if choices else {}


def describe_choices(backend: str, choices: dict[str, Choice], errors: dict[str, str]) -> str:
    """The tail of transform's `kernels (...)` line: each op's measured choice (kernels=auto under compile on
    CUDA), or for an unmeasured auto what it resolved to and why; nothing for an explicit backend."""
    if any(c.ours_ms is not None or c.compile_ms is not None for c in choices.values()):
        line = "; under compile: " + ", ".join(str(c) for c in choices.values())
        return line + (f"; measurement errors: {errors}" if errors else "")
    if backend == "auto" and choices:
        first = next(iter(choices.values()))
        return f"; auto: {first.backend} ({first.why})"
    return ""


def _swap_loss(model: nn.Module, backend: str, gen: torch.Generator, done: Swapped) -> None:
    if hasattr(model, "hidden") and isinstance(getattr(model, "output", None), nn.Linear):  # the built-in one
        maths: HeadMaths | str = HeadMaths() if model.output.bias is None else "its head has a bias"
    elif hasattr(model, "get_output_embeddings") and hasattr(model, "base_model_prefix"):
        maths = _hf_head_maths(model, gen)
    else:
        return
    if isinstance(maths, str):
        done.loss_note = f"{type(model).__name__}: {maths}"
        return
    model.forward = types.MethodType(_fused_loss_forward(model, backend, maths), model)
    done.counts["loss"] = 1
