"""Attacks on running local jobs (issue 30): a supervisor killed alone must not leave its ranks training
(slow: real multi-process jobs)."""
import os
import signal
import time

import pytest

from trainyard import Estimator
from trainyard.job import storage
from trainyard.sdk.store import ensure_store

from .helpers import job_processes, wait_for_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HPS = {"model": "tiny", "global_batch_size": 8, "seq_len": 32, "steps": 5000, "checkpoint_every": 2,
       "dtype": "float32"}


def _committed(uri: str) -> set[str]:
    with _store_env():
        return {rel.split("/")[0] for _, rel, _ in storage.list_files(uri) if rel.endswith("/.metadata")}


class _store_env:
    def __enter__(self):
        self.saved = dict(os.environ)
        os.environ.update(ensure_store().env())

    def __exit__(self, *exc):
        os.environ.clear()
        os.environ.update(self.saved)


def test_killing_only_the_supervisor_stops_every_rank_within_seconds():
    uri = "s3://e2e-security/lifeline"
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                    processes_per_host=2, hyperparameters=HPS, checkpoint_s3_uri=uri, max_run=240)
    est.fit(wait=False)
    job = est.latest_training_job
    wait_for_log(job, "checkpoint step 4 saved", timeout=150)
    supervisor = [p for p in job_processes(job) if b"trainyard.sdk.supervisor" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(supervisor) == 1
    os.kill(supervisor[0], signal.SIGKILL)
    killed = time.monotonic()
    while job_processes(job) and time.monotonic() - killed < 10:
        time.sleep(0.1)
    assert job_processes(job) == [], "ranks outlived their supervisor by 10 s"
    stopped_in = time.monotonic() - killed
    committed = _committed(uri)
    time.sleep(3)
    assert _committed(uri) == committed  # nothing was committed once the ranks were gone
    d = job.describe()
    assert d["TrainingJobStatus"] == "Failed" and "supervisor process ended unexpectedly" in d["FailureReason"]
    print(f"ranks stopped {stopped_in:.1f} s after the supervisor; committed: {sorted(committed)}")
    logs = job.log_text()
    for host in ("algo-1", "algo-2"):
        assert f"[{host}] driver: the job's supervisor ended while the job ran; this host's ranks were stopped" \
            in logs, logs[-2000:]
