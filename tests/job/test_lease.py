"""The checkpoint location's lease (job/lease.py): one live writer, stale leases taken over with a line."""
import json
import time

import pytest

from trainyard.job import lease
from trainyard.job.spec import build_spec
from tests.waiting import within


def test_a_live_lease_refuses_another_job_and_a_stale_one_is_taken_over(tmp_path, monkeypatch):
    loc = f"file://{tmp_path}/ckpt"
    said = []
    lease.take(loc, "job-a", say=said.append)
    lease.take(loc, "job-a", say=said.append)  # the same job again (a retry): still its own
    with pytest.raises(lease.LeaseHeld, match=r"job 'job-a' is writing checkpoints to .*ckpt \(its lease was renewed "
                                              r"\d+ s ago\)"):
        lease.take(loc, "job-b", say=said.append)
    assert said == []
    # known ended (a local job whose status is final): taken over at once
    lease.take(loc, "job-b", alive=lambda name: name != "job-a", say=said.append)
    assert said == [f"checkpoint location {loc}: taking over the lease of job 'job-a': it has ended"]
    # no heartbeat for longer than the TTL: taken over, said so
    path = tmp_path / "ckpt" / lease.NAME
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "heartbeat": time.time() - 500}))
    monkeypatch.setenv("TRAINYARD_LEASE_TTL_S", "300")
    lease.take(loc, "job-c", say=said.append)
    assert said[-1] == f"checkpoint location {loc}: taking over the lease of job 'job-b': no heartbeat for 500 s " \
                       "(more than 300 s)"
    assert lease.read(loc)["job"] == "job-c"


def test_the_heartbeat_renews_and_releases_only_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "RENEW_S", 0.05)
    loc = f"file://{tmp_path}/ckpt"
    lease.take(loc, "job-a")
    first = lease.read(loc)["heartbeat"]
    beat = lease.Heartbeat([loc], "job-a", say=print).start()
    within(lambda: lease.read(loc)["heartbeat"] > first, 10, interval=0.05)
    assert lease.read(loc)["heartbeat"] > first
    beat.stop()
    assert lease.read(loc) is None  # removed at the end
    lease.take(loc, "job-b")
    said = []
    lease.Heartbeat([loc], "job-a", say=said.append).stop()
    assert lease.read(loc)["job"] == "job-b"  # someone else's is left alone


def test_locations_are_the_checkpoint_uri_and_the_trainer_s():
    common = dict(job_name="j", instance_type="local", processes_per_host=1, output_path="s3://bkt/out",
                  checkpoint_s3_uri="s3://bkt/ckpt/")
    spec = build_spec(entry_point="trainyard.engine.train", entry_kind="module",
                      hyperparameters={"checkpoint_uri": "s3://bkt/trainer"}, **common)
    assert lease.locations(spec) == ["s3://bkt/ckpt", "s3://bkt/trainer"]
    script = build_spec(entry_point="train.py", entry_kind="script", hyperparameters={"checkpoint_uri": "s3://bkt/x"},
                        **common)
    assert lease.locations(script) == ["s3://bkt/ckpt"]


def test_a_location_above_or_below_a_live_one_is_refused_too(tmp_path):
    """s3://b/run and s3://b/run/sub overlap: the first job lists, restores and purges what the second writes."""
    run = f"file://{tmp_path}/ckpt/run"
    lease.take(run, "job-a")
    for other in (f"{run}/sub", f"file://{tmp_path}/ckpt"):
        with pytest.raises(lease.LeaseHeld, match="job 'job-a' is writing checkpoints to"):
            lease.take(other, "job-b")
    lease.take(f"file://{tmp_path}/ckpt/run2", "job-b")  # a sibling does not overlap
    lease.take(f"{run}/sub", "job-b", alive=lambda name: name != "job-a")  # job-a has ended
