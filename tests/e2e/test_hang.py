"""A hung rank (SIGSTOP) in a 2 x 2 built-in trainer job: found within hang_timeout_s, named with its host, the
job Failed, nothing left behind (slow: a real multi-process job)."""
import json
import os
import re
import signal
import time

import pytest

from trainyard import Estimator
from trainyard.errors import JobFailedError

from .helpers import assert_no_processes_left, beat_at_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HANG_TIMEOUT_S = 6


def test_a_stopped_rank_is_named_and_the_job_fails():
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                    processes_per_host=2, max_run=240, hang_timeout_s=HANG_TIMEOUT_S,
                    hyperparameters={"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32,
                                     "steps": 100000, "log_every": 50})
    job = est.fit(wait=False)
    beat = beat_at_step(job, "algo-2", 3, 3, timeout=120)
    os.kill(beat["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    with pytest.raises(JobFailedError) as e:
        job.wait(logs="None")
    ended = time.monotonic() - stopped
    reason = str(e.value)
    with open(f"{job.dir}/hang.json") as fh:
        report = json.load(fh)
    assert re.search(r"Hang: rank 3 \(algo-2\) stopped in \w+ at step \d+ \(SIGSTOP[^)]*\); ranks? [0-9,-]+ waits? in \w+ #\d+",
                     reason), (reason, report["beats"], report["stacks"])
    assert job.describe()["FailureReason"].startswith("Hang: rank 3 (algo-2)")
    assert ended < HANG_TIMEOUT_S + 30, ended
    print(f"job ended {ended:.1f} s after the SIGSTOP (hang_timeout_s={HANG_TIMEOUT_S}): {reason}")
    assert report["culprits"] == [3] and sorted(b["rank"] for b in report["beats"]) == [0, 1, 2, 3]
    assert all("File " in report["stacks"][str(r)] for r in (0, 1, 2))  # the waiting ranks' stacks
    assert "rank 0 (algo-1) stacks:" in job.log_text()
    assert_no_processes_left(job)
