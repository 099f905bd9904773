"""The plan's memory against what the engine holds: the built-in model trained a step under each layout on CPU
(tests/job/memory_worker.py), its model-state bytes (parameters, gradients, optimizer states: what
`model_state_bytes` counts, the figure of the trainer's metrics rows) within 5% of the plan's and its peak
(torch's allocations during a step, on top of the states held before it) within 15%."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.engine.launch import run_on_two_hosts
from trainyard.job.plan import Layout, memory
from trainyard.parallel.shapes import ModelShape

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_worker.py")
# memory_worker.SHAPE, as the planner sees it
SHAPE = ModelShape(name="worker", vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=768,
                   max_seq_len=128)


def _layout(*, world: int, p: int, tp: int = 1, pp: int = 1, schedule: str = "none", mbs: int, micro: int = 1,
            ac: str = "none", precision: str = "fp32") -> Layout:
    return Layout(dp=world // (tp * pp), partition_group_size=p, tp=tp, pp=pp, pipeline_schedule=schedule,
                  virtual_stages=1, micro_batch_size=mbs, microbatches=micro, activation_checkpointing=ac,
                  precision=precision)


def _measure(cases: dict[str, Layout], seq_len: int, tmp_path=None) -> dict[str, dict]:
    """The worker's measurements: with `tmp_path`, on 4 processes of one emulated host (forked from the engine
    tests' warm interpreter, tests/engine/launch.py, which imported torch and the engine once); without, one-process
    cases in 2 workers at once, half the cases each (each measures its own process's allocations; one worker alone
    leaves a core idle)."""
    payload = [{"name": name, "micro_batch_size": lay.micro_batch_size, "seq_len": seq_len,
                "distribution": lay.distribution()} for name, lay in cases.items()]
    if tmp_path is not None:
        return run_on_two_hosts(WORKER, payload, tmp_path, processes_per_host=4, hosts=1)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    procs = [subprocess.Popen([sys.executable, WORKER, json.dumps(part)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for part in (payload[0::2], payload[1::2])]
    rows = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=480)
            assert proc.returncode == 0, out[-2000:] + err[-4000:]
            rows += [json.loads(line.removeprefix("RESULT ")) for line in out.splitlines()
                     if line.startswith("RESULT ")]
    finally:
        for proc in procs:
            proc.kill()  # none is left behind a failed one (a no-op for one that ended)
    return {row["name"]: row for row in rows}


def _compare(cases: dict[str, Layout], measured: dict[str, dict], seq_len: int) -> list[str]:
    report, bad = [], []
    for name, lay in cases.items():
        predicted = memory.estimate(SHAPE, lay, seq_len, fused_optimizer=False)
        got = measured[name]
        states = predicted.model_states / got["model_state_bytes"] - 1
        peak = predicted.total / got["peak_bytes"] - 1
        report.append(f"{name}: model states {got['model_state_bytes']} measured, {predicted.model_states} planned "
                      f"({states:+.1%}); peak {got['peak_bytes']} measured, {predicted.total} planned ({peak:+.1%})")
        bad.extend([report[-1]] if abs(states) > 0.05 or abs(peak) > 0.15 else [])
    assert not bad, "\n".join(report)
    return report


@pytest.mark.slow
def test_one_process_fp32_and_bf16_with_each_checkpointing_mode():
    cases = {f"{prec} AC {ac}": _layout(world=1, p=1, mbs=4, ac=ac, precision=prec)
             for prec in ("fp32", "bf16") for ac in ("none", "selective", "full")}
    print("\n".join(_compare(cases, _measure(cases, 128), 128)))


@pytest.mark.slow
def test_four_processes_zero3_mics_tp_pp(tmp_path):
    cases = {"ZeRO-3 p 4": _layout(world=4, p=4, mbs=4),
             "MiCS p 2 x 2 replicas": _layout(world=4, p=2, mbs=4),
             "MiCS p 2 x 2 replicas, full AC": _layout(world=4, p=2, mbs=4, ac="full"),
             "TP 2 x MiCS p 2": _layout(world=4, p=2, tp=2, mbs=4),
             "PP 2 (1F1B, 2 micro-batches) x ZeRO-3 p 2": _layout(world=4, p=2, pp=2, schedule="1f1b", mbs=2, micro=2)}
    print("\n".join(_compare(cases, _measure(cases, 128, tmp_path), 128)))
