"""One model, four layouts of 8 processes over 2 emulated hosts of 4: data parallel only, MiCS only,
tensor parallel 2 x MiCS, and pipeline 2 x tensor parallel 2 x MiCS.

    python bench/parallel3d.py [--mbit 1000] [--steps 4] [--model 10m] [--json PATH]

Every layout runs the built-in trainer through `Estimator` in this one invocation: fp32, global batch
16 sequences of 128 tokens, micro-batch 1. With `--mbit` (root only) each host gets its own network
namespace behind a link shaped to that rate, so inter-host traffic crosses a slower link; `--mbit 0`
runs the hosts on loopback. Per layout: tokens/s (median of the steps after the first), and from the
trainer's metrics of rank 0 the inter-host bytes it sends per step, split by mesh dimension, and its
model-state bytes (parameters, gradients, optimizer states).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from datetime import datetime, timezone

from trainyard.engine.components.fingerprint import this_machine

LAYOUTS = [  # name, distribution
    ("dp only", {"mics": {"partition_group_size": 1}}),
    ("MiCS p=4", {"mics": {"partition_group_size": 4}}),
    ("tp2 x MiCS p=2", {"tensor_parallel_degree": 2, "mics": {"partition_group_size": 2}}),
    ("pp2 x tp2 x MiCS p=2", {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                              "pipeline_schedule": "1f1b", "mics": {"partition_group_size": 2}}),
]
HOSTS, PPH, GLOBAL_BATCH, SEQ = 2, 4, 16, 128


def run(name: str, distribution: dict, a) -> dict:
    from trainyard import Estimator

    network = {"emulated_network": {"bandwidth_mbit": a.mbit}} if a.mbit else {}
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=HOSTS,
                    processes_per_host=PPH, max_run=1800, distribution=distribution,
                    hyperparameters={"model": a.model, "steps": a.steps, "global_batch_size": GLOBAL_BATCH,
                                     "micro_batch_size": 1, "seq_len": SEQ, "dtype": "float32", "save_model": False},
                    **network)
    est.fit(logs=False)
    m = est.latest_training_job.metrics()[1:]  # step 1 includes warm-up and the pipeline's shape inference
    last = m[-1]
    return {
        "name": name, "distribution": distribution,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in m),
        "inter_node_bytes_per_step": last["inter_node_bytes"],
        "intra_node_bytes_per_step": last["intra_node_bytes"],
        "inter_node_bytes_by_dim": {d: v["inter_bytes"] for d, v in last["comm_by_dim"].items() if v["inter_bytes"]},
        "model_state_bytes_per_rank": last["model_state_bytes"],
        "job": est.latest_training_job.name,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mbit", type=float, default=1000.0, help="link rate between hosts (root); 0: loopback")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", default="10m")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = [run(name, dist, a) for name, dist in LAYOUTS]
    link = f"{a.mbit:g} Mbit/s links" if a.mbit else "loopback"
    print(f"\n{HOSTS} hosts x {PPH} processes, {link}, model {a.model}, fp32, global batch {GLOBAL_BATCH} x {SEQ}")
    print(f"{'layout':<24}{'tokens/s':>10}{'inter MB':>10}{'intra MB':>10}{'state MB/rank':>15}  inter-host by dimension")
    for r in rows:
        dims = ", ".join(f"{d} {b / 1e6:.1f}" for d, b in r["inter_node_bytes_by_dim"].items()) or "-"
        print(f"{r['name']:<24}{r['tokens_per_s']:>10.0f}{r['inter_node_bytes_per_step'] / 1e6:>10.1f}"
              f"{r['intra_node_bytes_per_step'] / 1e6:>10.1f}{r['model_state_bytes_per_rank'] / 1e6:>15.1f}  {dims}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"name": "parallel3d", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "fingerprint": this_machine(), "machine": f"{platform.machine()}, {os.cpu_count()} cores", "mbit": a.mbit,
                       "model": a.model, "entries": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
