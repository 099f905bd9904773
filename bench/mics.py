"""MiCS against ZeRO-3 and flat HSDP on 2 emulated hosts x 2 processes with a shaped link.

    python bench/mics.py [--mbit 1000] [--delay-ms 0.2] [--steps 4] [--model 10m] [--json PATH]

Every configuration runs the built-in trainer through `Estimator(..., emulated_network=...)` (root only)
in this one invocation: fp32, global batch 16, micro-batch 1, so 4 micro-batches per step (gradient
accumulation 4). Per configuration: the median step time over the steps after the first, and from
the trainer's metrics the inter-host and intra-host bytes one rank sends per step and its model-state
bytes; `formula_inter_node_bytes_per_step` is the same figure from docs/engine.md.
Goal: MiCS step time <= 0.6 x ZeRO-3 and <= 1.0 x flat HSDP; inter-host bytes at the formula.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from datetime import datetime, timezone

CONFIGS = [  # name, mics settings
    ("zero3", {"partition_group_size": 4, "hierarchical_allgather": False}),
    ("hsdp-flat", {"partition_group_size": 2, "two_hop_sync": False}),
    ("mics", {"partition_group_size": 2}),
    ("mics-p4-hierarchical", {"partition_group_size": 4, "hierarchical_allgather": True}),
]
PPH, HOSTS, ACCUM, GLOBAL_BATCH = 2, 2, 4, 16


def formula_inter(model: str, mics: dict) -> float:
    """docs/engine.md: inter-host bytes one rank sends per step (fp32; plus the trainer's 4-byte loss
    all-reduce over the world)."""
    from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model

    m = build_model(MODEL_CONFIGS[model])
    total = sum(p.numel() for p in m.parameters()) * 4
    blocks = sum(p.numel() for p in m.layers.parameters()) * 4
    n, p = PPH * HOSTS, mics["partition_group_size"]
    r = n // p
    volume = ACCUM * (2 * blocks + (total - blocks) + total)
    replicas = 2 * (total / p) * (r - 1) / r * (1 if mics.get("two_hop_sync", True) else ACCUM)
    loss = 2 * 4 * (n - 1) / n
    if p <= PPH:
        return replicas + loss
    if not mics.get("hierarchical_allgather"):
        return volume * (p - 1) / p + replicas + loss
    return volume * (p // PPH - 1) / p + replicas + loss


def run(name: str, mics: dict, a) -> dict:
    from trainyard import Estimator

    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=HOSTS,
                    processes_per_host=PPH, max_run=1800,
                    hyperparameters={"model": a.model, "steps": a.steps, "global_batch_size": GLOBAL_BATCH,
                                     "micro_batch_size": 1, "seq_len": 128, "dtype": "float32", "save_model": False},
                    distribution={"mics": mics}, emulated_network={"bandwidth_mbit": a.mbit, "delay_ms": a.delay_ms})
    est.fit(logs=False)
    m = est.latest_training_job.metrics()[1:]  # step 1 includes warm-up
    tokens = GLOBAL_BATCH * 128
    return {
        "name": name, "mics": mics,
        "step_time_s": statistics.median(tokens / r["tokens_per_s"] for r in m),
        "inter_node_bytes_per_step": m[-1]["inter_node_bytes"],
        "intra_node_bytes_per_step": m[-1]["intra_node_bytes"],
        "model_state_bytes_per_rank": m[-1]["model_state_bytes"],
        "formula_inter_node_bytes_per_step": formula_inter(a.model, mics),
        "job": est.latest_training_job.name,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mbit", type=float, default=1000.0)
    p.add_argument("--delay-ms", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", default="10m")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = [run(name, mics, a) for name, mics in CONFIGS]
    base = {r["name"]: r["step_time_s"] for r in rows}
    print(f"\n2 hosts x 2 processes, {a.mbit:g} Mbit/s links, model {a.model}, accumulation {ACCUM}, fp32")
    print(f"{'config':<22}{'step s':>8}{'vs zero3':>9}{'inter MB':>10}{'formula MB':>11}{'intra MB':>10}{'state MB':>10}")
    for r in rows:
        print(f"{r['name']:<22}{r['step_time_s']:>8.2f}{r['step_time_s'] / base['zero3']:>9.2f}"
              f"{r['inter_node_bytes_per_step'] / 1e6:>10.1f}{r['formula_inter_node_bytes_per_step'] / 1e6:>11.1f}"
              f"{r['intra_node_bytes_per_step'] / 1e6:>10.1f}{r['model_state_bytes_per_rank'] / 1e6:>10.1f}")
    mics_t = base["mics"]
    print(f"goal MiCS <= 0.6 x ZeRO-3: {mics_t / base['zero3']:.2f} "
          f"({'met' if mics_t <= 0.6 * base['zero3'] else 'MISSED'}); "
          f"MiCS <= 1.0 x flat HSDP: {mics_t / base['hsdp-flat']:.2f} "
          f"({'met' if mics_t <= base['hsdp-flat'] else 'MISSED'})")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"name": "mics", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores", "mbit": a.mbit,
                       "delay_ms": a.delay_ms, "model": a.model, "configs": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
