"""A straggler in a real job: the built-in trainer on 2 local hosts x 2 processes, after the pre-flight health check
(whose figures for healthy hosts are checked here too). One job serves both sides of the straggler check: its first
100 steps run clean and name no rank (no false positives), then one rank is slowed from outside, its CPU share cut (as a throttled host or a noisy neighbour slows it), and is named with its host in the
log, the metrics and describe()["Warnings"] within 30 steps."""
import pytest

from tests.e2e.helpers import CpuShare, beat_at_step
from tests.waiting import eventually
from trainyard import Estimator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLEAN_STEPS = 100
HPS = {"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "steps": 100000,
       "log_every": 10, "save_model": False}


def test_a_slowed_rank_is_named_with_its_host_and_a_clean_run_names_none():
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                    processes_per_host=2, max_run=500, hyperparameters=HPS, health_check=True)
    job = est.fit(wait=False)
    try:
        beat = beat_at_step(job, "algo-2", 3, CLEAN_STEPS, timeout=300)
        rows = job.metrics()
        compared = sorted(int(s) for r in rows for s in (r.get("rank_compute_s") or {}))
        assert len(compared) >= 80, compared  # every step but the 2 warm-up ones, gathered every 10
        clean = [r["warnings"] for r in rows if r.get("warnings")]
        assert clean == [], clean  # no false positive in the clean steps
        slowed_at = beat["step"]
        with CpuShare(lambda: [beat["pid"]], 0.15):  # rank 3 gets 15% of a CPU
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
    d = job.describe()
    assert d["Warnings"] == [warning]  # rank 3 only: its peers waited, they were not slow
    # the pre-flight health check before it (tests/e2e/test_health_check.py names a throttled host): every host's
    # figures, nobody far below its peers
    check = d["HealthCheck"]
    assert check["SlowHosts"] == [] and set(check["Hosts"]) == {"algo-1", "algo-2"}
    for host, h in check["Hosts"].items():
        assert h["compute_tflops"] > 0 and h["intra_gbps"] > 0 and h["inter_gbps"] > 0 and h["ranks"] == 2, (host, h)
        assert h["efa"] == {"provider": None, "devices": 0} and h["ratio"] >= 0.7, (host, h)
    assert "[algo-2] driver: health check: algo-1: compute " in log
