"""Attacks on running local jobs (issue 30): a supervisor killed alone must not leave its ranks training
(slow: real multi-process jobs)."""
import os
import re
import signal
import time

import pytest

from trainyard import Estimator
from trainyard.job import storage
from trainyard.sdk.store import ensure_store

from tests.waiting import eventually

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
    # a committed save, whichever step's: under load a save due while the last upload is in flight is skipped,
    # so step 4's may never come (every 2nd step saves)
    eventually(lambda: re.search(r"checkpoint step \d+ saved", job.log_text()), 150, interval=0.2,
               what=lambda: job.log_text()[-3000:])
    supervisor = [p for p in job_processes(job) if b"trainyard.sdk.backends.local.supervisor" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(supervisor) == 1
    os.kill(supervisor[0], signal.SIGKILL)
    killed = time.monotonic()
    eventually(lambda: not job_processes(job), 10, what="ranks outlived their supervisor by 10 s")
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


def test_a_second_job_on_a_live_checkpoint_location_is_refused_before_it_starts():
    from trainyard.errors import ConfigError
    from trainyard.sdk.jobs.jobstate import job_dir

    uri = "s3://e2e-security/one-writer"
    first = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=1,
                      processes_per_host=2, hyperparameters=HPS, checkpoint_s3_uri=uri, max_run=240)
    first.fit(wait=False)
    running = first.latest_training_job
    wait_for_log(running, "step 1/", timeout=120)
    second = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=1,
                       processes_per_host=2, hyperparameters=HPS, checkpoint_s3_uri=uri + "/", max_run=240)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"checkpoint_s3_uri: job '{running.name}' is writing checkpoints to {uri}"):
        second.fit(wait=False, job_name="second-writer")
    assert time.monotonic() - started < 5
    assert not os.path.exists(job_dir("second-writer"))  # nothing was started
    running.stop()
    # its lease goes with it (released by its driver, or known ended): the next job starts at once
    third = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=1,
                      processes_per_host=2, hyperparameters={**HPS, "steps": 2}, checkpoint_s3_uri=uri, max_run=240)
    third.fit(logs=False)
    assert third.latest_training_job.status() == "Completed"


FILL_DISK = '''import os
with open(os.path.join(os.environ["SM_MODEL_DIR"], "model.pt"), "wb") as fh:
    while True:  # until the disk is full
        fh.write(b"\\0" * (1 << 20))
'''


def test_a_full_disk_gives_a_readable_failure_a_final_status_and_no_partial_model(tmp_path):
    """The job folders on a 48 MiB tmpfs that the script fills: the supervisor and the driver still write the
    status and the failure (their reserve), the partial model file is removed, the disk has room again."""
    import subprocess

    from trainyard.sdk.store import trainyard_home

    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root (CI runs as root)")
    jobs = os.path.join(trainyard_home(), "jobs")
    os.makedirs(jobs, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", jobs], check=True)
    try:
        (tmp_path / "fill.py").write_text(FILL_DISK)
        est = Estimator(entry_point="fill.py", source_dir=str(tmp_path), instance_type="local", instance_count=1,
                        processes_per_host=1, max_run=120)
        from trainyard.errors import JobFailedError

        with pytest.raises(JobFailedError):
            est.fit(logs=False, wait=True)
        job = est.latest_training_job
        d = job.describe()
        assert d["TrainingJobStatus"] == "Failed", d
        assert "supervisor" not in d["FailureReason"], d
        assert "no space left on device on the file system of /opt/ml" in d["FailureReason"], d["FailureReason"]
        assert "removed the model folder's files, which may be partial: model.pt" in d["FailureReason"]
        model_dir = os.path.join(job.dir, "hosts", "algo-1", "model")
        assert not os.path.exists(os.path.join(model_dir, "model.pt"))
        st = os.statvfs(jobs)
        assert st.f_bavail * st.f_frsize > 40 * 2**20  # the space is back
    finally:
        subprocess.run(["umount", "-l", jobs], check=False)
