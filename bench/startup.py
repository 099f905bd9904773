"""Startup latency: `fit()` to the first training step, local 2 hosts x 2 processes, built-in trainer.

    python bench/startup.py [--repeats 3] [--model tiny] [--image REF|build] [--json PATH]

Phases per run (seconds from the call to `fit()`):
  fit_returned   checks, code packaging, job folder, supervisor started (fit(wait=False) returns)
  training       the supervisor has prepared the hosts and started the drivers (TrainingStartTime)
  first_step     step 1 is in metrics.jsonl (torch imports, rendezvous, model build, one step)
The runs use a Trainyard home of their own (a temporary folder, removed at the end): the user's embedded store
keeps running and their job list gets nothing. That home's store is started once before the runs (its cold start
is reported apart) and stopped at the end.
`--image`: the same job also with each host in a container of the CPU image (`image_uri`; `build` builds it from
this checkout first, `trainyard image build --variant cpu`), the runs alternating so both see the same machine.
Goal: first_step <= 10 s (as processes).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

from trainyard.engine.components.fingerprint import this_machine

GOAL_S = 10.0


def one_run(model: str, image: str | None = None) -> dict:
    from trainyard import Estimator

    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2, processes_per_host=2,
                    hyperparameters={"model": model, "steps": 2, "save_model": False}, max_run=300,
                    **({"image_uri": image} if image else {}))
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
    p.add_argument("--image", default=None, help="an image reference, or 'build' to build the CPU image first")
    a = p.parse_args()
    image, build_s = a.image, None
    if image == "build":
        from trainyard.sdk.image import build

        t = time.time()
        image = build(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), variant="cpu")
        build_s = time.time() - t

    home = tempfile.mkdtemp(prefix="trainyard-bench-home-")
    os.environ["TRAINYARD_HOME"] = home
    os.environ.pop("AWS_ENDPOINT_URL", None)  # this home's embedded store, whatever the shell points at
    from trainyard.sdk.store import ensure_store, stop_store

    runs, image_runs = [], []
    try:
        t = time.time()
        ensure_store()
        store_cold = time.time() - t
        for _ in range(a.repeats):
            runs.append(one_run(a.model))
            if image:
                image_runs.append(one_run(a.model, image))
    finally:
        stop_store()
        shutil.rmtree(home, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    rows = [("store cold start", store_cold)] + [(f"{k} (median of {len(runs)})", v) for k, v in med.items()]
    image_med = {k: statistics.median(r[k] for r in image_runs) for k in image_runs[0]} if image_runs else None
    if image_med:
        if build_s is not None:
            rows.append(("image build (this run)", build_s))
        rows += [(f"in the image: {k}", v) for k, v in image_med.items()]
    print(f"\nfit() to first step, local 2 hosts x 2 processes, model {a.model}, {os.cpu_count()} cores")
    print(f"{'phase':<36}{'seconds':>10}")
    for name, v in rows:
        print(f"{name:<36}{v:>10.3f}")
    verdict = "met" if med["first_step"] <= GOAL_S else "MISSED"
    print(f"goal first_step <= {GOAL_S:.0f} s: {verdict}")
    result = {
        "name": "startup", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "fingerprint": this_machine(), "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "model": a.model, "hosts": 2, "processes_per_host": 2, "store_cold_start_s": store_cold,
        "runs": runs, "median": med, "goal_s": GOAL_S, "goal_met": med["first_step"] <= GOAL_S,
    }
    if image_med:
        result.update({"image": image, "image_build_s": build_s, "image_runs": image_runs, "image_median": image_med})
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
