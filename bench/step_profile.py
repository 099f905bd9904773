"""Where one training step's device time goes: the built-in trainer's own profiler (the contract's
`profilerconfig.json`) over one steady step, its trace summed by kernel and by kind, in one invocation per
configuration.

    python bench/step_profile.py [--model llama3.2-1b] [--seq-len 2048] [--only NAME,...] [--step 8] [--json PATH]

The configurations are bench/mfu.py's (micro-batch, compile, kernels, activation checkpointing), run as there:
`torchrun --nproc_per_node 1 -m trainyard.engine.train` in a fresh process. The trainer profiles step `--step`
(after the warm-up and compilation) and writes its Chrome trace; this reads it back and prints, per configuration,
the step's wall time, the summed GPU kernel time by kind (matrix products, attention, Triton kernels of inductor
and of trainyard.kernels, optimizer, elementwise, reductions, copies, NCCL) and the heaviest kernels. On CPU
(`--model 10m`, to try it) the trace has no kernels: the CPU operators are summed instead.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mfu import CONFIGS, train_one_gpu  # noqa: E402 - bench/ is not a package

# kind: a pattern of kernel names (first match wins; the order matters: inductor's Triton kernels are named
# triton_*, ours after their Python functions)
KINDS = [
    ("ours (trainyard.kernels)", r"_rms_norm_|_swiglu_|_rope_|_ce_|cross_entropy_kernel|_lce_"),
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attention|sdpa|_attn"),
    ("matrix products", r"gemm|xmma|cutlass|nvjet|cublas|sm\d+_|splitK|wgmma"),
    ("inductor (triton)", r"^triton_"),
    ("optimizer", r"multi_tensor|adam"),
    ("reductions", r"reduce|norm|softmax|sum_"),
    ("copies", r"memcpy|memset|copy|cat|CatArray"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.I):
            return kind
    return "other"


def summarize(trace_path: str, top: int = 15) -> dict:
    """Kernel (GPU) or operator (CPU) time of one profiled step, by kind and by name, in ms."""
    with open(trace_path) as fh:
        events = [e for e in json.load(fh).get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    source = "GPU kernels" if kernels else "CPU operators (top level)"
    if not kernels:  # CPU: the operators themselves, not the ones they call (no double counting)
        kernels = _top_level([e for e in events if e.get("cat") == "cpu_op"])
    spans = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "kernel", "python_function")]
    wall_us = (max(e["ts"] + e.get("dur", 0) for e in spans) - min(e["ts"] for e in spans)) if spans else 0
    by_kind, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for e in kernels:
        by_kind[kind_of(e["name"])] += e.get("dur", 0)
        by_name[e["name"]] += e.get("dur", 0)
        count[e["name"]] += 1
    busy = sum(by_kind.values())
    return {"source": source, "trace_wall_ms": wall_us / 1e3, "busy_ms": busy / 1e3,
            "by_kind_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:160], "ms": round(v / 1e3, 3), "calls": count[n], "kind": kind_of(n)}
                    for n, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]}


def _top_level(ops: list[dict]) -> list[dict]:
    """The operators not inside another one of the same thread."""
    out, ends = [], {}
    for e in sorted(ops, key=lambda e: (e.get("tid"), e["ts"], -e.get("dur", 0))):
        tid = e.get("tid")
        if e["ts"] >= ends.get(tid, -1):
            out.append(e)
            ends[tid] = e["ts"] + e.get("dur", 0)
    return out


def profile_one(name: str, args) -> dict:
    micro, compile_on, kernels, ac, dtype = CONFIGS[name]
    with tempfile.TemporaryDirectory() as cfg_dir:
        traces = os.path.join(cfg_dir, "traces")
        with open(os.path.join(cfg_dir, "profilerconfig.json"), "w") as fh:
            json.dump({"ProfilingParameters": {"LocalPath": traces}, "Steps": [args.step], "Ranks": [0]}, fh)
        rows, failure, _, wall = train_one_gpu(
            ["--model", args.model, "--steps", str(args.step + 1), "--seq_len", str(args.seq_len),
             "--global_batch_size", str(micro), "--micro_batch_size", str(micro), "--kernels", kernels,
             "--compile", str(compile_on).lower(), "--warmup_steps", "2", "--log_every", "4", "--dtype", dtype],
            port=args.port, timeout=args.timeout, ac=ac, env={"SM_INPUT_CONFIG_DIR": cfg_dir})
        if rows is None:
            return {"name": name, "failed": failure}
        found = [f for f in os.listdir(traces) if f.endswith(".pt.trace.json")] if os.path.isdir(traces) else []
        if not found:
            return {"name": name, "failed": f"no trace written under {traces}"}
        summary = summarize(os.path.join(traces, found[0]), args.top)
    step = next((r for r in rows if r["step"] == args.step), rows[-1])
    return {"name": name, "micro_batch": micro, "compile": compile_on, "kernels": kernels, "activation_checkpointing": ac,
            "dtype": dtype,
            "step": args.step, "step_time_s": step.get("step_time_s"), "mfu": step.get("mfu"), "wall_s": round(wall, 1),
            **summary}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--step", type=int, default=8, help="the step profiled (after warm-up and compilation)")
    p.add_argument("--only", default="compile mb8,compile+kernels mb8",
                   help="comma-separated configurations of bench/mfu.py: " + ", ".join(CONFIGS))
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--port", type=int, default=29521)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--only: unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    rows = []
    for name in names:
        row = profile_one(name, args)
        rows.append(row)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)) or ".", exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump({"name": "step_profile", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "model": args.model, "seq_len": args.seq_len, "rows": rows}, fh, indent=1)
        if "failed" in row:
            print(f"## {name}: failed\n{row['failed'][-3000:]}", flush=True)
            continue
        print(f"## {name}: step {row['step']} {row['step_time_s']:.3f} s (MFU {row['mfu'] or 0:.1%}), "
              f"{row['source']} {row['busy_ms']:.1f} ms of {row['trace_wall_ms']:.1f} ms traced", flush=True)
        print("| kind | ms | share of busy |\n| --- | --- | --- |")
        for kind, ms in row["by_kind_ms"].items():
            print(f"| {kind} | {ms:.2f} | {ms / max(row['busy_ms'], 1e-9):.1%} |")
        print("| kernel | kind | calls | ms |\n| --- | --- | --- | --- |")
        for t in row["top"]:
            print(f"| {t['name'][:90]} | {t['kind']} | {t['calls']} | {t['ms']:.2f} |", flush=True)
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
