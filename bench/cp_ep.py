"""Context and expert parallelism on emulated hosts, in one invocation: memory per rank, step time and traffic.

    python bench/cp_ep.py [--seq-len 2048] [--steps 5] [--warmup 2] [--json bench/results/cp_ep.json]

Each part launches this file under torchrun as 2 host agents of 2 processes (static rendezvous on loopback,
gloo, fp32) and runs its rows one after the other in the same processes, through the engine's public API.

- Context parallelism, the built-in model at --seq-len tokens (dim 128, 2 layers, 4 heads of 32, 2 key/value
  heads), a global batch of 4 sequences, micro-batches of 1 sequence: `cp1` (4 data-parallel ranks, ZeRO-3),
  `cp2` and `cp4` (the sequence split over 2 or 4 ranks; cp x tp must divide a host, so `cp4` runs on 1 host x 4).
  Per row: the bytes one rank's forward of a micro-batch saves for backward (its activations, counted by a
  saved-tensors hook over unique storages), the median step time, and the ring's point-to-point bytes per rank
  and step against the formula of docs/engine.md (2 (cp - 1) KV + cp G per layer and micro-batch).
- Expert parallelism, a mixture of 8 experts (top 2, width 256, dim 128, 2 layers) at 512 tokens, a global batch of
  8 sequences (2 micro-batches of 1 per rank): `ep1_p1` (every rank holds every expert: MiCS groups of 1),
  `ep2_p1`, `ep4_p1` (the experts spread over 2 or 4 ranks), and `ep1_p4` / `ep2_p2` with the rest sharded. Per
  row: the model-state bytes one rank holds (parameters, gradients and AdamW states), the median step time, and
  the all-to-all bytes per rank and step against what uniform routing would send (each assignment goes to
  another rank with probability (ep - 1) / ep: 2 x 2 x T x top_k x (ep - 1) / ep x dim x 4 bytes per layer and
  micro-batch, forward and backward, plus the count exchange), so the ratio shows the routing's imbalance.

Prints one table per part and writes the rows, the date and the machine to --json. No goal is checked: the rows
are the figures docs/engine.md quotes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

HERE = os.path.abspath(__file__)
CP_ROWS = [("cp1", 1, 2, 2), ("cp2", 2, 2, 2), ("cp4", 4, 1, 4)]  # name, cp, hosts, processes per host
EP_ROWS = [("ep1_p1", 1, 1), ("ep2_p1", 2, 1), ("ep4_p1", 4, 1), ("ep1_p4", 1, 4), ("ep2_p2", 2, 2)]  # name, ep, p
DIM, LAYERS, KV_HEADS, HEAD_DIM = 128, 2, 2, 32
EP_SEQ, EXPERTS, TOP_K = 512, 8, 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(part: str, rows: list, args, hosts: int, pph: int) -> dict:
    """This file's worker for `rows` under `hosts` torchrun agents of `pph` processes; the JSON rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out, port = os.path.join(tmp, "out.json"), _free_port()
        job = json.dumps({"part": part, "rows": rows, "seq_len": args.seq_len, "steps": args.steps,
                          "warmup": args.warmup})
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        logs = [open(os.path.join(tmp, f"agent{n}.log"), "w+") for n in range(hosts)]
        agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts),
                                    "--node-rank", str(n), "--nproc-per-node", str(pph), "--master-addr", "127.0.0.1",
                                    "--master-port", str(port), HERE, "--worker", job, out],
                                   env=env, stdout=logs[n], stderr=subprocess.STDOUT) for n in range(hosts)]
        try:
            for a in agents:
                a.wait(timeout=900)
        finally:
            for a in agents:
                a.kill()
        if any(a.returncode for a in agents):
            for log in logs:
                log.seek(0)
                sys.stderr.write(log.read()[-4000:])
            raise SystemExit(f"{part}: a host agent failed")
        with open(out) as fh:
            return json.load(fh)


# --- the worker (under torchrun) -------------------------------------------------------------------------------

def _saved_bytes(fn) -> int:
    """The bytes of the distinct storages `fn()` saves for backward."""
    import torch

    seen: dict = {}

    def pack(t):
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _train(model, global_batch, micro: int, steps: int, warmup: int, meter):
    import torch

    import trainyard.engine as te
    from trainyard.engine.trainer import token_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, sent = [], []
    for step in range(1, steps + 1):
        batch = te.rows(model, global_batch(step))
        meter.reset()
        t0 = time.perf_counter()
        with meter.active():
            te.forward_backward(model, batch[:, :-1], batch[:, 1:], token_loss, microbatches=micro)
        te.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        sent.append(meter.totals()["by_kind"])
    return opt, statistics.median(times[warmup:]), sent[-1]


def _cp_row(name: str, cp: int, job: dict) -> dict:
    import trainyard.engine as te
    from trainyard.engine.components.data import SyntheticSource
    from trainyard.engine.components.meter import CommMeter
    from trainyard.engine.models.llama.model import ModelConfig, build_model
    from trainyard.engine.trainer import token_loss

    seq = job["seq_len"]
    cfg = ModelConfig(vocab_size=512, dim=DIM, n_layers=LAYERS, n_heads=DIM // HEAD_DIM, n_kv_heads=KV_HEADS,
                      ffn_hidden=352, max_seq_len=seq)
    model = te.transform(build_model(cfg), distribution={"context_parallel_degree": cp}, seed=0)
    dims = te.api._layout(model).dims
    micro = 4 // dims.dp  # sequences per rank and step, one per micro-batch
    source = SyntheticSource(seed=0, global_batch_size=4, seq_len=seq, vocab_size=512)
    one = te.rows(model, source.global_batch(0))[:1]
    x, y = te.sequence_shard(model, one[:, :-1], one[:, 1:])
    activations, _ = _saved_bytes(lambda: token_loss(model(x), y))
    model.zero_grad(set_to_none=True)
    meter = CommMeter(dims.processes_per_host, dims)
    _, step_s, kinds = _train(model, source.global_batch, micro, job["steps"], job["warmup"], meter)
    kv = 2 * 1 * (seq // cp) * KV_HEADS * HEAD_DIM * 4  # keys and values of the rank's tokens, fp32
    formula = micro * LAYERS * (2 * (cp - 1) + cp) * kv if cp > 1 else 0
    p2p = kinds.get("p2p", {})
    return {"name": name, "cp": cp, "tokens_per_rank": seq // cp, "activation_bytes": activations,
            "step_time_s": step_s, "ring_bytes": p2p.get("intra_bytes", 0) + p2p.get("inter_bytes", 0),
            "ring_formula_bytes": formula}


def _ep_row(name: str, ep: int, p: int, job: dict) -> dict:
    import trainyard.engine as te
    from trainyard.engine.components.data import SyntheticSource
    from trainyard.engine.components.meter import CommMeter, model_state_bytes
    from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model

    cfg = dataclasses.replace(MODEL_CONFIGS["moe-tiny"], n_experts=EXPERTS, top_k=TOP_K, expert_hidden=256,
                              n_shared_experts=0, max_seq_len=EP_SEQ)
    model = te.transform(build_model(cfg), distribution={"expert_parallel_degree": ep,
                                                         "mics": {"partition_group_size": p}}, seed=0)
    dims = te.api._layout(model).dims
    micro = 8 // dims.dp
    source = SyntheticSource(seed=0, global_batch_size=8, seq_len=EP_SEQ, vocab_size=cfg.vocab_size)
    meter = CommMeter(dims.processes_per_host, dims)
    opt, step_s, kinds = _train(model, source.global_batch, micro, job["steps"], job["warmup"], meter)
    states = model_state_bytes(model, opt)["model_state_bytes"]
    te.router_stats(model)
    tokens = EP_SEQ  # one sequence per micro-batch
    uniform = round(micro * LAYERS * (2 * 2 * tokens * TOP_K * (ep - 1) / ep * DIM * 4
                                      + EXPERTS // ep * (ep - 1) * 8))
    a2a = kinds.get("all_to_all", {})
    return {"name": name, "ep": ep, "partition_group_size": p, "experts_per_rank": EXPERTS // ep,
            "model_state_bytes": states, "step_time_s": step_s,
            "all_to_all_bytes": a2a.get("intra_bytes", 0) + a2a.get("inter_bytes", 0),
            "all_to_all_inter_bytes": a2a.get("inter_bytes", 0), "uniform_routing_bytes": uniform}


def worker(job: dict, out: str) -> None:
    import torch.distributed as dist

    import trainyard.engine as te

    te.init({})
    rows = []
    for row in job["rows"]:
        rows.append(_cp_row(row[0], row[1], job) if job["part"] == "cp" else _ep_row(*row, job))
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(rows, fh)
    dist.barrier()
    te.finish()


# --- the driver ------------------------------------------------------------------------------------------------

def _table(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for _, head in columns:
        table.add_column(head, justify="right")
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if v < 1000 else f"{v:,.0f}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    for r in rows:
        table.add_row(*[cell(r[k]) if k in r else "" for k, _ in columns])
    console = Console(width=160)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(HERE), "results", "cp_ep.json"))
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker[0]), args.worker[1])
        from trainyard.engine.components.process_exit import exit_now

        exit_now(0)
    if args.seq_len % 8:
        parser.error("--seq-len must be a multiple of 8 (2 x cp zig-zag chunks for cp up to 4)")
    cp = []
    for name, degree, hosts, pph in CP_ROWS:  # cp4 needs 4 ranks in a host: its own launch
        cp += launch("cp", [(name, degree)], args, hosts, pph)
    ep = launch("ep", EP_ROWS, args, 2, 2)
    _table(f"context parallelism: seq {args.seq_len}, 4 sequences per step, 1 per micro-batch", cp,
                  [("name", "row"), ("tokens_per_rank", "tokens/rank"), ("activation_bytes", "activations B/rank"),
                   ("step_time_s", "step s"), ("ring_bytes", "ring B/rank"), ("ring_formula_bytes", "formula B")])
    _table(f"expert parallelism: {EXPERTS} experts top {TOP_K}, seq {EP_SEQ}, 8 sequences per step", ep,
                   [("name", "row"), ("experts_per_rank", "experts/rank"), ("model_state_bytes", "model states B/rank"),
                    ("step_time_s", "step s"), ("all_to_all_bytes", "all-to-all B/rank"),
                    ("uniform_routing_bytes", "uniform routing B")])
    from trainyard.engine.components.fingerprint import this_machine

    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": this_machine(),
                   "seq_len": args.seq_len, "steps": args.steps, "cp": cp, "ep": ep}, fh, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
