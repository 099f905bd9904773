"""An EC2 job's secondary status from its nodes' reports: the transitions the controller adds, and when.

Each node agent's status object (trainyard/container/node.py) says when its host entered each of its
phases (`phase_times`: Starting, Downloading, Training, Uploading, Completed) and carries the host's timed
phases (`phases`, trainyard/container/phases.py). The job is in a status once its LAST node is, so each
transition is dated by the latest of its nodes' own times (a status passed between two polls still gets
its true start):

    Starting                   fit() created the job (preflight passed, spec uploaded)
    LaunchingMLInstances       fit() provisions and launches the instances, until every one runs (the end
                               of each host's `capacity` phase)
    DownloadingTrainingImage   every node's user data pulls the image (only when each one timed its pull)
    PreparingTrainingStack     every image is pulled (else every instance runs): the agents find their
                               peers and name the hosts
    Downloading                every node reported Downloading: channels are staged
    Training                   every node reported Training
    Uploading                  every node reported Uploading or its end (only the first host uploads)

then the outcome (Completed, Failed, Stopped, MaxRuntimeExceeded) or, for a spot job, Interrupted and
LaunchingMLInstances again for the next attempt. Nothing here calls AWS.
"""
from __future__ import annotations

from datetime import datetime

SEQUENCE = ("Starting", "LaunchingMLInstances", "DownloadingTrainingImage", "PreparingTrainingStack",
            "Downloading", "Training", "Uploading")
NODE_PHASES = ("Starting", "Downloading", "Training", "Uploading", "Completed")  # an agent's, in order
MESSAGES = {
    "DownloadingTrainingImage": "Downloading the training image on the instances",
    "PreparingTrainingStack": "Preparing the instances for training: finding the peers, naming the hosts",
    "Downloading": "Downloading input data on the instances",
    "Training": "Training in progress",
    "Uploading": "Uploading model and output data",
}


def _t(value: str) -> datetime:
    return datetime.fromisoformat(value)


def entered(doc: dict, phase: str) -> str | None:
    """When the node of status object `doc` reached agent phase `phase` or a later one: None when it has
    not, "" when it has at a time it does not say (an object without `phase_times`, such as the user data's
    failure report, has at most its current phase's time)."""
    times = dict(doc.get("phase_times") or {})
    if doc.get("phase") in NODE_PHASES:
        times.setdefault(doc["phase"], doc.get("time") or "")
    reached = [t for p, t in times.items() if p in NODE_PHASES and NODE_PHASES.index(p) >= NODE_PHASES.index(phase)]
    if not reached:
        return None
    known = [t for t in reached if t]
    return min(known, key=_t) if known else ""


def _phase(doc: dict, name: str) -> dict | None:
    return next((p for p in doc.get("phases") or [] if p["Phase"] == name), None)


def _reached(status: str, doc: dict) -> str | None:
    """When the node of `doc` reached the job's `status`."""
    if status == "DownloadingTrainingImage":
        image = _phase(doc, "image")
        return image["StartTime"] if image else None
    if status == "PreparingTrainingStack":
        done = _phase(doc, "image") or _phase(doc, "capacity") or {}
        return done.get("EndTime") or entered(doc, "Starting")
    return entered(doc, status)


def steps(docs: dict[str, dict | None], current: str) -> list[tuple[str, str | None, str]]:
    """The transitions after `current` that every node has reached, in order: (status, time, message); the
    time is None (now) when a node reached it at a time it does not say. None until every node has
    reported; DownloadingTrainingImage is skipped when a node did not time its image pull."""
    if not docs or any(d is None for d in docs.values()) or current not in SEQUENCE:
        return []
    out = []
    for status in SEQUENCE[SEQUENCE.index(current) + 1:]:
        times = [_reached(status, d) for d in docs.values()]
        if None in times:
            if status == "DownloadingTrainingImage":
                continue
            break
        out.append((status, max(times, key=_t) if all(times) else None, MESSAGES[status]))
    return out


def interrupted_at(docs: list[dict]) -> str | None:
    """The first time one of the nodes `docs` reported Interrupted."""
    times = [d.get("phase_times", {}).get("Interrupted") or d.get("time") for d in docs]
    times = [t for t in times if t]
    return min(times, key=_t) if times else None


def host_phases(docs: dict[str, dict | None]) -> dict[str, list[dict]]:
    """{host: its timed phases} of the nodes that reported them."""
    return {h: list(d["phases"]) for h, d in docs.items() if d and d.get("phases") is not None}
