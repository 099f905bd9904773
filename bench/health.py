"""What the job-health checks cost against a training step: the data-corruption check (each rank's digest of its
parameter shards, compared across the replicas) and the straggler check (an all-gather of each rank's recent
compute times), on 4 processes (gloo, CPU), the built-in model under MiCS partition groups of 1 (4 replicas).

    python bench/health.py [--model 10m] [--steps 8] [--seq-len 256] [--json bench/results/health.json]

Per model: the median step (forward, backward, optimizer), the median of each check, and the check's share of the
training time at its default interval (`sdc_check_every` 100, `straggler_check_every` 10: the check's time over
interval x step). Goal (issue 35): the data-corruption check at most 1% at its default interval.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

SDC_EVERY, STRAGGLER_EVERY = 100, 10
GOAL = 0.01


def worker(model_name: str, steps: int, seq_len: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import trainyard.engine as te
    from trainyard.engine.components.data import SyntheticSource
    from trainyard.engine.components.process_exit import exit_now
    from trainyard.engine.components.sdc import SdcCheck
    from trainyard.engine.components.stragglers import Detector, StragglerWatch
    from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model
    from trainyard.engine.trainer import token_loss

    te.init({"mics": {"partition_group_size": 1}})
    model = te.transform(build_model(MODEL_CONFIGS[model_name]), seed=0)
    dims = te.api._layout(model).dims
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    source = SyntheticSource(seed=0, global_batch_size=8, seq_len=seq_len, vocab_size=MODEL_CONFIGS[model_name].vocab_size)
    step_s, sdc_s, gather_s = [], [], []
    sdc = SdcCheck(dims.replicate_groups(), ["algo-1"] * dims.world_size, torch.device("cpu"))
    watch = StragglerWatch(Detector(stages=[0] * dims.world_size, hosts=["algo-1"] * dims.world_size),
                           every=1, warmup=0)
    for step in range(1, steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        rows = te.rows(model, source.global_batch(step))
        te.forward_backward(model, rows[:, :-1], rows[:, 1:], token_loss)
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - t0)
        dist.barrier()
        t1 = time.perf_counter()
        sdc.check(model, step)
        sdc_s.append(time.perf_counter() - t1)
        dist.barrier()
        t2 = time.perf_counter()
        watch.record(step, step_s[-1])  # every=1: one gather per call, as the trainer's every 10 steps
        gather_s.append(time.perf_counter() - t2)
    figures = {k: statistics.median(v[1:]) for k, v in (("step_s", step_s), ("sdc_check_s", sdc_s),
                                                         ("straggler_gather_s", gather_s))}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, figures)
    if dist.get_rank() == 0:
        worst = {k: max(f[k] for f in everyone) for k in figures}
        worst["parameters"] = sum(p.numel() for p in build_model(MODEL_CONFIGS[model_name]).parameters())
        with open(out, "w") as fh:
            json.dump(worst, fh)
    te.finish()
    exit_now(0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="10m")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.model, a.steps, a.seq_len, a.worker)
        return 0
    rows = []
    for model in a.model.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "figures.json")
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", __file__,
                            "--model", model, "--steps", str(a.steps), "--seq-len", str(a.seq_len), "--worker", out],
                           check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=1800)
            with open(out) as fh:
                f = json.load(fh)
        f["model"] = model
        f["sdc_share"] = f["sdc_check_s"] / (SDC_EVERY * f["step_s"])
        f["straggler_share"] = f["straggler_gather_s"] / (STRAGGLER_EVERY * f["step_s"])
        rows.append(f)
    print("| model | parameters | step s | data-corruption check s | share at every 100 | straggler gather s | "
          "share at every 10 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for f in rows:
        print(f"| {f['model']} | {f['parameters'] / 1e6:.1f}M | {f['step_s']:.3f} | {f['sdc_check_s']:.4f} | "
              f"{100 * f['sdc_share']:.3f}% | {f['straggler_gather_s']:.4f} | {100 * f['straggler_share']:.3f}% |")
    ok = all(f["sdc_share"] <= GOAL for f in rows)
    print(f"goal: the data-corruption check <= {100 * GOAL:g}% of the training time at its default interval: "
          f"{'met' if ok else 'NOT met'}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"date": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
                       "processes": 4, "seq_len": a.seq_len, "rows": rows}, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
