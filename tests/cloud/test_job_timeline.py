"""An EC2 job's timeline and cost without a cloud (fast): the transitions the controller derives from its nodes'
reports (sdk/backends/ec2/progress.py), and describe()'s BillableTimeInSeconds and EstimatedCost from the instances'
recorded times (sdk/backends/ec2/billing.py) and the catalog's prices. A whole job's are checked in
tests/cloud/test_ec2_lifecycle.py."""
import os
from datetime import datetime, timedelta, timezone

import pytest

from tests.timeline import assert_transitions_cover_the_job
from trainyard.job import catalog
from trainyard.job.spec import build_spec
from trainyard.sdk.backends.ec2 import billing
from trainyard.sdk.backends.ec2 import progress
from trainyard.sdk.backends.ec2.backend import Ec2Job
from trainyard.sdk.jobs.jobstate import Status, job_dir, write_json

T0 = datetime(2026, 11, 24, 8, 0, 0, tzinfo=timezone.utc)
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainyard:1"


def at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat()


def _node(phase_times: dict[str, float], phases: dict[str, tuple[float, float]]) -> dict:
    last = max(phase_times, key=phase_times.get)
    return {"phase": last, "time": at(phase_times[last]), "phase_times": {p: at(t) for p, t in phase_times.items()},
            "phases": [{"Phase": p, "StartTime": at(a), "EndTime": at(b)} for p, (a, b) in phases.items()]}


def test_each_status_starts_when_the_last_node_reaches_it():
    booted = {"capacity": (0, 40), "image": (41, 90), "peers": (91, 95)}
    docs = {"algo-1": _node({"Starting": 91, "Downloading": 96, "Training": 100, "Uploading": 200},
                            {**booted, "first_step": (101, 130), "upload": (200, 210)}),
            "algo-2": _node({"Starting": 92, "Downloading": 97, "Training": 101, "Completed": 199},
                            {"capacity": (0, 45), "image": (46, 93)})}
    assert progress.steps({**docs, "algo-2": None}, "LaunchingMLInstances") == []  # not every node has reported
    got = [(s, t) for s, t, _ in progress.steps(docs, "LaunchingMLInstances")]
    # the last pull started at 46 (algo-2), the last ended at 93; Uploading when algo-2 had ended and algo-1 uploaded
    assert got == [("DownloadingTrainingImage", at(46)), ("PreparingTrainingStack", at(93)), ("Downloading", at(97)),
                   ("Training", at(101)), ("Uploading", at(200))]
    assert [s for s, _, _ in progress.steps(docs, "Training")] == ["Uploading"]
    assert progress.steps(docs, "Interrupted") == []  # after an interruption: the next attempt's launch first
    # nodes whose user data timed no pull (an agent started by hand): no DownloadingTrainingImage
    bare = {h: {**d, "phases": [p for p in d["phases"] if p["Phase"] != "image"]} for h, d in docs.items()}
    got = [(s, t) for s, t, _ in progress.steps(bare, "LaunchingMLInstances")]
    assert got[0] == ("PreparingTrainingStack", at(45))  # the last instance ran at 45
    assert progress.host_phases(docs)["algo-2"] == docs["algo-2"]["phases"]


def test_reports_without_phase_times_count_as_their_phase_only():
    report = {"phase": "Failed", "time": at(50), "exit_code": 1}  # the user data's: no phase_times, no phases
    assert progress.entered(report, "Starting") is None and progress.steps({"algo-1": report}, "LaunchingMLInstances") == []
    bare = {"phase": "Training"}  # reached, at a time it does not say: those transitions are dated now (None)
    assert progress.entered(bare, "Downloading") == "" and progress.entered(bare, "Uploading") is None
    assert progress.steps({"algo-1": bare, "algo-2": {"phase": "Training", "time": at(9)}}, "LaunchingMLInstances") == [
        ("PreparingTrainingStack", None, progress.MESSAGES["PreparingTrainingStack"]),
        ("Downloading", None, progress.MESSAGES["Downloading"]), ("Training", None, progress.MESSAGES["Training"])]
    assert progress.interrupted_at([{"phase_times": {"Interrupted": at(7)}}, {"time": at(5)}]) == at(5)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _ec2_job(name: str, *, spot: bool, records: list[tuple[float, float | None]], region="us-east-1") -> Status:
    d = job_dir(name)
    os.makedirs(f"{d}/logs")
    spot_args = {"use_spot_instances": True, "max_wait": 7200, "max_run": 3600} if spot else {}
    spec = build_spec(job_name=name, entry_point="trainyard.engine.train", entry_kind="module",
                      instance_type="p4d.24xlarge", instance_count=2, processes_per_host=8,
                      output_path="s3://ty-out/jobs", image_uri=IMAGE, **spot_args)
    with open(f"{d}/spec.json", "w") as fh:
        fh.write(spec.to_json())
    write_json(f"{d}/runtime.json", {"backend": "ec2", "region": region})
    write_json(f"{d}/supervisor.json", {"pid": os.getpid()})
    st = Status(f"{d}/status.json")
    st.transition("Starting", "preflight passed")
    st.transition("LaunchingMLInstances", "launching")
    billing.launched(st, [{"InstanceId": f"i-{n}", "LaunchTime": T0 + timedelta(seconds=a)}
                          for n, (a, _) in enumerate(records)], 1)
    for n, (_, b) in enumerate(records):
        if b is not None:
            billing.ended(st, [f"i-{n}"], at=at(b))
    return st


def test_cost_is_instance_hours_times_the_catalogs_price(home):
    # two instances: 1 h and 1.5 h; a third, of a spot job's next attempt, still running
    st = _ec2_job("od", spot=False, records=[(0, 3600), (0, 5400)])
    st.transition("Completed", "done", status="Completed")
    d = Ec2Job("od").describe()
    assert_transitions_cover_the_job(d)
    cost = d["EstimatedCost"]
    price = catalog.price_table()["on_demand"]["us-east-1"]["p4d.24xlarge"]
    assert cost["InstanceHours"] == 2.5 and cost["PricePerHour"] == price
    assert cost["Amount"] == cost["InstanceHours"] * price
    assert cost["Currency"] == "USD" and cost["Market"] == "on-demand"
    assert "prices.json" in cost["Source"] and catalog.price_table()["as_of"] in cost["Source"]
    assert d["BillableTimeInSeconds"] == 4500  # one instance's share: times InstanceCount (2) is 2.5 h
    assert set(cost) == {"Amount", "Currency", "InstanceHours", "PricePerHour", "Market", "Source"}


def test_a_running_spot_jobs_cost_counts_up_to_now(home):
    launched = (datetime.now(timezone.utc) - T0).total_seconds() - 1800  # launched half an hour ago
    _ec2_job("spot", spot=True, records=[(0, 600), (launched, None)])
    d = Ec2Job("spot").describe()
    cost = d["EstimatedCost"]
    table = catalog.price_table()
    assert cost["Market"] == "spot" and "spot estimated" in cost["Source"]
    assert cost["PricePerHour"] == table["on_demand"]["us-east-1"]["p4d.24xlarge"] * (1 - table["spot_discount_estimate"])
    assert cost["Amount"] == cost["InstanceHours"] * cost["PricePerHour"]
    assert 1 / 6 + 0.5 <= cost["InstanceHours"] < 1 / 6 + 0.5 + 0.01  # 10 minutes + half an hour so far
    assert "EndTime" not in d["SecondaryStatusTransitions"][-1]


def test_no_price_no_estimated_cost(home):
    _ec2_job("eu", spot=False, records=[(0, 60)], region="eu-west-1")  # the table lists only G5 there
    d = Ec2Job("eu").describe()
    assert "EstimatedCost" not in d and d["BillableTimeInSeconds"] == 30
