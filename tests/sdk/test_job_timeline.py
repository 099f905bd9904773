"""describe()'s timeline of a local job, on job folders written here (fast): the status transitions, the hosts'
phases, BillableTimeInSeconds. A real local job's are checked in tests/e2e/test_local_scripts.py."""
import os
import subprocess
from datetime import datetime, timedelta, timezone

import pytest

from tests.timeline import assert_phases_in_order, assert_transitions_cover_the_job
from trainyard.job.spec import build_spec
from trainyard.sdk.jobs.jobstate import Status, job_dir, write_json
from trainyard.sdk.backends.local.backend import LocalJob


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _iso(dt: datetime) -> str:
    return dt.isoformat()


def _job(name: str, supervisor_pid: int) -> Status:
    d = job_dir(name)
    os.makedirs(f"{d}/logs")
    spec = build_spec(job_name=name, entry_point="train.py", entry_kind="script", instance_type="local",
                      instance_count=2, processes_per_host=1, output_path="s3://bkt/out")
    with open(f"{d}/spec.json", "w") as fh:
        fh.write(spec.to_json())
    write_json(f"{d}/supervisor.json", {"pid": supervisor_pid})
    return Status(f"{d}/status.json")


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_transitions_start_at_creation_and_stay_ordered(home):
    st = _job("order", os.getpid())
    st.transition("Starting", "launching")
    assert st.doc["SecondaryStatusTransitions"][0]["StartTime"] == st.doc["CreationTime"]
    st.transition("Downloading", "data")
    downloading = datetime.fromisoformat(st.doc["SecondaryStatusTransitions"][-1]["StartTime"])
    st.transition("Training", "a time from before the current status is kept after its start",
                  at=_iso(downloading - timedelta(hours=1)))
    assert st.doc["SecondaryStatusTransitions"][-1]["StartTime"] == _iso(downloading)
    st.transition("Uploading", "a time from the future is now", at=_iso(datetime.now(timezone.utc) + timedelta(hours=1)))
    assert datetime.fromisoformat(st.doc["SecondaryStatusTransitions"][-1]["StartTime"]) <= datetime.now(timezone.utc)
    d = LocalJob("order").describe()
    assert assert_transitions_cover_the_job(d) == ["Starting", "Downloading", "Training", "Uploading"]
    assert d["TrainingJobStatus"] == "InProgress" and d["HostPhases"] == {}
    assert "EstimatedCost" not in d  # a local job bills nothing
    st.transition("Completed", "done", status="Completed")
    d = LocalJob("order").describe()
    assert assert_transitions_cover_the_job(d)[-1] == "Completed"
    assert d["LastModifiedTime"] >= d["TrainingEndTime"]


def test_host_phases_and_billable_time_of_an_ended_job(home):
    st = _job("ended", os.getpid())
    created = datetime.fromisoformat(st.doc["CreationTime"])
    st.transition("Starting", "launching")
    at = lambda s: _iso(created + timedelta(seconds=s))  # noqa: E731
    st.update(HostPhases={
        "algo-1": [{"Phase": "data", "StartTime": at(1), "EndTime": at(2)},
                   {"Phase": "capacity", "StartTime": at(3), "EndTime": at(4)},
                   {"Phase": "first_step", "StartTime": at(5), "EndTime": at(7)}],
        "algo-2": [{"Phase": "data", "StartTime": at(2), "EndTime": at(3)}]})
    # a job that took 90 s, ended by hand
    st.doc["SecondaryStatusTransitions"].append({"Status": "Completed", "StartTime": at(90), "EndTime": at(90),
                                                 "StatusMessage": "done"})
    st.doc["SecondaryStatusTransitions"][-2]["EndTime"] = at(90)
    st.update(TrainingJobStatus="Completed", SecondaryStatus="Completed", TrainingEndTime=at(90))
    d = LocalJob("ended").describe()
    assert_phases_in_order(d, {"algo-1": ["data", "capacity", "first_step"], "algo-2": ["data"]})
    assert d["HostPhases"]["algo-1"][2]["StartTime"] == created + timedelta(seconds=5)
    # a local job's wall time, not multiplied by its 2 instances (SageMaker's figure is one instance's)
    assert d["BillableTimeInSeconds"] == 90


def test_a_supervisor_that_died_leaves_a_failed_and_closed_timeline(home):
    st = _job("died", _dead_pid())
    st.transition("Starting", "launching")
    st.transition("Training", "training")
    st.update(HostPhases={"algo-1": [{"Phase": "code", "StartTime": st.doc["CreationTime"]},
                                     {"Phase": "first_step", "StartTime": st.doc["LastModifiedTime"]}]})
    d = LocalJob("died").describe()
    assert d["TrainingJobStatus"] == "Failed" and "ended unexpectedly" in d["FailureReason"]
    assert assert_transitions_cover_the_job(d) == ["Starting", "Training", "Failed"]
    assert d["TrainingEndTime"] == d["LastModifiedTime"]
    assert_phases_in_order(d, {"algo-1": ["code"]})  # the code phase ended with it; no first step was seen
