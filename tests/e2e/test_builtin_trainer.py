"""The built-in trainer through `Estimator`, on the embedded store (slow: real multi-process jobs)."""
import io
import re

import pytest
import torch
from safetensors.torch import load_file

from trainyard import Estimator
from trainyard.engine.components.checkpoint import latest_committed_step, list_steps
from trainyard.sdk.cli import main as cli_main

from .helpers import assert_no_processes_left, read_tar, unuse_store, use_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HPS = {"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "seed": 3, "lr": 0.01,
       "warmup_steps": 2, "decay_steps": 16}


def _est(steps, **kw):
    args = dict(entry_point="trainyard.engine.train", instance_type="local", instance_count=2, processes_per_host=2,
                hyperparameters={**HPS, "steps": steps}, max_run=400)
    args.update(kw)
    return Estimator(**args)


CKPT = "s3://e2e-ckpt/run-1"


@pytest.fixture(scope="module")
def ten_steps():
    """10 steps of ZeRO-3 over 2 hosts x 2 (the default layout), a checkpoint every 4: the job the checkpoint and
    resume test follows, and whose first 5 losses are the loss-curve test's ZeRO-3 curve (the schedule is fixed by
    decay_steps, and saving changes no number)."""
    est = _est(10, checkpoint_s3_uri=CKPT, hyperparameters={**HPS, "steps": 10, "checkpoint_every": 4})
    est.fit(logs=False)
    return est


def test_train_checkpoint_resume_on_two_hosts(ten_steps, monkeypatch, tmp_path):
    ckpt, est = CKPT, ten_steps
    job = est.latest_training_job
    m = job.metrics()
    assert [r["step"] for r in m] == list(range(1, 11))
    assert m[-1]["loss"] < m[0]["loss"] - 0.5, [r["loss"] for r in m]
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in m)
    # what it ran on, recorded once: in the first row and in describe()
    d = job.describe()
    fingerprint = d["HardwareFingerprint"]
    # algo-2's ranks print no step line: its first step is timed by the engine's marker file
    assert [p["Phase"] for p in d["HostPhases"]["algo-2"]][-1] == "first_step"
    assert fingerprint == m[0]["fingerprint"] and fingerprint["world_size"] == 4 and fingerprint["hosts"] == 2
    assert all("fingerprint" not in r for r in m[1:]) and 0 < m[-1]["mfu"] < 1
    model = read_tar(est.model_data)
    assert {"model.pt", "config.json"} <= set(model)
    # committed steps under checkpoint_s3_uri: the newest 2 saved (keep_last 2), each with its .metadata: 8 and 10,
    # or 4 and 10 where step 8's save was skipped because step 4's upload was still going (~0.6 s of ~4 steps here,
    # on a loaded machine it can take longer: the trainer then skips, and says so, rather than wait)
    log = job.log_text()
    saved = sorted({int(s) for s in re.findall(r"checkpoint step (\d+) saved to", log)})
    skipped = sorted({int(s) for s in re.findall(r"checkpoint step (\d+) skipped: step \d+'s upload is still", log)})
    assert sorted(saved + skipped) == [4, 8, 10] and skipped in ([], [8]), (saved, skipped)
    use_store(monkeypatch)
    assert latest_committed_step(ckpt) == 10 and list_steps(ckpt) == {s: True for s in saved[-2:]}
    # the sharded checkpoint (4 ranks, ZeRO-3) consolidates into the same weights as the trainer's export
    assert cli_main(["checkpoint", "export", ckpt, str(tmp_path / "export")]) == 0
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    full = torch.load(io.BytesIO(model["model.pt"]), weights_only=True)
    assert exported.keys() == full.keys() and all(torch.equal(exported[k], full[k]) for k in full)
    unuse_store(monkeypatch)
    assert_no_processes_left(job)

    again = _est(13, checkpoint_s3_uri=ckpt)
    again.fit(logs=False)
    m2 = again.latest_training_job.metrics()
    assert [r["step"] for r in m2] == [11, 12, 13]
    assert "resumed from step 10 at s3://e2e-ckpt/run-1" in again.latest_training_job.log_text()


def test_loss_curve_independent_of_process_count_and_layout(ten_steps):
    """1 process, ZeRO-3 over 2 hosts x 2 (the default: the first 5 steps of `ten_steps`) and context parallelism
    2 x MiCS p=1 (each host's 2 ranks split every sequence and share one partition group; the hosts are 2
    replicas): one loss curve (fp32)."""
    runs = {"one": _est(5, instance_count=1, processes_per_host=1), "zero3": ten_steps,
            "mics": _est(5, distribution={"context_parallel_degree": 2, "mics": {"partition_group_size": 1}})}
    curves = {"zero3": [r["loss"] for r in ten_steps.latest_training_job.metrics()][:5]}
    for name in ("one", "mics"):
        runs[name].fit(logs=False)
        curves[name] = [r["loss"] for r in runs[name].latest_training_job.metrics()]
    assert ("cp 2 (zig-zag ring attention) x partition groups of 1 x cp 2 x 2 replica(s)"
            in runs["mics"].latest_training_job.log_text())
    assert "partition groups of 4 x 1 replica(s)" in runs["zero3"].latest_training_job.log_text()
    for name in ("zero3", "mics"):
        assert len(curves[name]) == 5
        for x, y in zip(curves["one"], curves[name]):
            assert abs(x - y) <= 1e-5 * abs(x), (name, curves)


def test_a_mixture_of_experts_trains_with_its_experts_spread_and_reports_its_routing():
    """moe-tiny (4 experts, top 2, a shared one) with expert parallelism 2 x MiCS p=2 on 1 host x 2: each rank holds
    2 experts; every metrics row carries the router's figures."""
    est = _est(5, hyperparameters={**HPS, "model": "moe-tiny", "steps": 5}, instance_count=1,
               distribution={"expert_parallel_degree": 2, "mics": {"partition_group_size": 2}})
    est.fit(logs=False)
    job = est.latest_training_job
    m = job.metrics()
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5] and m[-1]["loss"] < m[0]["loss"] - 0.5, [r["loss"] for r in m]
    for r in m:
        assert len(r["expert_load"]) == 4 and abs(sum(r["expert_load"]) - 1) < 1e-3, r
        assert r["expert_imbalance"] >= 1 and r["dropped_assignments"] == 0 and r["aux_loss"] > 0, r
    logs = job.log_text()
    assert "4 experts (top 2, 1 shared, dropless), spread over ep 2 (2 per rank)" in logs, logs[-3000:]
    assert re.search(r"step 5/5 loss [\d.]+ .* experts \d\.\d\dx", logs), logs[-3000:]
    assert_no_processes_left(job)


def test_stop_writes_an_emergency_checkpoint_and_the_next_run_resumes_there(monkeypatch):
    """SIGTERM (stop(), a spot interruption): the ranks finish the step, checkpoint it and exit."""
    from .helpers import wait_for_log

    ckpt = "s3://e2e-ckpt/emergency"
    est = _est(400, checkpoint_s3_uri=ckpt, hyperparameters={**HPS, "steps": 400, "decay_steps": 400})
    est.fit(wait=False)
    job = est.latest_training_job
    wait_for_log(job, "step 3/400", timeout=240)
    job.stop()
    assert job.describe()["TrainingJobStatus"] == "Stopped"
    logs = job.log_text()
    assert "emergency checkpoint step" in logs, logs[-3000:]
    step = int(logs.split("emergency checkpoint step ")[1].split()[0])
    assert step >= 3 and f"SIGTERM: stopping after step {step}" in logs
    assert [r["step"] for r in job.metrics()][-1] == step  # no step was lost or half-done
    use_store(monkeypatch)
    assert list_steps(ckpt) == {step: True}
    unuse_store(monkeypatch)
    assert_no_processes_left(job)
    again = _est(step + 1, checkpoint_s3_uri=ckpt, hyperparameters={**HPS, "steps": step + 1, "decay_steps": 400})
    again.fit(logs=False)
    assert f"resumed from step {step} at {ckpt}" in again.latest_training_job.log_text()
    assert [r["step"] for r in again.latest_training_job.metrics()] == [step + 1]
