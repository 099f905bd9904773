"""Startup latency: `fit()` to the first training step, local 2 hosts x 2 processes, built-in trainer.

    python bench/startup.py [--repeats 3] [--model tiny] [--json PATH]

Phases per run (seconds from the call to `fit()`):
  fit_returned   checks, code packaging, job folder, supervisor started (fit(wait=False) returns)
  training       the supervisor has prepared the hosts and started the drivers (TrainingStartTime)
  first_step     step 1 is in metrics.jsonl (torch imports, rendezvous, model build, one step)
The embedded store is started once before the runs (a cold start of it is reported apart).
Goal: first_step <= 10 s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

from trainyard.engine.components.fingerprint import this_machine

GOAL_S = 10.0


def one_run(model: str) -> dict:
    from trainyard import Estimator

    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2, processes_per_host=2,
                    hyperparameters={"model": model, "steps": 2, "save_model": False}, max_run=300)
    t0 = time.time()
    job = est.fit(wait=False)
    fit_returned = time.time() - t0
    deadline = time.monotonic() + 240
    while not job.metrics():
        if job.status() != "InProgress" or time.monotonic() > deadline:
            raise RuntimeError(f"{job.name} ended or stalled before step 1:\n{job.log_text()[-2000:]}")
        time.sleep(0.02)
    first_step = time.time() - t0
    job.wait(logs=False)
    training = job.describe()["TrainingStartTime"].timestamp() - t0
    return {"fit_returned": fit_returned, "training": training, "first_step": first_step}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    from trainyard.sdk.store import ensure_store, stop_store

    stop_store()
    t = time.time()
    ensure_store()
    store_cold = time.time() - t
    runs = [one_run(a.model) for _ in range(a.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    rows = [("store cold start", store_cold)] + [(f"{k} (median of {len(runs)})", v) for k, v in med.items()]
    print(f"\nfit() to first step, local 2 hosts x 2 processes, model {a.model}, {os.cpu_count()} cores")
    print(f"{'phase':<32}{'seconds':>10}")
    for name, v in rows:
        print(f"{name:<32}{v:>10.3f}")
    verdict = "met" if med["first_step"] <= GOAL_S else "MISSED"
    print(f"goal first_step <= {GOAL_S:.0f} s: {verdict}")
    result = {
        "name": "startup", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "fingerprint": this_machine(), "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "model": a.model, "hosts": 2, "processes_per_host": 2, "store_cold_start_s": store_cold,
        "runs": runs, "median": med, "goal_s": GOAL_S, "goal_met": med["first_step"] <= GOAL_S,
    }
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
