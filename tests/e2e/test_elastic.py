"""Elastic resume (local): a 2-host job whose second host is lost for good goes on with 1 host, the checkpoint
resharded from 4 ranks to 2 and the data stream kept: from the resumed step on, its loss curve is that of an
uninterrupted 1-host run (slow: real multi-process jobs)."""
import os
import signal

import pytest

from trainyard import Estimator

from .helpers import assert_no_processes_left, beat_at_step, driver_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HPS = {"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "seed": 7, "lr": 0.01,
       "warmup_steps": 2, "decay_steps": 30, "steps": 30, "checkpoint_every": 5, "log_every": 10}


def _est(ckpt, hosts, **kw):
    return Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=hosts,
                     processes_per_host=2, max_run=400, checkpoint_s3_uri=ckpt, hyperparameters=HPS, **kw)


def _losses(job) -> dict[int, float]:
    """step -> loss, the last row of each step (a retried job appends the steps it runs again)."""
    return {r["step"]: r["loss"] for r in job.metrics()}


def test_a_lost_host_is_dropped_and_the_job_goes_on_with_the_same_data():
    one = _est("s3://e2e-elastic/one", 1)
    one.fit(logs=False)
    reference = _losses(one.latest_training_job)
    est = _est("s3://e2e-elastic/two", 2, max_retry_attempts=1, elastic={"min_instance_count": 1})
    job = est.fit(wait=False)
    beat = beat_at_step(job, "algo-2", 3, 12)
    os.kill(driver_of(beat["pid"]), signal.SIGKILL)  # algo-2's driver: the host is gone
    d = job.wait(logs="None")
    assert d["TrainingJobStatus"] == "Completed"
    assert [(a["InstanceCount"], a["Outcome"]) for a in d["Attempts"]] == [(2, "Failed"), (1, "Completed")]
    assert d["Attempts"][0]["RetryClass"] == "lost host"
    text = job.log_text()
    assert "elastic: algo-2 lost for good, going on with 1 host(s)" in text
    resumed = int(text.split("resumed from step ")[1].split()[0])
    assert resumed >= 5 and "[algo-2" not in text.split("resumed from step ")[1]  # algo-1 alone from there
    losses = _losses(job)
    assert sorted(losses) == list(range(1, 31))
    for step in range(resumed + 1, 31):  # the 1-host run's curve, within fp32 tolerance
        assert abs(losses[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, losses, reference)
    assert_no_processes_left(job)
