"""Pipeline bubble per schedule: measured against the formula of Narayanan et al. 2021.

    python bench/pipeline.py [--t-fwd-ms 50] [--steps 3] [--ranks 2,3,4] [--json PATH]

For p = 2, 3, 4 pipeline ranks (one launch of p spawned processes per p, gloo on 127.0.0.1, one process
group for every configuration) and m = p, 2p, 4p micro-batches, each schedule of `trainyard/engine/distributed/pipeline.py`
(gpipe, 1f1b, interleaved_1f1b with v = 2 virtual stages) is built with `build_schedule` and stepped:
1 warm-up step (shape inference), then `--steps` measured steps, each after a barrier; medians.

Emulated device time. This machine has 2 cores: p = 3 or 4 stages computing at once would share them
and distort the bubble. So each stage is a small real layer (Linear 64 -> 64 on a (4, 64) micro-batch)
followed by an autograd Function that sleeps t_f in forward and 2 t_f in backward (backward ~ 2x
forward, as on GPUs): the CPU is free while the "device" works, as with a GPU, and the stages run
truly in parallel. With interleaved 1F1B a rank holds v = 2 stages of t_f / v each, so a rank's work
per step is m (t_f + t_b) under every schedule. What remains on the CPU (the schedule's Python, gloo
send/recv, waking up) is not hidden as a GPU's asynchronous launches hide it: a few ms per operation on
a loaded machine, which is why t_f defaults to 50 ms (at 20 ms it dominated the interleaved rows).

Per rank and step: busy = the summed (start, end) intervals of every forward and backward sleep of
the rank's stages (perf_counter around the sleep, which is the work); step = the pipeline's step: the
ranks start `schedule.step()` together (after a barrier) and the step ends when the last rank's
returns (the wall time of the slowest rank's `schedule.step()`; a rank whose own call returns early,
such as the last stage under GPipe, still waits for the others at the next synchronisation). Two
definitions of the bubble, both reported:

  measured_bubble        (step - busy) / busy: idle time relative to the ideal compute time m (t_f + t_b)
                         of a rank. The paper's formula is this one: (p-1)/m for GPipe and 1F1B,
                         (p-1)/(v m) for interleaved 1F1B (`formula_bubble`).
  idle_fraction_of_step  (step - busy) / step: the share of the step a rank is idle; formula
                         (p-1)/(m+p-1), interleaved (p-1)/(v m + p - 1) (`formula_idle_fraction`).

measured_bubble is the median over steps of each rank's ratio, averaged over ranks (max_rank_bubble:
the largest rank's). `schedule_ideal_bubble` replays the compute order torch runs (GPipe and 1F1B as
read off their `_step_microbatches`, interleaved from the schedule's own `pipeline_order`) with exact
durations and free communication: where it equals the formula, torch's order is the textbook one and
any excess measured is runtime overhead. Goal: |measured_bubble - formula_bubble| <= 0.10 (`within_0_10`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone

from trainyard.engine.components.fingerprint import this_machine

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))  # (schedule, virtual stages)
WIDTH = 64  # features of the emulated layer: small, so the real compute is negligible next to the sleeps
MB_ROWS = 4  # rows per micro-batch
LAUNCH_TIMEOUT_S = 300  # one launch of p processes, every configuration included
PG_TIMEOUT_S = 60  # a collective or p2p op that waits longer than this fails the launch


def formulas(p: int, m: int, v: int) -> tuple[float, float]:
    """(bubble / ideal compute, idle share of the step) of Narayanan et al. 2021, equal stage times."""
    return (p - 1) / (v * m), (p - 1) / (v * m + p - 1)


def _worker(rank: int, p: int, port: int, configs: list[tuple[str, int, int]], t_f: float, steps: int,
            out_dir: str) -> None:
    """One pipeline rank: every configuration in order, one JSON of per-step (step, busy) to out_dir."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch import nn

    from trainyard.engine.distributed.pipeline import PipelineConfig, build_schedule, rank_stages

    torch.set_num_threads(1)

    class DeviceTime(torch.autograd.Function):
        """Identity that holds the emulated device for `seconds` forward and 2x backward, logging each."""

        @staticmethod
        def forward(ctx, x, seconds, log):
            ctx.seconds, ctx.log = seconds, log
            t0 = time.perf_counter()
            time.sleep(seconds)
            log.append(time.perf_counter() - t0)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            t0 = time.perf_counter()
            time.sleep(2 * ctx.seconds)  # backward ~ 2x forward, as on GPUs
            ctx.log.append(time.perf_counter() - t0)
            return grad, None, None

    class Block(nn.Module):
        def __init__(self, seconds: float):
            super().__init__()
            self.linear, self.seconds, self.log = nn.Linear(WIDTH, WIDTH), seconds, []

        def forward(self, x):
            return DeviceTime.apply(self.linear(x), self.seconds, self.log)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    group, results = dist.group.WORLD, []
    try:
        for schedule, v, m in configs:
            torch.manual_seed(0)
            stages, num_stages = rank_stages(rank, p, v), p * v
            parts = [Block(t_f / v) for _ in stages]
            sched = build_schedule(parts, stages, num_stages, pp_group=group, device=torch.device("cpu"),
                                   config=PipelineConfig(schedule=schedule, virtual_stages=v, microbatches=m),
                                   loss_fn=lambda out, y: ((out - y) ** 2).mean())
            x, y = torch.randn(m * MB_ROWS, WIDTH), torch.randn(m * MB_ROWS, WIDTH)
            args = (x,) if 0 in stages else ()
            kwargs = {"target": y, "losses": []} if num_stages - 1 in stages else {}
            measured = []
            for i in range(1 + steps):
                for part in parts:
                    part.log.clear()
                    part.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                sched.step(*args, **kwargs)
                step = time.perf_counter() - t0
                if i:  # step 0 is the warm-up (shape inference)
                    measured.append({"step": step, "busy": sum(sum(part.log) for part in parts),
                                     "ops": sum(len(part.log) for part in parts)})
            order = None
            if schedule == "interleaved_1f1b":  # torch's own order for every rank, compute actions only
                order = {r: [(a.stage_index, a.computation_type.value, a.microbatch_index)
                             for a in acts if a is not None and a.computation_type.value in ("F", "B")]
                         for r, acts in sched.pipeline_order.items()}
            results.append({"schedule": schedule, "virtual_stages": v, "microbatches": m, "steps": measured,
                            "order": order})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(p: int, configs: list[tuple[str, int, int]], t_f: float, steps: int) -> list[list[dict]]:
    """Every configuration on p spawned ranks; per rank, its results list (bounded by LAUNCH_TIMEOUT_S)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(p, _free_port(), configs, t_f, steps, out_dir), nprocs=p,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.terminate()
                raise TimeoutError(f"p={p}: the ranks did not finish within {LAUNCH_TIMEOUT_S} s")
        per_rank = []
        for r in range(p):
            with open(os.path.join(out_dir, f"rank{r}.json")) as fh:
                per_rank.append(json.load(fh))
    return per_rank


def textbook_order(schedule: str, p: int, m: int, rank: int) -> list[tuple[int, str, int]]:
    """The compute order torch's ScheduleGPipe / Schedule1F1B run on `rank` (read off their `_step_microbatches`):
    GPipe all forwards then all backwards; 1F1B min(m, p - rank) forwards, then backward/forward pairs, then
    the remaining backwards."""
    if schedule == "gpipe":
        return [(rank, "F", k) for k in range(m)] + [(rank, "B", k) for k in range(m)]
    warmup = min(m, p - rank)
    order = [(rank, "F", k) for k in range(warmup)]
    for k in range(m):
        order.append((rank, "B", k))
        if warmup + k < m:
            order.append((rank, "F", warmup + k))
    return order


def simulate(orders: dict[int, list], p: int, v: int, t_f: float) -> float:
    """Step time of the given per-rank compute orders with exact durations (t_f / v forward, twice that
    backward) and no communication cost: the schedule's own ideal."""
    last, done, clock, pos = p * v - 1, {}, [0.0] * p, [0] * p
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                stage, kind, k = orders[r][pos[r]]
                dep = (("F", stage - 1, k) if stage else None) if kind == "F" else \
                    (("B", stage + 1, k) if stage < last else ("F", stage, k))
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep else 0.0)
                clock[r] = done[(kind, stage, k)] = start + (t_f if kind == "F" else 2 * t_f) / v
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the compute orders deadlock: {orders}")
    return max(clock)


def summarize(p: int, per_rank: list[list[dict]], t_f: float) -> list[dict]:
    entries = []
    for i, cfg in enumerate(per_rank[0]):
        schedule, v, m = cfg["schedule"], cfg["virtual_stages"], cfg["microbatches"]
        ranks = [rank[i]["steps"] for rank in per_rank]
        for steps in ranks:  # every forward and backward of the rank's stages was timed
            assert all(s["ops"] == 2 * m * v for s in steps), (schedule, m, steps)
        # the pipeline's step: the ranks start together (barrier) and the step ends with the last of them
        pipe = [max(steps[k]["step"] for steps in ranks) for k in range(len(ranks[0]))]
        bubbles = [statistics.median((t - s["busy"]) / s["busy"] for t, s in zip(pipe, steps)) for steps in ranks]
        idles = [statistics.median((t - s["busy"]) / t for t, s in zip(pipe, steps)) for steps in ranks]
        formula_bubble, formula_idle = formulas(p, m, v)
        orders = ({int(r): [tuple(a) for a in acts] for r, acts in cfg["order"].items()} if cfg["order"]
                  else {r: textbook_order(schedule, p, m, r) for r in range(p)})
        ideal_busy = 3 * m * t_f
        measured = statistics.fmean(bubbles)
        entries.append({
            "name": f"{schedule}-p{p}-m{m}", "schedule": schedule, "stages": p, "microbatches": m,
            "virtual_stages": v, "measured_bubble": measured, "formula_bubble": formula_bubble,
            "max_rank_bubble": max(bubbles), "idle_fraction_of_step": statistics.fmean(idles),
            "formula_idle_fraction": formula_idle,
            "schedule_ideal_bubble": (simulate(orders, p, v, t_f) - ideal_busy) / ideal_busy,
            "step_seconds": statistics.median(pipe),
            "within_0_10": abs(measured - formula_bubble) <= 0.10,
        })
    return entries


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t-fwd-ms", type=float, default=50.0,
                    help="emulated forward time per micro-batch of a rank (its stages together)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t0, rows, load = time.time(), [], [os.getloadavg()[0]]  # the machine is shared: record its load
    for p in (int(s) for s in a.ranks.split(",")):
        configs = [(schedule, v, m) for m in (p, 2 * p, 4 * p) for schedule, v in SCHEDULES]
        rows += summarize(p, launch(p, configs, a.t_fwd_ms / 1000, a.steps), a.t_fwd_ms / 1000)
    total = time.time() - t0
    load.append(os.getloadavg()[0])
    print(f"\npipeline bubble, emulated device time t_f = {a.t_fwd_ms:g} ms, t_b = 2 t_f, median of {a.steps} steps")
    print(f"{'schedule':<18}{'p':>3}{'m':>4}{'v':>3}{'bubble':>9}{'formula':>9}{'max rank':>10}"
          f"{'idle/step':>11}{'formula':>9}{'sched ideal':>12}{'step s':>8}  goal")
    for r in rows:
        print(f"{r['schedule']:<18}{r['stages']:>3}{r['microbatches']:>4}{r['virtual_stages']:>3}"
              f"{r['measured_bubble']:>9.3f}{r['formula_bubble']:>9.3f}{r['max_rank_bubble']:>10.3f}"
              f"{r['idle_fraction_of_step']:>11.3f}{r['formula_idle_fraction']:>9.3f}"
              f"{r['schedule_ideal_bubble']:>12.3f}{r['step_seconds']:>8.3f}"
              f"  {'met' if r['within_0_10'] else 'MISSED'}")
    met = sum(r["within_0_10"] for r in rows)
    print(f"goal |bubble - formula| <= 0.10: {met}/{len(rows)} met; total {total:.0f} s; "
          f"1-min load average {load[0]:.1f} at the start, {load[1]:.1f} at the end")
    if a.json:
        import torch

        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"name": "pipeline", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "fingerprint": this_machine(), "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                                  f"{platform.python_version()}, torch {torch.__version__}",
                       "t_fwd_ms": a.t_fwd_ms, "steps": a.steps, "total_seconds": total,
                       "load_average_1min": load, "entries": rows}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
