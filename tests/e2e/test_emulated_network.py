"""Emulated network for local jobs: per-host namespaces, shaped links, nothing left behind (root only)."""
import re

import pytest

from trainyard import Estimator
from trainyard.sdk.backends.local import netem
from trainyard.errors import ConfigError, JobFailedError

from .helpers import SCRIPTS, assert_no_processes_left, store_client

needs_root = pytest.mark.skipif(netem.unavailable_reason() is not None,
                                reason=f"emulated network unavailable: {netem.unavailable_reason()}")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), needs_root]


def _est(mbit, **kw):
    args = dict(entry_point="sm_train.py", source_dir=SCRIPTS, instance_type="local", instance_count=2,
                processes_per_host=2, max_run=240, emulated_network={"bandwidth_mbit": mbit, "delay_ms": 0.2})
    args.update(kw)
    return Estimator(**args)


@pytest.fixture(scope="module")
def dataset():
    store_client().put_object(Bucket="e2e-net", Key="train/a.txt", Body=b"a")
    return "s3://e2e-net/train"


def _allreduce_seconds(job) -> tuple[float, str]:
    m = re.search(r"\[algo-1/0\] allreduce_s=([0-9.]+) master=(\S+) at=(\S+)", job.log_text())
    assert m, job.log_text()[-3000:]
    assert m.group(2) == "algo-1", m.group(2)  # SageMaker's master name, resolved inside the host's namespace
    return float(m.group(1)), m.group(3)


def test_hosts_talk_over_shaped_links_and_nothing_stays(dataset):
    before = set(netem.leftovers())
    slow = _est(50, hyperparameters={"mode": "bandwidth"})
    slow.fit({"train": dataset}, logs=False)
    fast = _est(2000, hyperparameters={"mode": "bandwidth"})
    fast.fit({"train": dataset}, logs=False)
    t_slow, master = _allreduce_seconds(slow.latest_training_job)
    t_fast, _ = _allreduce_seconds(fast.latest_training_job)
    assert master.startswith(("198.18.", "198.19.")) and master.endswith(".1")
    # a ring all-reduce of 8 MiB over 2 hosts sends at least 4 MiB across each host's link:
    # >= 0.67 s at 50 Mbit/s, far less at 2000
    assert t_slow > 0.6 and t_slow > 4 * t_fast, (t_slow, t_fast)
    # model upload went through the relay to the object store
    assert slow.latest_training_job.describe()["TrainingJobStatus"] == "Completed"
    assert set(netem.leftovers()) == before
    for est in (slow, fast):
        assert_no_processes_left(est.latest_training_job)


def test_failure_removes_the_network_too(dataset):
    before = set(netem.leftovers())
    est = _est(1000, hyperparameters={"mode": "raise", "fail_rank": 2})
    with pytest.raises(JobFailedError, match="algo-2 rank 2"):
        est.fit({"train": dataset}, logs=False)
    assert set(netem.leftovers()) == before
    assert_no_processes_left(est.latest_training_job)


def test_bad_network_settings(tmp_path):
    with pytest.raises(ConfigError, match="bandwidth_mbit must be > 0"):
        _est(0)
    with pytest.raises(ConfigError, match="emulated_network: only for instance_type='local'"):
        _est(100, instance_type="ml.p4d.24xlarge", output_path="s3://bucket/out")


def test_plan_is_deterministic_and_avoids_taken_nets():
    a = netem.Plan.for_job("job-x", 3)
    assert a == netem.Plan.for_job("job-x", 3) and len(a.host_ns(2)) <= 15 and len(a.gateway) <= 15
    b = netem.Plan.for_job("job-x", 3, taken={a.net})
    assert b.net != a.net and b.prefix().startswith(("198.18.", "198.19."))
    assert a.host_ns(0).startswith(netem.PREFIX) and a.switch_ns.startswith(netem.PREFIX)
