"""MFU of the built-in trainer on one GPU: Llama 3.2 1B shapes in bf16, eager against torch.compile and
trainyard.kernels, and the same in FP8 (torchao) and fp16 (dynamic loss scaling), in one invocation.

    python bench/mfu.py [--model llama3.2-1b] [--seq-len 2048] [--steps 12] [--only NAME,...] [--dtype D] [--json PATH]
    python bench/mfu.py --hf-config DIR ...      (a Hugging Face causal LM: DIR holds its config.json)

FP8 against bf16 on the 8B-shaped slice (`llama3-8b-4l`: Llama 3 8B's layer and full vocabulary, 4 layers, fits one
80 GB H100; an sm_89+ GPU and `pip install 'trainyard[fp8]'`):

    python bench/mfu.py --model llama3-8b-4l --only "eager,compile,eager fp8,compile fp8" --json bench/results/mfu-8b-fp8.json
    python bench/mfu.py --only "compile,compile fp16,compile fp8"          # llama3.2-1b: bf16, fp16, FP8

`--dtype` runs every chosen configuration in that dtype instead of its own (bfloat16, float16, float8, float32).

Each configuration is one run of `torchrun --nproc_per_node 1 -m trainyard.engine.train` in a fresh process:
one rank on an NCCL group of one (the path a job takes on a GPU host: rendezvous, FSDP2 with bf16 compute and
fp32 master weights and gradient reduction, the heartbeat's wrapped collectives), synthetic tokens, no
checkpoints, no model written. The figures are medians of the steps after the first three (warm-up and, with
compile, the compilation): tokens/s, TFLOP/s per GPU and MFU as the trainer computes them (6 N + 12 L H Q T
FLOPs per token over the GPU's dense bf16 datasheet peak, trainyard/engine/components/flops.py), and the peak
of allocated GPU memory. Also runs on CPU at a small model (`--model 10m`), to try it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

from trainyard.engine.components.fingerprint import this_machine

# name: (micro-batch, compile, kernels, activation checkpointing, dtype)
CONFIGS = {
    "eager": (4, False, "off", "none", "bfloat16"),
    "compile": (4, True, "off", "none", "bfloat16"),
    "compile+kernels mb8": (8, True, "auto", "none", "bfloat16"),
    "eager+kernels": (4, False, "auto", "none", "bfloat16"),
    "compile+kernels": (4, True, "auto", "none", "bfloat16"),
    "compile+kernels mb16 ac": (16, True, "auto", "selective", "bfloat16"),
    "compile mb8": (8, True, "off", "none", "bfloat16"),
    "compile+kernels mb12": (12, True, "auto", "none", "bfloat16"),
    "compile+kernels mb16": (16, True, "auto", "none", "bfloat16"),  # the best MFU measured (docs/benchmarks.md)
    "compile mb8 fp8": (8, True, "off", "none", "float8"),
    # FP8 Linear layers (torchao, dynamic tensorwise scaling; the head and the rest bf16): needs sm_89+. torchao's
    # casts are separate kernels in eager mode; compiled, inductor fuses them into the neighbouring ops
    "eager fp8": (4, False, "off", "none", "float8"),
    "compile fp8": (4, True, "off", "none", "float8"),
    # fp16 compute with dynamic loss scaling (skipped steps show in the losses' row as repeats of the scale)
    "eager fp16": (4, False, "off", "none", "float16"),
    "compile fp16": (4, True, "off", "none", "float16"),
}
DTYPES = ("bfloat16", "float16", "float8", "float32")
WARMUP_STEPS = 3


def train_one_gpu(hyperparameters: list[str], *, port: int, timeout: float, env: dict | None = None,
                  ac: str = "none", distribution: dict | None = None) -> tuple[list[dict] | None, str, list[str], float]:
    """`torchrun --nproc_per_node 1 -m trainyard.engine.train HYPERPARAMETERS` in a fresh process (synthetic tokens,
    no checkpoints, no model written, heartbeats on) under `distribution` with activation checkpointing `ac`:
    (its metrics rows or None, the rank's error when it failed, the heartbeat files written, wall seconds). Also
    bench/plan_check.py's runner."""
    with tempfile.TemporaryDirectory() as out:
        beats = os.path.join(out, "heartbeat")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(port),
               "-m", "trainyard.engine.train", "--save_model", "false", *hyperparameters]
        env = {**os.environ, **(env or {}), "SM_OUTPUT_DATA_DIR": out, "SM_MODEL_DIR": out,
               "TRAINYARD_HEARTBEAT_DIR": beats, "TRAINYARD_DISTRIBUTION": json.dumps({**(distribution or {}), "activation_checkpointing": ac})}
        env.pop("TRITON_INTERPRET", None)
        t0 = time.time()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.time() - t0
        if r.returncode != 0:
            text = r.stdout + r.stderr
            # the rank's own error (torchrun prefixes its lines with [rank0]:), not torchrun's summary after it
            mine = "\n".join(line for line in text.splitlines() if line.startswith("[rank0]:"))
            if mine:  # its last line (the exception: e.g. dtype float8 refused below sm_89) is the table's
                return None, mine[-6000:], [], wall
            start = text.rfind("Traceback (most recent call last)")
            return None, text[start:start + 6000] if start >= 0 else text[-6000:], [], wall
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        return rows, "", sorted(os.listdir(beats)) if os.path.isdir(beats) else [], wall


def one_run(name: str, args) -> dict:
    micro, compile_on, kernels, ac, dtype = CONFIGS[name]
    dtype = args.dtype or dtype
    # with --hf-config, the trainer's model hf reads the model channel's config.json (random weights)
    rows, failure, beat_files, wall = train_one_gpu(
        ["--model", "hf" if args.hf_config else args.model, "--steps", str(args.steps), "--seq_len", str(args.seq_len),
         "--global_batch_size", str(micro), "--micro_batch_size", str(micro), "--kernels", kernels,
         "--compile", str(compile_on).lower(), "--warmup_steps", "2", "--log_every", "4", "--dtype", dtype],
        port=args.port, timeout=args.timeout, ac=ac,
        env={"SM_CHANNEL_MODEL": os.path.abspath(args.hf_config)} if args.hf_config else None)
    if rows is None:
        return {"name": name, "failed": failure}
    steady = rows[WARMUP_STEPS:] or rows
    first = rows[0]

    def med(key):
        vals = [row[key] for row in steady if row.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {"name": name, "dtype": dtype, "micro_batch": micro, "compile": compile_on, "kernels": kernels,
            "activation_checkpointing": ac, "tokens_per_step": micro * args.seq_len,
            "tokens_per_s": med("tokens_per_s"), "tflops_per_device": med("tflops_per_device"), "mfu": med("mfu"),
            "step_time_s": med("step_time_s"), "first_step_s": first.get("step_time_s"),
            "peak_memory_gib": (max(row.get("peak_memory_bytes") or 0 for row in rows) / 2 ** 30),
            "losses": [round(row["loss"], 4) for row in rows], "wall_s": round(wall, 1),
            "skipped_steps": sum(1 for row in rows if row.get("skipped")),
            "heartbeat_files": beat_files, "fingerprint": first.get("fingerprint")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--hf-config", default=None, help="a folder with a Hugging Face config.json: train that model "
                   "(model hf) instead of --model")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--only", default="", help="comma-separated configuration names (default: all): "
                   + ", ".join(CONFIGS))
    p.add_argument("--dtype", choices=DTYPES, default=None, help="run every chosen configuration in this dtype "
                   "(default: each configuration's own)")
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--only: unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    rows = []

    def write():
        fp = next((r["fingerprint"] for r in rows if r.get("fingerprint")), None)
        result = {"name": "mfu", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "model": f"hf:{args.hf_config}" if args.hf_config else args.model, "seq_len": args.seq_len,
                  "steps": args.steps, "warmup_steps": WARMUP_STEPS,
                  "machine": this_machine(), "run_fingerprint": fp, "rows": rows}
        if args.json:  # after every configuration: a run stopped part-way keeps what it measured
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)

    print("| config | dtype | micro-batch x seq | tok/s | TFLOP/s | MFU | step s | first step s | peak GiB |", flush=True)
    print("|" + " --- |" * 9, flush=True)
    for name in names:
        row = one_run(name, args)
        rows.append(row)
        write()
        if "failed" in row:
            last = [line.removeprefix("[rank0]: ") for line in row["failed"].splitlines()
                    if line.strip() and not line.removeprefix("[rank0]: ").startswith(" ")]
            print(f"| {name} | failed: {(last or ['?'])[-1][:200]} |", flush=True)
            print(row["failed"], file=sys.stderr, flush=True)
            continue
        print(f"| {name} | {row['dtype']} | {row['micro_batch']} x {args.seq_len} | {row['tokens_per_s']:,.0f} | "
              f"{row['tflops_per_device']:.1f} | {row['mfu']:.1%} | {row['step_time_s']:.3f} | "
              f"{row['first_step_s']:.1f} | {row['peak_memory_gib']:.1f} |", flush=True)
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
