"""MiCS against ZeRO-3 and HSDP on 2 emulated hosts x 2 processes, over both link speeds, in one invocation.

    python bench/mics.py [--mbit 1000,200] [--delay-ms 0.2] [--steps 8] [--warmup 3] [--model 10m] [--seq-len 128]
                         [--json bench/results/mics.json] [--only NAME,...]

Root only: every job runs through `Estimator(..., emulated_network=...)`, each host behind a shaped link.
fp32, global batch 16 of --seq-len (128) tokens, micro-batch 1, so 4 micro-batches per rank and step (accumulation 4).
For each link speed in turn, the rows (`ROWS`):

- `zero3`: the built-in trainer, model states sharded over all 4 ranks, flat collectives;
- `hsdp_flat`: built-in, partition groups of 2 (one per host), FSDP2's own cross-replica all-reduce on every
  micro-batch;
- `hsdp_2hop`: the strongest peer, bench/peers/hsdp_2hop.py: plain torch (FSDP2 HSDP over a 2-D mesh as
  torchtitan applies it), cross-replica all-reduce on the last micro-batch only. It shares only the model
  definition with Trainyard (same network, same initial values); its data is random tokens where the
  built-in trainer's is its synthetic sequences, so the losses differ;
- `mics_p2`: built-in MiCS, groups of 2, the default bucketed cross-replica sync overlapped with the backward;
- `mics_p2_compressed` / `mics_p2_bf16`: the same sync sending int8 (with error feedback) / bf16;
- `mics_p4_flat`: groups of 4 with flat collectives, at 2 x 2 the very layout of zero3: not run again, the
  row copies zero3's figures (`same_run_as`);
- `mics_p4_hier`: groups of 4, hierarchical all-gather / reduce-scatter (all-gather pipelined in 4 chunks);
  `mics_p4_hier_unpipelined` in 1 chunk; `mics_p4_hier_hpz` regathers in backward from the host's 2 ranks.

Per row: the median step time over the steps after the first `--warmup` (3) (the trainer's `step_time_s` metric, or the
peer's printed one), the medians of the trainer's compute / intra-host / inter-host communication seconds,
the inter- and intra-host bytes one rank sends per step (the trainer's comm meter; for the peer, which has no
meter, the formula's figure, `bytes_from: formula`), this rank's model-state bytes, the inter-host bytes of
docs/engine.md's formula, the final loss.

Goals, each a ratio of two rows of this invocation: mics_p2 <= 0.9 x hsdp_2hop at 200 Mbit/s and <= 1.0 x
at 1000; mics_p2_compressed <= 0.75 x hsdp_2hop at 200; mics_p2 <= 0.5 x zero3 at 1000; mics_p4_hier
<= 0.85 x mics_p4_flat at 200. A goal whose rows were left out (`--only`, `--mbit`) or failed is skipped.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
from datetime import datetime, timezone

from trainyard.engine.components.fingerprint import this_machine

HERE = os.path.dirname(os.path.abspath(__file__))
PPH, HOSTS, ACCUM, GLOBAL_BATCH = 2, 2, 4, 16
PEER = "peer"  # a row's runner: PEER (bench/peers/hsdp_2hop.py), the name of the row it copies, else built-in
ROWS = [  # name, mics settings (the peer's: the layout its formula figures assume), runner
    ("zero3", {"partition_group_size": 4, "hierarchical_allgather": False}, None),
    ("hsdp_flat", {"partition_group_size": 2, "two_hop_sync": False}, None),
    ("hsdp_2hop", {"partition_group_size": 2}, PEER),
    ("mics_p2", {"partition_group_size": 2}, None),
    ("mics_p2_compressed", {"partition_group_size": 2, "replica_compression": "int8"}, None),
    ("mics_p2_bf16", {"partition_group_size": 2, "replica_compression": "bf16"}, None),
    ("mics_p4_flat", {"partition_group_size": 4, "hierarchical_allgather": False}, "zero3"),
    ("mics_p4_hier", {"partition_group_size": 4, "hierarchical_allgather": True}, None),
    ("mics_p4_hier_unpipelined", {"partition_group_size": 4, "hierarchical_allgather": True,
                                  "hierarchical_chunks": 1}, None),
    ("mics_p4_hier_hpz", {"partition_group_size": 4, "hierarchical_allgather": True, "reshard_after_forward": 2},
     None),
]
GOALS = [  # row, reference row, link Mbit/s, limit of row / reference
    ("mics_p2", "hsdp_2hop", 200, 0.9),
    ("mics_p2", "hsdp_2hop", 1000, 1.0),
    ("mics_p2_compressed", "hsdp_2hop", 200, 0.75),
    ("mics_p2", "zero3", 1000, 0.5),
    ("mics_p4_hier", "mics_p4_flat", 200, 0.85),
]
PEER_METRICS = [{"Name": k, "Regex": rf"^(?=step=\d)(?:.* )?{k}=([-+0-9.eE]+)"}  # the peer's step lines
                for k in ("step", "step_time_s", "loss", "model_state_bytes")]


@functools.cache
def model_bytes(model: str) -> tuple[int, int, int]:
    """fp32 bytes of the whole model, of its blocks, of one block."""
    from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model

    m = build_model(MODEL_CONFIGS[model])
    size = lambda mod: sum(p.numel() for p in mod.parameters()) * 4  # noqa: E731
    return size(m), size(m.layers), size(next(iter(m.layers.values())))


def formula_bytes(model: str, mics: dict, *, last_block_regathered: bool = True) -> tuple[float, float]:
    """docs/engine.md: (inter-host, intra-host) bytes one rank sends per step, fp32, with the trainer's 4-byte
    loss all-reduce over the world. Per micro-batch the partition group all-gathers every parameter in forward
    (the root stays gathered for backward), the blocks again in backward (all but the last when
    `last_block_regathered` is False, as torchtitan shards; from groups of n ranks when reshard_after_forward
    is n), and reduce-scatters every gradient; the cross-replica sync sends once per step (two_hop_sync) or
    per micro-batch, exact (all-reduce) or compressed (all-gather of int8 plus a scale per 512 values, or bf16)."""
    total, blocks, block = model_bytes(model)
    n, p = PPH * HOSTS, mics["partition_group_size"]
    r = n // p
    regather = blocks if last_block_regathered else blocks - block
    hpz = mics.get("reshard_after_forward", True)
    hpz = hpz if not isinstance(hpz, bool) and hpz < p else None  # regather group size
    group = ACCUM * (2 * total + (0 if hpz else regather))  # bytes through the partition group's collectives
    inter = 2 * 4 * (n - 1) / n  # loss
    intra = ACCUM * regather * (hpz - 1) / hpz if hpz else 0.0  # hpZ regather inside a host (hpz <= PPH)
    if p <= PPH:
        intra += group * (p - 1) / p
    elif mics.get("hierarchical_allgather") is False:
        inter += group * (p - 1) / p
    else:  # k hosts x PPH ranks: the inter-host hop on 1/PPH of the data
        inter += group * (p // PPH - 1) / p
        intra += group * (PPH - 1) / PPH
    values = total / 4 / p  # of this rank's gradient shard
    compression = mics.get("replica_compression")
    if r == 1:
        replicas = 0.0
    elif compression == "int8":
        replicas = (r - 1) * (values + 4 * values / 512)
    elif compression == "bf16":
        replicas = (r - 1) * 2 * values
    else:
        replicas = 2 * (total / p) * (r - 1) / r * (1 if mics.get("two_hop_sync", True) else ACCUM)
    return inter + replicas, intra


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def run(name: str, mics: dict, runner: str | None, mbit: float, a) -> dict:
    """Train one row's job; its row of figures (with "error" when the job failed)."""
    from trainyard import Estimator

    peer = runner == PEER
    hp = {"model": a.model, "steps": a.steps, "global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1, "seq_len": a.seq_len}
    if peer:
        job = dict(entry_point="hsdp_2hop.py", source_dir=os.path.join(HERE, "peers"), hyperparameters=hp,
                   distribution={"torch_distributed": {"enabled": True}}, metric_definitions=PEER_METRICS)
    else:
        job = dict(entry_point="trainyard.engine.train", distribution={"mics": mics},
                   hyperparameters={**hp, "dtype": "float32", "save_model": False})
    inter_f, intra_f = formula_bytes(a.model, mics, last_block_regathered=not peer)
    row = {"name": name, "link_mbit": mbit, "distribution": job["distribution"],
           "formula_inter_node_bytes_per_step": inter_f}
    est = None
    try:
        est = Estimator(instance_type="local", instance_count=HOSTS, processes_per_host=PPH, max_run=1800,
                        emulated_network={"bandwidth_mbit": mbit, "delay_ms": a.delay_ms}, **job)
        est.fit(logs=False)
        steps = sorted((m for m in est.latest_training_job.metrics() if "step_time_s" in m), key=lambda m: m["step"])
        if not steps:
            raise RuntimeError("the job wrote no step metrics")
    except Exception as e:  # noqa: BLE001 - one failed job must not end the others
        print(f"{name} at {mbit:g} Mbit/s FAILED: {type(e).__name__}: {e}", flush=True)
        job_name = getattr(est and est.latest_training_job, "name", None)
        return {**row, "error": f"{type(e).__name__}: {e}", "job": job_name}
    later = steps[a.warmup:] or steps  # the first steps warm up (allocator, new groups' connections)
    row.update(step_time_s=median(later, "step_time_s"), step_times_s=[m["step_time_s"] for m in steps])
    if peer:
        row.update(compute_s=None, comm_intra_s=None, comm_inter_s=None, inter_node_bytes_per_step=inter_f,
                   intra_node_bytes_per_step=intra_f, bytes_from="formula")
    else:
        row.update({k: median(later, k) for k in ("compute_s", "comm_intra_s", "comm_inter_s")},
                   inter_node_bytes_per_step=median(later, "inter_node_bytes"),
                   intra_node_bytes_per_step=median(later, "intra_node_bytes"))
    row.update(model_state_bytes_per_rank=steps[-1]["model_state_bytes"], final_loss=steps[-1]["loss"],
               job=est.latest_training_job.name)
    return row


def print_table(mbit: float, rows: list[dict], a) -> None:
    by = {r["name"]: r for r in rows if "error" not in r}

    def ratio(r: dict, ref: str) -> str:
        return f"{r['step_time_s'] / by[ref]['step_time_s']:.2f}" if ref in by else "-"

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    print(f"\n2 hosts x 2 processes, {mbit:g} Mbit/s links ({a.delay_ms:g} ms), model {a.model}, "
          f"accumulation {ACCUM}, fp32, median of steps {a.warmup + 1}-{a.steps}")
    print(f"{'name':<26}{'step s':>8}{'x hsdp_2hop':>12}{'x zero3':>8}{'comp s':>8}{'intra s':>8}{'inter s':>8}"
          f"{'inter MB':>10}{'formula MB':>11}{'intra MB':>10}{'state MB':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<26}  FAILED: {r['error'][:100]}")
            continue
        mark = "*" if r.get("bytes_from") == "formula" else " "
        same = f"  (= {r['same_run_as']})" if "same_run_as" in r else ""
        print(f"{r['name']:<26}{r['step_time_s']:>8.2f}{ratio(r, 'hsdp_2hop'):>12}{ratio(r, 'zero3'):>8}"
              f"{num(r['compute_s']):>8}{num(r['comm_intra_s']):>8}{num(r['comm_inter_s']):>8}"
              f"{r['inter_node_bytes_per_step'] / 1e6:>9.1f}{mark}{r['formula_inter_node_bytes_per_step'] / 1e6:>11.1f}"
              f"{r['intra_node_bytes_per_step'] / 1e6:>9.1f}{mark}{r['model_state_bytes_per_rank'] / 1e6:>10.1f}{same}")
    if any(r.get("bytes_from") == "formula" for r in rows):
        print("* no comm meter in the peer: the formula's figure")


def goals(rows: list[dict]) -> list[dict]:
    """Evaluate GOALS on the rows there are; print each (met / MISSED / skipped)."""
    by = {(r["name"], r["link_mbit"]): r for r in rows}
    out = []
    print()
    for name, ref, mbit, limit in GOALS:
        label = f"{name} <= {limit:g} x {ref} at {mbit} Mbit/s"
        a, b = by.get((name, mbit)), by.get((ref, mbit))
        missing = [f"{n} {'failed' if r else 'not run'}" for n, r in ((name, a), (ref, b)) if r is None or "error" in r]
        if missing:
            print(f"goal {label}: skipped ({', '.join(missing)})")
            continue
        ratio = a["step_time_s"] / b["step_time_s"]
        met = ratio <= limit
        print(f"goal {label}: {ratio:.3f} ({'met' if met else 'MISSED'})")
        out.append({"name": label, "ratio": round(ratio, 4), "limit": limit, "met": met})
    return out


def main() -> int:
    names = [name for name, _, _ in ROWS]
    p = argparse.ArgumentParser()
    p.add_argument("--mbit", default="1000,200", help="link speeds in Mbit/s, comma-separated, run in this order")
    p.add_argument("--delay-ms", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    p.add_argument("--model", default="10m")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence: the compute per gradient byte")
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None, help=f"comma-separated rows of {names}")
    a = p.parse_args()
    links = [float(x) for x in a.mbit.split(",")]
    only = set(a.only.split(",")) if a.only else set(names)
    if only - set(names):
        p.error(f"--only: unknown row(s) {sorted(only - set(names))}; known: {names}")
    rows = []
    for mbit in links:
        done: dict[str, dict] = {}
        for name, mics, runner in ROWS:
            if name not in only:
                continue
            if runner not in (None, PEER):  # the very layout of an earlier row: copy its figures
                source = done.get(runner) or run(runner, mics, None, mbit, a)
                done[name] = {**source, "name": name, "same_run_as": runner}
            else:
                done[name] = run(name, mics, runner, mbit, a)
            rows.append(done[name])
        print_table(mbit, [r for r in rows if r["link_mbit"] == mbit], a)
    met = goals(rows)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"name": "mics", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "fingerprint": this_machine(), "machine": f"{platform.machine()}, {os.cpu_count()} cores", "delay_ms": a.delay_ms,
                       "model": a.model, "steps": a.steps, "warmup": a.warmup, "rows": rows, "goals": met}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
