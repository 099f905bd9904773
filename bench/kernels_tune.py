"""GPU sweep of the trainyard.kernels launch configurations, next to torch.compile and Liger-Kernel.

    python bench/kernels_tune.py --json $OUT/tune.json [--ops rms_norm,swiglu,rope,ce] [--repeats 10]
    python bench/kernels_tune.py --tiny            # CPU, Triton's interpreter, tiny shapes: the plumbing only

On one CUDA GPU, at Llama 3 8B's shapes (hidden 4096, SwiGLU 14336, 32 query / 8 key-value heads of 128,
vocab 128256, 8192 tokens, bf16), each op's candidate configurations (each module's `TUNING`, set for the
candidate's runs only) are timed forward + backward (CUDA events, the median of --repeats runs after 3
warm-ups), with their extra peak memory (above the inputs; the head's weight gradient preallocated, as under
gradient accumulation) and their largest error against the eager formula (relative to the largest magnitude
of each output and input gradient), next to eager, `torch.compile` of the eager formula, and Liger-Kernel's
op where it is installed (the same calls as bench/kernels.py). A candidate that fails is recorded with its
error; the sweep goes on.

    rms_norm    x (8192, 4096): fwd_rows, fwd/bwd warps, backward programs per SM (rmsnorm.TUNING)
    swiglu      a, b (8192, 14336): BLOCK and warps, forward and backward (swiglu.TUNING)
    rope        q (1, 32, 8192, 128), k (1, 8, 8192, 128), HF layout: q and k in one launch (joint) or two,
                warps, pairs per head tile (rope.TUNING)
    ce          hidden (8192, 4096), head (128256, 4096): chunk size, grad_weight in bf16 or float32, warps
                of the row kernel (cross_entropy.TUNING)

Then: the per-op choice kernels=auto would make under compile from these times (trainyard/kernels/auto.py:
the best candidate against compile), the acceptance figures (each op against the faster of compile and
Liger; the fused loss's extra memory against Liger's), and a compile check: `torch.compile(fullgraph=True)`
(inductor) of a small function through all four ops, its values and gradients against eager, and the graph
breaks torch._dynamo.explain counts. Written for torch >= 2.6 (triton_op) and Triton >= 3.2; the whole run
is sized for about two minutes on an H100.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository (trainyard) when run as a script

WARMUP = 3
LLAMA = {"hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128, "vocab": 128256, "tokens": 8192}
TINY = {"hidden": 48, "ffn": 96, "heads": 4, "kv_heads": 2, "head_dim": 8, "vocab": 300, "tokens": 24}
OPS = ("rms_norm", "swiglu", "rope", "ce")
EPS = 1e-5

# Candidates per op: (name, TUNING overrides). The first is the module's defaults.
CANDIDATES = {
    "rms_norm": [
        ("default", {}),
        ("warps 4", {"fwd_warps": 4, "bwd_warps": 4}),
        ("warps 16", {"fwd_warps": 16, "bwd_warps": 16}),
        ("bwd 2 waves", {"bwd_waves": 2}),
        ("bwd 4 waves, 4 warps", {"bwd_waves": 4, "bwd_warps": 4}),
        ("fwd 2 rows", {"fwd_rows": 2}),
    ],
    "swiglu": [
        ("default", {}),
        ("block 512", {"fwd_block": 512, "bwd_block": 512}),
        ("block 2048", {"fwd_block": 2048, "bwd_block": 2048}),
        ("block 2048, 8 warps", {"fwd_block": 2048, "fwd_warps": 8, "bwd_block": 2048, "bwd_warps": 8}),
        ("block 4096, 8 warps", {"fwd_block": 4096, "fwd_warps": 8, "bwd_block": 4096, "bwd_warps": 8}),
        ("block 4096, 16 warps", {"fwd_block": 4096, "fwd_warps": 16, "bwd_block": 4096, "bwd_warps": 16}),
    ],
    "rope": [
        ("default (joint)", {}),
        ("joint, 8 warps", {"warps": 8}),
        ("joint, 2 warps", {"warps": 2}),
        ("joint, 1024 pairs", {"pairs": 1024}),
        ("separate", {"joint": False}),
        ("separate, 8 warps", {"joint": False, "warps": 8}),
    ],
    "ce": [
        ("default", {}),
        ("chunk 256", {"chunk_size": 256}),
        ("chunk 512", {"chunk_size": 512}),
        ("chunk 2048", {"chunk_size": 2048}),
        ("fp32 grad_weight", {"accumulate": "float32"}),
        ("16 warps", {"warps": 16}),
    ],
}
MODULES = {"rms_norm": "trainyard.kernels.rmsnorm", "swiglu": "trainyard.kernels.swiglu",
           "rope": "trainyard.kernels.rope", "ce": "trainyard.kernels.cross_entropy"}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per candidate (median)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (the rows and the check)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes on CPU under TRITON_INTERPRET=1 (plumbing only: times mean nothing)")
    a = p.parse_args(argv)
    a.ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    bad = [o for o in a.ops if o not in OPS]
    if bad:
        p.error(f"--ops: unknown {bad}; use {', '.join(OPS)}")
    return a


# ---- inputs and implementations -------------------------------------------------------------------------

def make_inputs(op, shapes, device, dtype):
    """(inputs, output gradients or None, indices of preallocated input gradients) for one op."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    n, h, f, hd = shapes["tokens"], shapes["hidden"], shapes["ffn"], shapes["head_dim"]

    def rand(*shape, grad=True, scale=1.0):
        return (torch.randn(*shape, device=device, dtype=torch.float32, generator=g) * scale).to(dtype) \
            .requires_grad_(grad)

    if op == "rms_norm":
        return [rand(n, h), (1 + rand(h, grad=False) * 0.1).requires_grad_()], [rand(n, h, grad=False)], ()
    if op == "swiglu":
        return [rand(n, f), rand(n, f)], [rand(n, f, grad=False)], ()
    if op == "rope":
        q, k = rand(1, shapes["heads"], n, hd), rand(1, shapes["kv_heads"], n, hd)
        angles = torch.outer(torch.arange(n, device=device, dtype=torch.float32),
                             500000.0 ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        angles = torch.cat((angles, angles), -1)
        return [q, k, angles.cos().to(dtype), angles.sin().to(dtype)], \
            [rand(*q.shape, grad=False), rand(*k.shape, grad=False)], ()
    v = shapes["vocab"]
    return [rand(n, h), rand(v, h, scale=h ** -0.5), torch.randint(0, v, (n,), device=device, generator=g)], None, (1,)


def implementations(op, bench, compile_on):
    """name -> callable or a string saying why not: eager, compile, liger (bench/kernels.py's calls), ours."""
    import torch

    from trainyard import kernels

    eager = {"rms_norm": bench.rms_norm_eager, "swiglu": bench.swiglu_eager, "rope": bench.rope_eager,
             "ce": bench.flce_eager}[op]
    ours = {"rms_norm": lambda x, w: kernels.rms_norm(x, w, EPS, backend="triton"),
            "swiglu": lambda a, b: kernels.swiglu(a, b, backend="triton"),
            "rope": lambda q, k, c, s: kernels.apply_rope(q, k, c, s, layout="hf", backend="triton"),
            "ce": lambda h, w, t: kernels.fused_linear_cross_entropy(h, w, t, backend="triton")}[op]
    liger = bench.liger({"ce": "fused_linear_cross_entropy", "rope": "apply_rope"}.get(op, op))
    return {"eager": eager, "compile": torch.compile(eager) if compile_on else "off (--no-compile)",
            "liger": liger}, ours


# ---- measuring ----------------------------------------------------------------------------------------------

def fresh(tensors):
    return None if tensors is None else [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def reset(inputs, prealloc):
    import torch

    for i, t in enumerate(inputs):
        if t.requires_grad:
            t.grad = (torch.zeros_like(t) if t.grad is None else t.grad.zero_()) if i in prealloc else None


def step(fn, inputs, grads):
    import torch

    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, grads)
    return outs


def results(fn, inputs, grads, prealloc):
    """One forward + backward: outputs and input gradients in float32."""
    reset(inputs, prealloc)
    outs = step(fn, inputs, grads)
    return [o.detach().float() for o in outs] + [t.grad.detach().float() for t in inputs if t.requires_grad]


def max_rel_err(got, ref):
    return max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-30)) for g, r in zip(got, ref))


def timed(fn, inputs, grads, prealloc, repeats, cuda):
    """(median ms, extra peak MB): CUDA events and max_memory_allocated on a GPU, wall time on CPU."""
    import torch

    for _ in range(WARMUP):
        reset(inputs, prealloc)
        step(fn, inputs, grads)
    peak = None
    if cuda:
        reset(inputs, prealloc)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(fn, inputs, grads)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 1e6
    times = []
    for _ in range(repeats):
        reset(inputs, prealloc)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(fn, inputs, grads)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step(fn, inputs, grads)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), peak


@contextlib.contextmanager
def tuning(op, overrides):
    """The op's module TUNING with `overrides`, for the duration (restored afterwards)."""
    module = importlib.import_module(MODULES[op])
    saved = dict(module.TUNING)
    module.TUNING.clear()
    module.TUNING.update(overrides)
    try:
        yield
    finally:
        module.TUNING.clear()
        module.TUNING.update(saved)


def error_note(e: Exception) -> str:
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"failed: {type(e).__name__}: {first}"


def sweep_op(op, shapes, device, dtype, bench, args, say):
    import torch

    cuda = device == "cuda"
    pristine, pristine_grads, prealloc = make_inputs(op, shapes, device, dtype)
    baselines, ours = implementations(op, bench, not args.no_compile)
    rows = []
    ref = None
    try:
        ref = results(baselines["eager"], fresh(pristine), fresh(pristine_grads), prealloc)
    except Exception as e:
        say({"op": op, "impl": "eager", "note": f"reference {error_note(e)}"})
    runs = [(name, fn, None) for name, fn in baselines.items()] + \
        [(f"ours: {name}", ours, overrides) for name, overrides in CANDIDATES[op]]
    for name, fn, overrides in runs:
        row = {"op": op, "impl": name}
        if overrides is not None:
            row["tuning"] = overrides
        if isinstance(fn, str):
            row["note"] = fn
        else:
            t0 = time.perf_counter()
            try:
                with tuning(op, overrides or {}) if overrides is not None else contextlib.nullcontext():
                    if ref is not None:
                        row["max_rel_err"] = max_rel_err(results(fn, fresh(pristine), fresh(pristine_grads), prealloc),
                                                         ref)
                    row["ms"], row["peak_mb"] = timed(fn, fresh(pristine), fresh(pristine_grads), prealloc,
                                                      args.repeats, cuda)
            except Exception as e:  # one candidate failing must not end the sweep
                row["note"] = error_note(e)
                row["traceback"] = traceback.format_exc(limit=4)[-1500:]
            row["wall_s"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        say(row)
        if cuda:
            torch.cuda.empty_cache()
    return rows


# ---- summary ----------------------------------------------------------------------------------------------

def summarise(rows, ops):
    """Per op: the best candidate, compile, Liger, the auto choice under compile and the acceptance checks."""
    from trainyard.kernels import auto

    out = {}
    times = {}
    for op in ops:
        mine = [r for r in rows if r["op"] == op]
        cands = [r for r in mine if r["impl"].startswith("ours") and r.get("ms") is not None]
        best = min(cands, key=lambda r: r["ms"]) if cands else None
        get = {r["impl"]: r for r in mine}
        comp, liger = get.get("compile", {}).get("ms"), get.get("liger", {}).get("ms")
        rivals = [t for t in (comp, liger) if t is not None]
        s = {"best": best and best["impl"], "best_tuning": best and best.get("tuning"),
             "best_ms": best and best["ms"], "default_ms": get.get(f"ours: {CANDIDATES[op][0][0]}", {}).get("ms"),
             "compile_ms": comp, "liger_ms": liger,
             "time_goal_met": (best["ms"] <= min(rivals)) if best and rivals else None}
        if op == "ce":
            lp = get.get("liger", {}).get("peak_mb")
            dp = get.get(f"ours: {CANDIDATES[op][0][0]}", {}).get("peak_mb")
            s["default_peak_mb"], s["liger_peak_mb"] = dp, lp
            s["memory_vs_liger"] = dp / lp if dp and lp else None
            s["memory_goal_met"] = s["memory_vs_liger"] <= 1.2 if s["memory_vs_liger"] else None
        else:
            times[op] = (s["best_ms"], comp)
        out[op] = s
    choices = auto.decide({op: t for op, t in times.items() if t[0] is not None or t[1] is not None})
    for op, c in choices.items():
        out[op]["auto_under_compile"] = "ours" if c.backend == "triton" else "inductor"
    return out


def compile_check(device, dtype):
    """torch.compile(fullgraph=True) through all four ops (small shapes): graph breaks, values and gradients
    against eager. On CUDA with inductor; under --tiny with aot_eager (the interpreter's opaque ops)."""
    import torch

    from trainyard import kernels

    def block(x, w, gate, up, q, k, cos, sin, head, targets):
        h = kernels.rms_norm(x, w, 1e-6) + kernels.swiglu(gate, up)
        q, k = kernels.apply_rope(q, k, cos, sin, layout="pairs")
        return kernels.fused_linear_cross_entropy(h, head, targets) + q.float().square().mean() + \
            k.float().square().mean()

    g = torch.Generator(device=device).manual_seed(0)
    n, d, v = 64, 128, 1000

    def r(*s):
        return torch.randn(*s, device=device, generator=g).to(dtype)

    angles = torch.rand(n, 32, device=device, generator=g)
    args = [r(n, d), (1 + 0.1 * r(d)), r(n, d), r(n, d), r(1, n, 4, 64), r(1, n, 2, 64), angles.cos(), angles.sin(),
            r(v, d) * d ** -0.5, torch.randint(0, v, (n,), device=device, generator=g)]
    leaves = [0, 1, 2, 3, 4, 5, 8]
    backend = "inductor" if device == "cuda" else "aot_eager"
    out = {"backend": backend}
    try:
        torch._dynamo.reset()
        explain = torch._dynamo.explain(block)(*args)
        out["graph_breaks"], out["graphs"] = explain.graph_break_count, explain.graph_count
        ein = [a.clone().requires_grad_(i in leaves) for i, a in enumerate(args)]
        cin = [a.clone().requires_grad_(i in leaves) for i, a in enumerate(args)]
        want = block(*ein)
        want.backward()
        torch._dynamo.reset()
        got = torch.compile(block, backend=backend, fullgraph=True)(*cin)
        got.backward()
        out["max_rel_err"] = max_rel_err([got.detach().float()] + [cin[i].grad.float() for i in leaves],
                                         [want.detach().float()] + [ein[i].grad.float() for i in leaves])
        out["ok"] = out["graph_breaks"] == 0 and out["max_rel_err"] < 3e-2
    except Exception as e:
        out["note"] = error_note(e)
        out["traceback"] = traceback.format_exc(limit=6)[-2000:]
        out["ok"] = False
    return out


def fmt(row):
    ms = f"{row['ms']:.3f}" if row.get("ms") is not None else "-"
    mb = f"{row['peak_mb']:,.0f}" if row.get("peak_mb") is not None else "-"
    err = f"{row['max_rel_err']:.1e}" if row.get("max_rel_err") is not None else "-"
    return f"| {row['op']} | {row['impl']} | {ms} | {mb} | {err} | {row.get('note', '')} |"


def main(argv=None) -> int:
    args = parse(argv)
    if args.tiny:
        # before Triton is first imported: its own jitted library functions (tl.sum, ...) are made for the
        # interpreter only when the switch is on at that moment
        os.environ["TRITON_INTERPRET"] = "1"
        importlib.import_module("triton")
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("bench/kernels_tune.py needs a CUDA GPU (the sweep times Triton kernels with CUDA events); "
              "--tiny runs its plumbing on CPU under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    sys.path.insert(0, HERE)
    bench = importlib.import_module("kernels")  # bench/kernels.py: the eager formulas and Liger's calls
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # again: bench/kernels.py clears it; the ops read it per call
    device = "cuda" if cuda else "cpu"
    shapes = TINY if args.tiny else LLAMA
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.time()
    print(f"shapes {shapes}, {str(dtype).removeprefix('torch.')}, {device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if cuda else ' (interpreter: times mean nothing)'}",
          flush=True)
    print("| op | impl | fwd+bwd ms | extra peak MB | max rel err | note |\n|" + " --- |" * 6, flush=True)
    rows = []
    head = {"name": "kernels_tune", "device": device, "gpu": torch.cuda.get_device_name() if cuda else None,
            "torch": torch.__version__, "triton": getattr(importlib.import_module("triton"), "__version__", None),
            "shapes": shapes, "dtype": str(dtype), "repeats": args.repeats}
    for op in args.ops:
        rows += sweep_op(op, shapes, device, dtype, bench, args, lambda r: print(fmt(r), flush=True))
        write(args.json, {**head, "partial": True, "seconds": round(time.time() - t0, 1), "rows": rows})
    summary = summarise(rows, args.ops)
    print("\nsummary (ms, fwd+bwd):")
    for op, s in summary.items():
        extra = f", extra peak {s['default_peak_mb']} MB vs Liger {s['liger_peak_mb']} MB" if op == "ce" else ""
        print(f"  {op}: best {s['best']} {s['best_ms']}, default {s['default_ms']}, compile {s['compile_ms']}, "
              f"liger {s['liger_ms']}; goal met: {s['time_goal_met']}{extra}; auto under compile: "
              f"{s.get('auto_under_compile', 'ours (not measured)')}", flush=True)
    check = {"note": "skipped (--no-compile)"} if args.no_compile else compile_check(device, dtype)
    print(f"compile check: {json.dumps({k: v for k, v in check.items() if k != 'traceback'})}", flush=True)
    result = {**head, "seconds": round(time.time() - t0, 1), "rows": rows, "summary": summary,
              "compile_check": check}
    print(f"{result['seconds']:.0f} s")
    write(args.json, result)
    return 0


def write(path, result):
    """The results so far (after each op, "partial": true, so that a run cut short leaves what it measured)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
