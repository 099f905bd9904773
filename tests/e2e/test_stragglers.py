"""A straggler in a real job: the built-in trainer on 2 local hosts x 2 processes, after the pre-flight health check
(whose figures for healthy hosts are checked here too). One job serves both sides of the straggler check: its first
100 steps run clean and name no rank (no false positives), then one rank is slowed from outside, its CPU share cut (as a throttled host or a noisy neighbour slows it), and is named with its host in the
log, the metrics and describe()["Warnings"] within 30 steps. The job is elastic with straggler_remove: at the next
checkpoint the throttled rank's host is left out, and the job resumes from that checkpoint on the other host."""
import re

import pytest

from tests.e2e.helpers import CpuShare, beat_at_step
from tests.waiting import eventually
from trainyard import Estimator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLEAN_STEPS = 100
CHECKPOINT_EVERY = 20
HPS = {"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "steps": 100000,
       "log_every": 10, "save_model": False, "checkpoint_every": CHECKPOINT_EVERY, "straggler_remove": True}


def test_a_slowed_rank_is_named_with_its_host_and_a_clean_run_names_none():
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                    processes_per_host=2, max_run=500, hyperparameters=HPS, health_check=True,
                    checkpoint_s3_uri="s3://trainyard-tests/stragglers/checkpoints", max_retry_attempts=1,
                    elastic={"min_instance_count": 1})
    job = est.fit(wait=False)
    try:
        beat = beat_at_step(job, "algo-2", 3, CLEAN_STEPS, timeout=300)
        rows = job.metrics()
        compared = sorted(int(s) for r in rows for s in (r.get("rank_compute_s") or {}))
        assert len(compared) >= 80, compared  # every step but the 2 warm-up ones, gathered every 10
        clean = [r["warnings"] for r in rows if r.get("warnings")]
        assert clean == [], clean  # no false positive in the clean steps
        check = job.describe()["HealthCheck"]  # the first attempt's (the 1-host attempt after it checks again)
        slowed_at = beat["step"]
        with CpuShare(lambda: [beat["pid"]], 0.15):  # rank 3 gets 15% of a CPU
            row = eventually(lambda: next((r for r in job.metrics() if r.get("warnings")), None), 180,
                             interval=0.5, what=lambda: job.log_text()[-3000:])
            # its progress lines name it while it stays slow
            eventually(lambda: "slow: rank 3 (algo-2)" in job.log_text(), 60, interval=0.5,
                       what=lambda: job.log_text()[-3000:])
            # straggler_remove: the next committed checkpoint ends the attempt, and the job goes on without algo-2
            eventually(lambda: "the job goes on without algo-2 (straggler_remove)" in job.log_text(), 120,
                       interval=0.5, what=lambda: job.log_text()[-3000:])
        eventually(lambda: "resumed from step" in job.log_text(), 120, interval=0.5,
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
    d = job.describe()
    assert d["Warnings"] == [warning]  # rank 3 only: its peers waited, they were not slow
    # left out at the first checkpoint after it was named, and resumed from that checkpoint on algo-1
    removed_at = int(re.search(r"still slow at step (\d+)'s committed checkpoint", log)[1])
    assert removed_at % CHECKPOINT_EVERY == 0 and row["step"] <= removed_at < row["step"] + 2 * CHECKPOINT_EVERY, \
        (removed_at, row["step"])
    first, second = d["Attempts"][:2]
    assert first["RetryClass"] == "straggler" and "rank 3 (algo-2) still slow" in first["FailureReason"], first
    assert first["InstanceCount"] == 2 and second["InstanceCount"] == 1, d["Attempts"]
    assert "elastic: leaving out algo-2, whose rank(s) straggled, going on with 1 host(s)" in log
    assert f"resumed from step {removed_at}" in log, log[-3000:]
    # the pre-flight health check before it (tests/e2e/test_health_check.py names a throttled host): every host's
    # figures, nobody far below its peers
    assert check["SlowHosts"] == [] and set(check["Hosts"]) == {"algo-1", "algo-2"}
    for host, h in check["Hosts"].items():
        assert h["compute_tflops"] > 0 and h["intra_gbps"] > 0 and h["inter_gbps"] > 0 and h["ranks"] == 2, (host, h)
        assert h["efa"] == {"provider": None, "devices": 0} and h["ratio"] >= 0.7, (host, h)
    assert "[algo-2] driver: health check: algo-1: compute " in log
