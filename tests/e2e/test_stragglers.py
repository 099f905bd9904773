"""A straggler in a real job: the built-in trainer on 2 local hosts x 2 processes. One job serves both sides of
the check: its first 100 steps run clean and name no rank (no false positives), then one rank is slowed from
outside, its CPU share cut (as a throttled host or a noisy neighbour slows it), and is named with its host in the
log, the metrics and describe()["Warnings"] within 30 steps."""
import os
import time

import pytest

from tests.e2e.helpers import beat_at_step
from tests.waiting import eventually
from trainyard import Estimator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLEAN_STEPS = 100
HPS = {"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "steps": 100000,
       "log_every": 10, "save_model": False}


class CpuShare:
    """The process `pid` (every thread of it) limited to `share` of one CPU, as a throttled host or a noisy
    neighbour limits it: a cgroup of its own with a CFS quota (cgroup v1's cpu controller, or v2's cpu.max), put
    back where it was on exit. Needs root, as the namespace and traffic-shaping tests do."""

    PERIOD_US = 100_000

    def __init__(self, pid: int, share: float):
        self.pid, self.quota = pid, int(share * self.PERIOD_US)
        v1 = "/sys/fs/cgroup/cpu"
        if os.path.isfile(f"{v1}/cpu.cfs_quota_us"):
            self.root, self.limit = v1, {"cpu.cfs_period_us": str(self.PERIOD_US), "cpu.cfs_quota_us": str(self.quota)}
        elif "cpu" in open("/sys/fs/cgroup/cgroup.controllers").read().split():
            self.root, self.limit = "/sys/fs/cgroup", {"cpu.max": f"{self.quota} {self.PERIOD_US}"}
        else:
            raise RuntimeError("no cgroup cpu controller to limit a process's CPU share with (cgroup v1 "
                               "/sys/fs/cgroup/cpu or v2 with cpu in cgroup.controllers)")
        self.path = f"{self.root}/trainyard-test-{os.getpid()}-{pid}"

    def __enter__(self) -> "CpuShare":
        os.makedirs(self.path)
        for name, value in self.limit.items():
            with open(f"{self.path}/{name}", "w") as fh:
                fh.write(value)
        with open(f"{self.path}/cgroup.procs", "w") as fh:
            fh.write(str(self.pid))
        return self

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # threads move one by one; a thread being created lands in the group it is leaving
            with open(f"{self.path}/cgroup.procs") as fh:
                left = fh.read().split()
            for task in left:
                try:
                    with open(f"{self.root}/cgroup.procs", "w") as fh:
                        fh.write(task)
                except OSError:  # it has exited
                    pass
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"could not remove {self.path}")


def test_a_slowed_rank_is_named_with_its_host_and_a_clean_run_names_none():
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                    processes_per_host=2, max_run=500, hyperparameters=HPS)
    job = est.fit(wait=False)
    try:
        beat = beat_at_step(job, "algo-2", 3, CLEAN_STEPS, timeout=300)
        rows = job.metrics()
        compared = sorted(int(s) for r in rows for s in (r.get("rank_compute_s") or {}))
        assert len(compared) >= 80, compared  # every step but the 2 warm-up ones, gathered every 10
        clean = [r["warnings"] for r in rows if r.get("warnings")]
        assert clean == [], clean  # no false positive in the clean steps
        slowed_at = beat["step"]
        with CpuShare(beat["pid"], 0.15):  # rank 3 gets 15% of a CPU
            row = eventually(lambda: next((r for r in job.metrics() if r.get("warnings")), None), 180,
                             interval=0.5, what=lambda: job.log_text()[-3000:])
            # its progress lines name it while it stays slow
            eventually(lambda: "slow: rank 3 (algo-2)" in job.log_text(), 60, interval=0.5,
                       what=lambda: job.log_text()[-3000:])
    finally:
        job.stop()
    warning = row["warnings"][0]
    assert warning.startswith("straggler: rank 3 (algo-2) ") and warning.endswith("x the median step for 20 steps")
    assert row["step"] <= slowed_at + 30, (row["step"], slowed_at)
    ratio = float(warning.split(") ")[1].split("x")[0])
    assert ratio >= 1.3, warning
    log = job.log_text()
    assert f"WARNING: {warning}" in log
    assert job.describe()["Warnings"] == [warning]  # rank 3 only: its peers waited, they were not slow
