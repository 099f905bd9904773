"""The planner (trainyard/job/plan) against the built-in trainer on this machine's first GPU: for each layout of
one GPU (micro-batch, activation checkpointing; bf16, eager), the plan's peak memory, model-state bytes and MFU
next to what the trainer's metrics report (`peak_memory_bytes`: torch.cuda.max_memory_allocated of a step).

    python bench/plan_check.py [--model llama3.2-1b] [--seq-len 2048] [--steps 4] [--offload] [--json PATH]

Each layout is one run of `torchrun --nproc_per_node 1 -m trainyard.engine.train` in a fresh process (synthetic
tokens, no checkpoints); figures are from its last step. The plan is for one H100 (p5.4xlarge): run it there.
`--offload` runs OFFLOAD_CASES instead: CPU offload (`mics.cpu_offload`) next to the same layout without it, with
the host memory the offloaded states take (the metrics' model-state bytes) and the step time against the plan's.
"""
from __future__ import annotations

import argparse
import json
import sys

from mfu import train_one_gpu  # bench/mfu.py, beside this file
from trainyard.job.plan import Layout, evaluate
from trainyard.job.plan.hardware import hardware
from trainyard.parallel.shapes import from_preset

CASES = [(2, "none", False), (4, "none", False), (4, "selective", False), (8, "full", False), (16, "full", False)]
# (micro-batch, checkpointing, CPU offload)
OFFLOAD_CASES = [(4, "none", True), (4, "none", False), (8, "full", True)]


def run(model: str, seq_len: int, steps: int, micro: int, ac: str, offload: bool, port: int) -> dict:
    rows, failure, _, _ = train_one_gpu(
        ["--model", model, "--steps", str(steps), "--seq_len", str(seq_len), "--global_batch_size", str(micro),
         "--micro_batch_size", str(micro), "--dtype", "bfloat16", "--warmup_steps", "1"], port=port, timeout=600, ac=ac,
        distribution={"mics": {"cpu_offload": True}} if offload else None)
    if rows is None:
        return {"failed": failure}
    last = rows[-1]
    return {"peak_bytes": max(row.get("peak_memory_bytes") or 0 for row in rows),
            "model_state_bytes": last["model_state_bytes"], "mfu": last["mfu"], "step_time_s": last["step_time_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--port", type=int, default=29521)
    p.add_argument("--offload", action="store_true", help="the CPU offload cases (OFFLOAD_CASES)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    shape, hw = from_preset(args.model), hardware("p5.4xlarge", 1)
    rows = []
    print("| micro-batch x seq | AC | offload | peak GPU GiB measured | planned | model states GiB measured | planned "
          "(GPU + host) | step s measured | planned | MFU measured | planned |", flush=True)
    print("|" + " --- |" * 11, flush=True)
    for micro, ac, offload in OFFLOAD_CASES if args.offload else CASES:
        layout = Layout(dp=1, partition_group_size=1, tp=1, pp=1, pipeline_schedule="none", virtual_stages=1,
                        micro_batch_size=micro, microbatches=1, activation_checkpointing=ac, precision="bf16",
                        cpu_offload=offload)
        planned = evaluate(shape, layout, seq_len=args.seq_len, global_batch_size=micro, hw=hw, instance_count=1)
        states = planned.memory.model_states + planned.memory.host
        got = run(args.model, args.seq_len, args.steps, micro, ac, offload, args.port)
        row = {"micro_batch": micro, "activation_checkpointing": ac, "cpu_offload": offload,
               "planned_peak_bytes": planned.memory.total, "planned_model_state_bytes": states,
               "planned_step_time_s": planned.time.step_s, "planned_mfu": planned.mfu, **got}
        rows.append(row)
        if "failed" in got:
            print(f"| {micro} x {args.seq_len} | {ac} | {offload} | failed |", flush=True)
            print(got["failed"], file=sys.stderr)
            continue
        g = 2 ** 30
        print(f"| {micro} x {args.seq_len} | {ac} | {'host' if offload else 'no'} | {got['peak_bytes'] / g:.1f} | "
              f"{planned.memory.total / g:.1f} | {got['model_state_bytes'] / g:.1f} | {states / g:.1f} | "
              f"{got['step_time_s']:.2f} | {planned.time.step_s:.2f} | {got['mfu']:.1%} | {planned.mfu:.1%} |",
              flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"model": args.model, "seq_len": args.seq_len, "rows": rows}, fh, indent=1)
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
