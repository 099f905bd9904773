"""`kernels="auto"` under torch.compile: per op, our Triton kernel or inductor's compilation of the op's eager
reference, whichever a measurement on the job's own GPU at the model's shapes finds faster.

Why: inside a compiled block inductor generates its own kernels for the norms, the SwiGLU gate and the
rotation, and fuses them with their neighbours; where its version is faster than ours, swapping ours in makes
the compiled model slower (the 1B model at equal batch: 39.5% MFU compiled, 32.2% compiled with every op
swapped). So `transform(model, kernels="auto", compile=True)` on CUDA first times each op forward + backward
(`measure`: ours against `torch.compile` of the reference, CUDA events, the median of a few runs after warm-up)
and `decide` keeps ours only where it is faster by more than `MARGIN`; the other ops are swapped to their eager
reference, which the compiled block hands to inductor. A tie goes to inductor: in the model it may also fuse
the op with its neighbours, which the isolated timing cannot see.

    op          shapes timed (tokens = TOKENS)                               left to inductor means
    rms_norm    x (tokens, hidden)                                           rms_norm_reference
    swiglu      a, b (tokens, ffn)                                           silu(a) * b
    rope        q (1, tokens, q heads, head_dim), k with kv heads,          rope_reference, in the model's
                in the model's layout                                        layout
The fused loss is not measured: it runs after the model's last block, outside the compiled regions, and what
it saves is memory (the logits never whole); it stays ours.

Without compile, or off CUDA, nothing is measured: "auto" is what it always was (dispatch.choose: Triton on
CUDA and under TRITON_INTERPRET=1, the eager reference elsewhere). Every decision, measured or not, is a
`Choice`; the engine prints them at transform and the built-in trainer writes them into the job's first metrics
row (`kernels`).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from trainyard.kernels import dispatch
from trainyard.kernels.rmsnorm import rms_norm, rms_norm_reference
from trainyard.kernels.rope import apply_rope
from trainyard.kernels.swiglu import swiglu, swiglu_reference

MEASURED_OPS = ("rms_norm", "swiglu", "rope")
# ours is kept only when faster than compile's by more than this fraction
MARGIN = 0.05
# tokens of the timed shapes (transform does not know the batch; the ops' times scale with tokens alike)
TOKENS = 4096
EPS = 1e-5


@dataclass(frozen=True)
class Choice:
    """One op's implementation: backend "triton" (ours) or "eager" (the eager reference: inductor's, when the
    block is compiled), the times behind it (ms, forward + backward; None: not measured or failed) and why."""

    op: str
    backend: str
    ours_ms: float | None = None
    compile_ms: float | None = None
    why: str = ""

    def __str__(self) -> str:
        name = "ours" if self.backend == "triton" else "inductor" if self.compile_ms is not None else self.backend
        times = f" (ours {_ms(self.ours_ms)}, compile {_ms(self.compile_ms)})" \
            if self.ours_ms is not None or self.compile_ms is not None else ""
        return f"{self.op} {name}{times}" + (f": {self.why}" if self.why and not times else "")


def _ms(v: float | None) -> str:
    return "failed" if v is None else f"{v:.3f} ms"


def decide(times: dict[str, tuple[float | None, float | None]], *, margin: float = MARGIN) -> dict[str, Choice]:
    """The per-op choice from measured forward + backward times: `times[op] = (ours_ms, compile_ms)`, None for
    a run that failed. Ours where it is faster than compile's by more than `margin` (a fraction), or where
    compile's failed; else the eager reference (which inductor compiles). Both failed: the eager reference."""
    out = {}
    for op, (ours, comp) in times.items():
        if ours is None:
            backend, why = "eager", "ours failed"
        elif comp is None:
            backend, why = "triton", "compile failed"
        elif ours < comp * (1 - margin):
            backend, why = "triton", f"ours faster by more than {margin:.0%}"
        else:
            backend, why = "eager", f"compile within {margin:.0%} of ours or faster"
        out[op] = Choice(op, backend, ours, comp, why)
    return out


def unmeasured(backend: str, device: torch.device, why: str) -> dict[str, Choice]:
    """The choices without a measurement: every op takes `backend` as dispatch resolves it on `device`."""
    resolved = backend
    if backend == "auto":  # as dispatch.choose("auto", a tensor on `device`)
        resolved = "triton" if dispatch.triton_runs_on_device(device) else "eager"
    return {op: Choice(op, resolved, why=why) for op in (*MEASURED_OPS, "loss")}


def as_record(choices: dict[str, Choice]) -> dict[str, dict]:
    """The choices as plain data (the job's metrics row)."""
    return {op: {k: v for k, v in asdict(c).items() if k != "op"} for op, c in choices.items()}


# ---- measuring ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpShapes:
    """The model's shapes the ops see: hidden (norms), ffn (SwiGLU), q heads, kv heads, head_dim (RoPE) and
    the rotary layout ("hf" or "pairs"); None where the model has no such module."""

    hidden: int | None = None
    ffn: int | None = None
    q_heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    rope_layout: str = "hf"


def time_fwd_bwd(fn: Callable, inputs: list, grads: list | None, *, repeats: int = 5, warmup: int = 2) -> float:
    """Median forward + backward milliseconds of `fn(*inputs)` on CUDA (CUDA events), after `warmup` runs;
    `grads`: the outputs' gradients (None: a scalar output). Input gradients are reset between runs."""
    def step():
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.grad = None
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cases(shapes: OpShapes, device, dtype, tokens: int = TOKENS) -> dict[str, tuple[Callable, Callable, Callable]]:
    """Per measurable op of the model: (ours, reference, make) with make() -> (inputs, output gradients)."""
    def rand(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    out = {}
    if shapes.hidden:
        h = shapes.hidden
        out["rms_norm"] = (lambda x, w: rms_norm(x, w, EPS, backend="triton"),
                           lambda x, w: rms_norm_reference(x, w, EPS),
                           lambda: ([rand(tokens, h), rand(h)], [torch.ones(tokens, h, device=device, dtype=dtype)]))
    if shapes.ffn:
        f = shapes.ffn
        out["swiglu"] = (lambda a, b: swiglu(a, b, backend="triton"), swiglu_reference,
                         lambda: ([rand(tokens, f), rand(tokens, f)], [torch.ones(tokens, f, device=device, dtype=dtype)]))
    if shapes.q_heads and shapes.kv_heads and shapes.head_dim:
        layout, hq, hk, d = shapes.rope_layout, shapes.q_heads, shapes.kv_heads, shapes.head_dim

        def make():
            angles = torch.rand(tokens, d // 2, device=device) * 6.0
            if layout == "hf":
                q, k = rand(1, hq, tokens, d), rand(1, hk, tokens, d)
                angles = torch.cat((angles, angles), -1)[None]
            else:
                q, k = rand(1, tokens, hq, d), rand(1, tokens, hk, d)
            return [q, k, angles.cos().to(dtype), angles.sin().to(dtype)], [torch.ones_like(q), torch.ones_like(k)]

        out["rope"] = (lambda q, k, c, s: apply_rope(q, k, c, s, layout=layout, backend="triton"),
                       lambda q, k, c, s: apply_rope(q, k, c, s, layout=layout, backend="eager"), make)
    return out


def measure(shapes: OpShapes, device, dtype, *, tokens: int = TOKENS,
            repeats: int = 5) -> tuple[dict[str, tuple[float | None, float | None]], dict[str, str]]:
    """({op: (ours_ms, compile_ms)}, {op: error}) on `device` (CUDA) at the model's shapes; a run that raises
    gives None (and its error), never an exception."""
    times, errors = {}, {}
    for op, (ours, reference, make) in cases(shapes, device, dtype, tokens).items():
        pair = []
        for name, fn in (("ours", ours), ("compile", torch.compile(reference))):
            try:
                inputs, grads = make()
                pair.append(time_fwd_bwd(fn, inputs, grads, repeats=repeats))
            except Exception as e:  # one op's failure decides that op, not the job
                pair.append(None)
                errors[f"{op} {name}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        times[op] = (pair[0], pair[1])
    return times, errors
