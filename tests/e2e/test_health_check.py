"""The pre-flight health check (trainyard/container/health.py) in a real 2 hosts x 1 process local job whose
second host's check runs on a quarter of a CPU: it is named before step 1 and the job fails with that reason. A
healthy 2 x 2 job's per-host figures are checked in tests/e2e/test_stragglers.py's job, which runs the check too."""
import pytest

from tests.e2e.helpers import CpuShare, host_processes
from trainyard import Estimator
from trainyard.errors import JobFailedError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_throttled_host_is_named_before_step_1_and_the_job_fails_with_that_reason():
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                    processes_per_host=1, max_run=240, health_check=True,
                    hyperparameters={"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32,
                                     "steps": 5})
    job = est.fit(wait=False)

    def checking() -> list[int]:  # algo-2's processes of the check (the torchrun agent, its ranks)
        return [p for p in host_processes(job, "algo-2") if b"trainyard.container.health" in _cmdline(p)]

    with CpuShare(checking, 0.25):  # as they start, a quarter of a CPU (the other host's get 2 cores)
        with pytest.raises(JobFailedError):
            job.wait(logs="None")
    d = job.describe()
    assert d["FailureReason"].startswith("Health check: algo-2's compute "), d["FailureReason"]
    assert "x the median of the other hosts" in d["FailureReason"]
    check = d["HealthCheck"]
    assert check["SlowHosts"] == ["algo-2"] and set(check["Hosts"]) == {"algo-1", "algo-2"}
    assert check["Hosts"]["algo-2"]["ratio"] < 0.7 <= check["Hosts"]["algo-1"]["ratio"]
    log = job.log_text()
    assert "[algo-1] driver: health check: algo-2: compute " in log
    assert "step 1/5" not in log  # named before the first step: training never started
    assert [t["Status"] for t in d["SecondaryStatusTransitions"]][-1] == "Failed"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""
