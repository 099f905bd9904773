"""Auto-resume of local jobs (max_retry_attempts): a rank killed mid-training restarts the whole job from its
last committed checkpoint and ends with the weights of an uninterrupted run (slow: real multi-process jobs). That a
user error is not retried: tests/e2e/test_local_scripts.py's failing rank."""
import io
import os
import signal

import pytest
import torch

from trainyard import Estimator
from trainyard.errors import JobFailedError

from .helpers import assert_no_processes_left, beat_at_step, read_tar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HPS = {"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "seed": 5, "lr": 0.01,
       "warmup_steps": 2, "decay_steps": 25, "steps": 25, "checkpoint_every": 5, "log_every": 10}


# DDP-like MiCS (partition groups of 1): 4 replicas of every shard, which the data-corruption check compares
DISTRIBUTION = {"mics": {"partition_group_size": 1}}


def _est(ckpt, hyperparameters=HPS, **kw):
    return Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                     processes_per_host=2, max_run=400, checkpoint_s3_uri=ckpt, hyperparameters=hyperparameters,
                     distribution=DISTRIBUTION, **kw)


def _weights(est) -> dict:
    return torch.load(io.BytesIO(read_tar(est.model_data)["model.pt"]), weights_only=True)


@pytest.fixture(scope="module")
def clean():
    """The uninterrupted run both retried jobs must end like (bit-identical)."""
    est = _est("s3://e2e-resume/clean")
    est.fit(logs=False)
    return _weights(est)


def test_a_killed_rank_restarts_the_job_and_the_weights_match_an_uninterrupted_run(clean):
    faulty = _est("s3://e2e-resume/faulty", max_retry_attempts=1)
    job = faulty.fit(wait=False)
    pid = beat_at_step(job, "algo-2", 3, 12)["pid"]
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    d = job.wait(logs="None")
    assert d["TrainingJobStatus"] == "Completed"
    first, second = d["Attempts"]
    assert first["Outcome"] == "Failed" and first["RetryClass"] == "killed process", first
    assert "algo-2 rank 3 (local rank 1) was killed by SIGKILL" in first["FailureReason"]
    assert second["Outcome"] == "Completed" and second["StartTime"] >= first["EndTime"]
    statuses = [t["Status"] for t in d["SecondaryStatusTransitions"]]
    assert statuses[statuses.index("Restarting") + 1] == "Training" and statuses[-1] == "Completed"
    text = job.log_text()
    assert "restarting the whole job from its last committed checkpoint, attempt 2 of 2" in text
    assert "resumed from step" in text
    b = _weights(faulty)
    assert clean.keys() == b.keys() and all(torch.equal(clean[k], b[k]) for k in clean)  # bit-identical, fp32 on CPU
    assert_no_processes_left(job)


def test_a_flipped_bit_is_caught_from_the_replicas_and_the_retry_ends_with_the_clean_weights(clean, tmp_path):
    """One bit of rank 3's copy flipped after step 7 (the test hook, once); the check at step 10 (sdc_check_every,
    and the save that step) names rank 3, the attempt fails as data corruption, and the retry resumes from step 5,
    saved before the flip."""
    hps = {**HPS, "sdc_check_every": 5}
    faulty = _est("s3://e2e-resume/sdc", hps, max_retry_attempts=1,
                  environment={"TRAINYARD_SDC_INJECT": f"3:7:{tmp_path / 'flipped'}"})
    faulty.fit(logs=False)
    d = faulty.latest_training_job.describe()
    assert d["TrainingJobStatus"] == "Completed"
    first, second = d["Attempts"]
    assert first["Outcome"] == "Failed" and first["RetryClass"] == "data corruption", first
    assert ("data corruption: at step 10 the parameters of rank 3 (algo-2) differ from the other replicas of their "
            "shard (4 copies; tok_embeddings.weight first)") in first["FailureReason"], first["FailureReason"]
    assert second["Outcome"] == "Completed"
    assert "resumed from step 5" in faulty.latest_training_job.log_text()
    assert (tmp_path / "flipped").exists()
    b = _weights(faulty)
    assert all(torch.equal(clean[k], b[k]) for k in clean)


ATTEMPTS = '''\
import os, signal, sys
marker = sys.argv[sys.argv.index("--marker") + 1]
if not os.path.exists(marker):
    open(marker, "w").write("1")
    os.kill(os.getpid(), signal.SIGKILL)  # attempt 1: killed, which is retried
raise ValueError("attempt 2: a different failure")
'''


def test_each_attempt_reports_its_own_failure(tmp_path):
    """A retried job's second failure is the one reported: the first attempt's failure file, left in the host's
    folder, is neither reported again nor used to decide the retry."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "attempts.py").write_text(ATTEMPTS)
    est = Estimator(entry_point="attempts.py", source_dir=str(tmp_path / "src"), instance_type="local",
                    instance_count=1, processes_per_host=1, max_run=240, max_retry_attempts=1,
                    hyperparameters={"marker": str(tmp_path / "attempted")})
    with pytest.raises(JobFailedError, match="ValueError: attempt 2: a different failure"):
        est.fit(logs=False)
    d = est.latest_training_job.describe()
    first, second = d["Attempts"]
    assert "SIGKILL" in first["FailureReason"] and first["RetryClass"] is not None, first
    assert "ValueError: attempt 2" in second["FailureReason"] and "SIGKILL" not in second["FailureReason"], second
    assert "SIGKILL" not in d["FailureReason"]
