"""Checks of a `describe()`'s timeline, shared by the local (tests/sdk, tests/e2e) and EC2 (tests/cloud) tests:
the secondary status transitions and the hosts' phases."""
from datetime import datetime

TERMINAL = ("Completed", "Failed", "Stopped", "MaxRuntimeExceeded")


def assert_transitions_cover_the_job(d: dict) -> list[str]:
    """`SecondaryStatusTransitions` are ordered and contiguous (each ends when the next starts), start at
    CreationTime and, once the job ended, end at TrainingEndTime; times are datetimes like CreationTime's.
    Returns the statuses in order."""
    trans = d["SecondaryStatusTransitions"]
    assert trans, d
    assert all(isinstance(t[k], datetime) for t in trans for k in ("StartTime", "EndTime") if k in t)
    assert all(set(t) <= {"Status", "StartTime", "EndTime", "StatusMessage"} and t["StatusMessage"] for t in trans)
    assert trans[0]["StartTime"] == d["CreationTime"], (trans[0], d["CreationTime"])
    for a, b in zip(trans, trans[1:]):
        assert a["StartTime"] <= a["EndTime"] == b["StartTime"], (a, b)
    if d["TrainingJobStatus"] == "InProgress":
        assert "EndTime" not in trans[-1]
    else:
        assert trans[-1]["Status"] in TERMINAL and trans[-1]["StartTime"] == trans[-1]["EndTime"] == d["TrainingEndTime"]
    return [t["Status"] for t in trans]


def assert_phases_in_order(d: dict, expected: dict[str, list[str]]) -> None:
    """`HostPhases` has exactly the `expected` phases of each host, one after the other in time order, each
    ended by the job's end (TrainingEndTime), times as datetimes."""
    phases = d["HostPhases"]
    assert {h: [p["Phase"] for p in ps] for h, ps in phases.items()} == expected, phases
    end = d.get("TrainingEndTime")
    for host, ps in phases.items():
        for p in ps:
            assert isinstance(p["StartTime"], datetime) and isinstance(p["EndTime"], datetime), (host, p)
            assert p["StartTime"] <= p["EndTime"], (host, p)
            assert end is None or p["EndTime"] <= end, (host, p, end)
        for a, b in zip(ps, ps[1:]):
            assert a["EndTime"] <= b["StartTime"], (host, a, b)
