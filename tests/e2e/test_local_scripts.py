"""Local jobs running user scripts on 2 emulated hosts x 2 processes (slow: real processes)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trainyard import Estimator, TrainingInput
from trainyard.errors import JobFailedError

from tests.timeline import assert_phases_in_order, assert_transitions_cover_the_job

from .helpers import SCRIPTS, assert_no_processes_left, job_processes, read_tar, store_client, wait_for_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _est(**kw):
    args = dict(entry_point="sm_train.py", source_dir=SCRIPTS, instance_type="local", instance_count=2,
                processes_per_host=2, max_run=240)
    args.update(kw)
    return Estimator(**args)


@pytest.fixture(scope="module")
def dataset():
    s3 = store_client()
    for i in range(4):
        s3.put_object(Bucket="e2e-data", Key=f"train/part-{i}.txt", Body=f"{i}\n".encode())
    s3.put_object(Bucket="e2e-data", Key="train-old/stale.txt", Body=b"must not be read")
    return "s3://e2e-data/train"


def test_sagemaker_script_runs_unchanged(dataset, capsys):
    # every rank prints "rank=R world=4 ...": with this definition, each host's first metric row is its first step
    est = _est(hyperparameters={"epochs": 3, "use_extra": False},
               metric_definitions=[{"Name": "world", "Regex": r"world=(\d+)"}])
    est.fit({"train": TrainingInput(dataset, distribution="ShardedByS3Key")})
    job = est.latest_training_job
    d = job.describe()
    assert d["TrainingJobStatus"] == "Completed"
    assert assert_transitions_cover_the_job(d) == ["Starting", "PreparingTrainingStack", "Downloading", "Training",
                                                   "Uploading", "Completed"]
    # each host: its channel staged by the supervisor, then its driver spawned, code fetched, first step seen;
    # algo-1 uploads the artifacts
    assert_phases_in_order(d, {"algo-1": ["data", "capacity", "code", "first_step", "upload"],
                               "algo-2": ["data", "capacity", "code", "first_step"]})
    assert 0 < d["BillableTimeInSeconds"] <= (d["TrainingEndTime"] - d["CreationTime"]).total_seconds() + 1
    assert "EstimatedCost" not in d
    out = capsys.readouterr().out
    # every rank ran with the hyperparameters decoded correctly (False stays false), prefixed [host/rank]
    for host, rank, files in [("algo-1", 0, "part-0.txt,part-2.txt"), ("algo-1", 1, "part-0.txt,part-2.txt"),
                              ("algo-2", 2, "part-1.txt,part-3.txt"), ("algo-2", 3, "part-1.txt,part-3.txt")]:
        assert f"[{host}/{rank}] rank={rank} world=4 host={host} epochs=3 use_extra=False files={files}" in out
    model = read_tar(d["ModelArtifacts"]["S3ModelArtifacts"])
    assert json.loads(model["model.json"]) == {"sum_of_ranks": 6.0, "world": 4}
    output = read_tar(d["ModelArtifacts"]["S3ModelArtifacts"].replace("model.tar.gz", "output.tar.gz"))
    assert output["notes.txt"] == b"done"
    assert_no_processes_left(job)
    # attach from another process finds the job and its status
    code = f"from trainyard import Estimator; print(Estimator.attach({job.name!r}).latest_training_job.status())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), check=True)
    assert r.stdout.strip() == "Completed"


def test_failing_rank_names_host_rank_and_exception_and_a_user_error_is_not_retried(dataset):
    # retries allowed: a user's exception is not retried (auto-resume retries killed processes, hangs, lost hosts)
    est = _est(hyperparameters={"mode": "raise", "fail_rank": 3}, max_retry_attempts=2)
    with pytest.raises(JobFailedError) as e:
        est.fit({"train": dataset}, logs=False)
    msg = str(e.value)
    assert "algo-2 rank 3 (local rank 1) exited with code 1" in msg
    assert "ValueError: boom on rank 3" in msg
    d = est.latest_training_job.describe()
    assert d["TrainingJobStatus"] == "Failed"
    assert d["FailureReason"] == e.value.reason and len(d["FailureReason"]) <= 1024
    assert [(a["Attempt"], a["Outcome"], a["RetryClass"]) for a in d["Attempts"]] == [(1, "Failed", None)]
    assert "Restarting" not in [t["Status"] for t in d["SecondaryStatusTransitions"]]
    assert "not retried" in est.latest_training_job.log_text()
    assert_no_processes_left(est.latest_training_job)


def test_stop_and_max_run_leave_no_process(dataset, capsys):
    est = _est(hyperparameters={"mode": "sleep"})
    job = est.fit({"train": dataset}, wait=False)
    wait_for_log(job, "[algo-2/3] rank=3")
    job.stop()
    d = job.describe()
    assert d["TrainingJobStatus"] == "Stopped" and d["SecondaryStatus"] == "Stopped"
    assert_no_processes_left(job)

    # max_run ends the job Stopped; fit() warns, as SageMaker's SDK does, rather than raising (issue 34)
    est = _est(hyperparameters={"mode": "sleep"}, max_run=8)
    est.fit({"train": dataset}, logs=False)
    d = est.latest_training_job.describe()
    assert (d["TrainingJobStatus"], d["SecondaryStatus"]) == ("Stopped", "MaxRuntimeExceeded")
    assert "MaxRuntimeExceeded" in d["FailureReason"] and "max_run=8s" in d["FailureReason"]
    assert f"warning: job {est.latest_training_job.name} ended Stopped, not Completed (MaxRuntimeExceeded" \
        in capsys.readouterr().err
    assert_no_processes_left(est.latest_training_job)


def test_ctrl_c_in_fit_stops_the_job(dataset):
    """Ctrl-C while `fit()` waits: the job is stopped, every process of it ends, KeyboardInterrupt surfaces."""
    from trainyard.sdk.backends.local.backend import LocalJob

    name = f"ctrl-c-{int(time.time())}"
    code = (f"from trainyard import Estimator\n"
            f"Estimator(entry_point='sm_train.py', source_dir={SCRIPTS!r}, instance_count=2, processes_per_host=2,"
            f" hyperparameters={{'mode': 'sleep'}}).fit({{'train': {dataset!r}}}, job_name={name!r})\n")
    # SIGINT back to its default in the child, as in a terminal: a shell that starts this suite in the
    # background (no job control) leaves it ignored, and Python would then never raise KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                job = LocalJob(name)
                if "[algo-2/3] rank=3" in job.log_text():
                    break
            except Exception:
                pass
            time.sleep(0.2)
        assert job_processes(job), "the job never started"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in out and "stopping" in out
    assert job.describe()["TrainingJobStatus"] == "Stopped"
    assert_no_processes_left(job)


def test_checkpoint_folder_is_synced_and_restored(dataset):
    s3 = store_client()
    s3.create_bucket(Bucket="e2e-ckpt-user")
    s3.put_object(Bucket="e2e-ckpt-user", Key="run-old/host-algo-1.txt", Body=b"stale: a sibling prefix")
    # the first run's URI ends with a slash, the second's does not: the same folder, never run-old/
    first = _est(hyperparameters={"epochs": 1}, checkpoint_s3_uri="s3://e2e-ckpt-user/run/")
    first.fit({"train": dataset})
    second = _est(hyperparameters={"epochs": 2}, checkpoint_s3_uri="s3://e2e-ckpt-user/run")
    second.fit({"train": dataset})
    files = {o["Key"]: s3.get_object(Bucket="e2e-ckpt-user", Key=o["Key"])["Body"].read().decode()
             for o in s3.list_objects_v2(Bucket="e2e-ckpt-user", Prefix="run/")["Contents"]}
    assert files == {f"run/host-algo-{h}.txt": "epochs=2 previous=[epochs=1 previous=[none]]" for h in (1, 2)}
    assert "restored 2 checkpoint file(s)" in second.latest_training_job.log_text()
