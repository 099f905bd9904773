"""`algo-N` names resolve on every host of a local job, to loopback or to the emulated network's addresses,
for Python lookups and for torch.distributed's own (C++) connection to `tcp://algo-1:port`."""
import json
import re

import pytest

from trainyard import Estimator
from trainyard.sdk.jobs.joblog import text_of

from .helpers import SCRIPTS, assert_no_processes_left, read_tar, store_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def dataset():
    store_client().put_object(Bucket="e2e-names", Key="train/a.txt", Body=b"a")
    return "s3://e2e-names/train"


def _host_log(job, host: str) -> str:
    with open(f"{job.dir}/logs/{host}.log", errors="replace") as fh:
        return "\n".join(text_of(line) for line in fh.read().splitlines())  # without the time stamps


@pytest.mark.parametrize("network", ["loopback", "emulated"])
def test_scripts_reach_their_peers_by_host_name(dataset, network):
    extra = {"emulated_network": {"bandwidth_mbit": 1000, "delay_ms": 0.2}} if network == "emulated" else {}
    est = Estimator(entry_point="sm_hostnames.py", source_dir=SCRIPTS, instance_type="local", instance_count=2,
                    processes_per_host=1, max_run=240, **extra)
    est.fit({"train": dataset}, logs=False)
    job = est.latest_training_job
    d = job.describe()
    assert d["TrainingJobStatus"] == "Completed", d.get("FailureReason")

    logs = {h: _host_log(job, h) for h in ("algo-1", "algo-2")}
    if network == "emulated":
        m = re.search(r"algo-1 (198\.1[89]\.\d+)\.1, algo-2 \1\.2 through", logs["algo-1"])
        assert m, logs["algo-1"][:2000]
        want = {"algo-1": f"{m.group(1)}.1", "algo-2": f"{m.group(1)}.2"}
    else:
        want = {"algo-1": "127.0.0.1", "algo-2": "127.0.0.1"}
    for host, text in logs.items():
        # the launcher's first line says how the names resolve: a private /etc/hosts (a mount namespace as
        # root, a user namespace too otherwise), as torch's C++ lookup of tcp://algo-1 needs
        first = text.splitlines()[0]
        assert first.startswith(f"[{host}] host names: algo-1 {want['algo-1']}, algo-2 {want['algo-2']} "
                                "through a private /etc/hosts ("), first
        assert f"resolved {json.dumps(want, sort_keys=True)}" in text

    result = json.loads(read_tar(d["ModelArtifacts"]["S3ModelArtifacts"])["hostnames.json"])
    assert result["sum"] == 3.0 and result["world"] == 2  # rank 0 + 1, rank 1 + 1: both joined over tcp://algo-1
    assert result["seen"] == [{"host": "algo-1", "resolved": want}, {"host": "algo-2", "resolved": want}]
    assert_no_processes_left(job)
