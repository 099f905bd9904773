"""A PyTorchJob's status as a SageMaker-style job status (pure: the objects as the API server returns them).

The training operator keeps one condition per type in `status.conditions`, each with its lastTransitionTime:

    Created     -> InProgress, Starting        the job's pods and Services are being made
    Running     -> InProgress, Training        every pod runs
    Restarting  -> InProgress, Restarting      a pod failed and is restarted (restartPolicy OnFailure)
    Suspended   -> InProgress, Suspended       runPolicy.suspend
    Succeeded   -> Completed, Completed
    Failed      -> Failed, Failed              (past activeDeadlineSeconds: Stopped, MaxRuntimeExceeded, as
                                                SageMaker says a job that ran past max_run)

A terminal condition that is True decides; else the newest True one; none yet is Starting. The transitions are
the conditions in time order, each ending where the next starts. A failed job's FailureReason is the first
failing pod's termination message (the driver's failure file: host, rank, exit code, the rank's last lines,
container/kubernetes.py), else the operator's message.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

CONDITIONS = {"Created": ("InProgress", "Starting"), "Running": ("InProgress", "Training"),
              "Restarting": ("InProgress", "Restarting"), "Suspended": ("InProgress", "Suspended"),
              "Succeeded": ("Completed", "Completed"), "Failed": ("Failed", "Failed")}
ORDER = list(CONDITIONS)  # the order of conditions that share one time (the API's times are whole seconds)
TERMINAL_CONDITIONS = ("Succeeded", "Failed")
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
MAX_REASON = 1024  # SageMaker's FailureReason length


def parse_time(text: str | None) -> datetime | None:
    """An API time (`2026-11-24T08:01:02Z`, RFC 3339) as an aware datetime."""
    return datetime.fromisoformat(text) if text else None


def host_of(pod: dict[str, Any]) -> str:
    """`algo-N` of a job's pod: the master is algo-1, worker i is algo-(i+2), as the pods' ranks are (from the
    operator's labels, else from the pod's name, `<job>-worker-<i>`)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    kind, index = labels.get(REPLICA_TYPE_LABEL), labels.get(REPLICA_INDEX_LABEL)
    if kind is None or index is None:
        parts = meta.get("name", "").rsplit("-", 2)
        kind, index = (parts[1], parts[2]) if len(parts) == 3 else ("master", "0")
    n = int(index) if str(index).isdigit() else 0
    return f"algo-{n + (2 if kind.lower() == 'worker' else 1)}"


def job_status(obj: dict[str, Any]) -> dict[str, Any]:
    """TrainingJobStatus, SecondaryStatus, SecondaryStatusTransitions and the times of a PyTorchJob object."""
    status = obj.get("status") or {}
    conditions = sorted((c for c in status.get("conditions") or [] if c.get("type") in CONDITIONS),
                        key=lambda c: (parse_time(c.get("lastTransitionTime")) or datetime.min, ORDER.index(c["type"])))
    created = parse_time(obj.get("metadata", {}).get("creationTimestamp"))
    true = [c for c in conditions if c.get("status") == "True"]
    final = next((c for c in true if c["type"] in TERMINAL_CONDITIONS), None)
    current = final or (true[-1] if true else None)
    primary, secondary = CONDITIONS[current["type"]] if current else ("InProgress", "Starting")
    if final is not None and final["type"] == "Failed" and "deadline" in (final.get("message") or "").lower():
        primary, secondary = "Stopped", "MaxRuntimeExceeded"
    transitions = []
    for c in conditions:
        if c is not current and c["type"] in TERMINAL_CONDITIONS:
            continue  # a terminal condition that is not True (never set by the operator; be safe)
        at = parse_time(c.get("lastTransitionTime")) or created
        if transitions:
            transitions[-1]["EndTime"] = at
        name = secondary if c is final else CONDITIONS[c["type"]][1]
        transitions.append({"Status": name, "StartTime": at, "StatusMessage": c.get("message") or c.get("reason", "")})
        if c is final:
            transitions[-1]["EndTime"] = at
    out: dict[str, Any] = {"TrainingJobStatus": primary, "SecondaryStatus": secondary,
                           "SecondaryStatusTransitions": transitions, "CreationTime": created}
    start = parse_time(status.get("startTime"))
    if start:
        out["TrainingStartTime"] = start
    if final is not None:
        out["TrainingEndTime"] = parse_time(status.get("completionTime")) or transitions[-1]["StartTime"]
    updated = [t for t in (parse_time(c.get("lastUpdateTime")) for c in conditions) if t]
    out["LastModifiedTime"] = max(updated) if updated else created
    if final is not None and final["type"] == "Failed":
        out["FailureReason"] = (final.get("message") or final.get("reason") or "failed")[:MAX_REASON]
    if status.get("replicaStatuses"):
        out["ReplicaStatuses"] = status["replicaStatuses"]
    return out


def pod_failure(pods: list[dict[str, Any]], container: str) -> str | None:
    """The termination message of the first pod whose `container` ended with a non-zero exit code, named by host;
    None when no failed container left a message."""
    found = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if cs.get("name") != container:
                continue
            for state in (cs.get("state") or {}, cs.get("lastState") or {}):
                ended = state.get("terminated") or {}
                if ended.get("exitCode") and (ended.get("message") or "").strip():
                    when = parse_time(ended.get("finishedAt"))
                    found.append((when.timestamp() if when else float("inf"), host_of(pod), ended["message"].strip()))
    if not found:
        return None
    _, host, message = min(found)
    return message if message.startswith(host) else f"{host}: {message}"
