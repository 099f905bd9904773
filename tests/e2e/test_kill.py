"""A local job killed with SIGKILL at 20 random moments (during steps and during saves) and restarted each
time ends bit-identical to an uninterrupted run (slow: 22 real multi-process jobs)."""
import io
import random
import time

import pytest
import torch

from trainyard import Estimator

from .helpers import assert_no_processes_left, kill_at_once, read_tar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS, KILLS = 50, 20  # each attempt runs 0-1 steps (and a fraction) before its kill
# fp32, deterministic; a checkpoint every step (asynchronous: kills land in uploads too); the schedule
# spans the whole run whatever the number of restarts
HPS = {"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "seed": 5, "lr": 0.01,
       "warmup_steps": 2, "decay_steps": STEPS, "steps": STEPS, "dtype": "float32", "checkpoint_every": 1}


def _est(**kw):
    # 2 hosts of 1 process: every kill still ends two hosts' process trees mid-step or mid-save, at half the
    # processes to start on 2 cores
    return Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                     processes_per_host=1, hyperparameters=HPS, max_run=600, **kw)


def _weights(est) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(read_tar(est.model_data)["model.pt"]), weights_only=True)


def _last_step(job) -> int:
    """The newest step the job's log reports (0 before the first)."""
    lines = [ln for ln in job.log_text().splitlines() if f"/{STEPS} loss" in ln]
    return int(lines[-1].split("step ")[1].split("/")[0]) if lines else 0


def test_sigkill_at_random_moments_then_restart_is_bit_identical():
    # the reference saves nothing (no checkpoint location, so no checkpoint_every): saving changes no number
    reference = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                          processes_per_host=1, hyperparameters={k: v for k, v in HPS.items() if k != "checkpoint_every"},
                          max_run=600)
    reference.fit(logs=False)
    want = _weights(reference)

    rng = random.Random(20261122)
    uri = "s3://e2e-ckpt/kill-test"
    kills = 0
    while kills < KILLS:
        est = _est(checkpoint_s3_uri=uri)
        est.fit(wait=False)
        job = est.latest_training_job
        # a random moment: once the ranks run, 0 or 1 more step, then a fraction of a step or save
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.status() == "InProgress" and "model tiny" not in job.log_text():
            time.sleep(0.05)
        target = _last_step(job) + rng.randint(0, 1)
        while time.monotonic() < deadline and job.status() == "InProgress" and _last_step(job) < target:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        if job.status() != "InProgress":
            break  # it finished before the kill: the run is complete
        if not kill_at_once(job):
            break  # it ended meanwhile: the run is complete
        kills += 1
        assert_no_processes_left(job)
    final = _est(checkpoint_s3_uri=uri)
    final.fit(logs=False)
    assert kills == KILLS, f"the run completed after {kills} kills; raise STEPS"
    got = _weights(final)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
