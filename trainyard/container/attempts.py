"""What follows an ended attempt of a job: one policy for every backend.

`decide` reads how an attempt ended and says what comes next: `restart` the whole job (it resumes from its
last committed checkpoint), `shrink` it onto the hosts that are left (`elastic`, where a lost host cannot
come back), or `end` it. The local supervisor and the EC2 controller poll their hosts, call `decide`, and act;
`record` writes the attempt into the status document's `Attempts` (describe() shows them). SageMaker and
Kubernetes restart jobs themselves: `sagemaker_retry` and `kubernetes_retry` translate `max_retry_attempts`
into their requests.

The numbers: attempt 1 is the first run; `max_retry_attempts` more may follow, for a failure that a retry may
cure (container/failure.py `retry_class`: a hang, a killed process, a lost host, a collective error, a full
disk, data corruption, a straggler left out) or an interruption (a spot reclaim, an instance gone). A user's
error is never retried.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from trainyard.container.failure import FAILURE_REASON_LIMIT, headline, retry_class

Action = Literal["restart", "shrink", "end"]


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str
    """One line for the log and the status message ("" when the attempt simply ended)."""
    retry_class: str | None
    hosts: int
    """The host count of the next attempt (fewer than now only for `shrink`)."""


def decide(*, outcome: str, reason: str, attempt: int, max_retry_attempts: int, instance_count: int,
           lost_hosts: Sequence[str] = (), elastic_min: int | None = None, stopping: bool = False) -> Decision:
    """What follows attempt `attempt`, which ended with `outcome` ("Completed", "Failed", "Interrupted",
    "Stopped", "MaxRuntimeExceeded") and `reason` (its FailureReason). `lost_hosts`: hosts gone for good;
    `elastic_min`: the job's `elastic.min_instance_count` (None without elastic); `stopping`: a stop was asked."""
    cls = "lost host" if outcome == "Interrupted" else retry_class(reason) if outcome == "Failed" else None
    if outcome not in ("Failed", "Interrupted") or stopping:
        return Decision("end", "", cls, instance_count)
    if cls is None:
        why = f"attempt {attempt} failed with an error a retry does not cure: not retried" if max_retry_attempts \
            else ""
        return Decision("end", why, None, instance_count)
    if attempt > max_retry_attempts:
        return Decision("end", f"{headline(reason) if reason else outcome} and no retry is left "
                               f"(max_retry_attempts={max_retry_attempts})", cls, instance_count)
    why = f"attempt {attempt} failed ({cls}): {headline(reason)[:200] if reason else outcome}"
    left = instance_count - len(lost_hosts)
    if cls == "lost host" and lost_hosts and elastic_min is not None and left >= elastic_min:
        return Decision("shrink", f"{why}; elastic: {', '.join(lost_hosts)} lost for good, going on with {left} "
                                  "host(s)", cls, left)
    damaged = corrupt_hosts(reason) if cls == "data corruption" else []
    left = instance_count - len(damaged)
    if damaged and elastic_min is not None and left >= elastic_min:
        return Decision("shrink", f"{why}; elastic: leaving out {', '.join(damaged)}, whose copy differed from its "
                                  f"replicas', going on with {left} host(s)", cls, left)
    slow = straggler_hosts(reason) if cls == "straggler" else []
    left = instance_count - len(slow)
    if slow and elastic_min is not None and left >= elastic_min:
        return Decision("shrink", f"{why}; elastic: leaving out {', '.join(slow)}, whose rank(s) straggled, going on "
                                  f"with {left} host(s)", cls, left)
    return Decision("restart", why, cls, instance_count)


# the data-corruption check's verdict when a majority of the replicas agree (engine/components/sdc.py): the ranks
# named there hold the odd copies; with 2 replicas it names both and no host is left out
_OUTVOTED = re.compile(r"the parameters of (.+?) differ from the other replicas")


def corrupt_hosts(reason: str) -> list[str]:
    """The hosts whose copy of a shard the majority of its replicas outvoted, from a data-corruption failure."""
    found = _OUTVOTED.search(reason)
    return sorted(set(re.findall(r"rank \d+ \(([^)]+)\)", found.group(1)))) if found else []


# straggler_remove's verdict (engine/components/stragglers.py `removal`)
_STRAGGLED = re.compile(r"the job goes on without (.+?) \(straggler_remove\)")


def straggler_hosts(reason: str) -> list[str]:
    """The hosts whose ranks were still slow at the checkpoint where straggler_remove ended the attempt."""
    found = _STRAGGLED.search(reason)
    return sorted(h.strip() for h in found.group(1).split(",")) if found else []


def record(status, attempt: int, outcome: str, reason: str = "", cls: str | None = None, **extra: Any) -> None:
    """Attempt `attempt` in the status document's `Attempts` (`status`: a job's Status, sdk/jobs/jobstate.py):
    its outcome, its FailureReason (SageMaker's first 1024 characters) and retry class when it failed, and
    `extra` (StartTime, InstanceCount ...)."""
    entry: dict[str, Any] = {"Attempt": attempt, **extra, "Outcome": outcome}
    if reason:
        entry.update(FailureReason=reason[:FAILURE_REASON_LIMIT], RetryClass=cls)
    status.update(Attempts=[*status.doc.get("Attempts", []), entry])


def sagemaker_retry(max_retry_attempts: int) -> dict[str, Any]:
    """CreateTrainingJob's part: SageMaker restarts a job that failed with an internal error, up to this count."""
    return {"RetryStrategy": {"MaximumRetryAttempts": max_retry_attempts}} if max_retry_attempts else {}


def kubernetes_retry(max_retry_attempts: int) -> dict[str, Any]:
    """The PyTorchJob's part: a failed pod restarts (OnFailure) up to `max_retry_attempts` times in all
    (backoffLimit), or the job fails at once (Never)."""
    return {"restartPolicy": "OnFailure" if max_retry_attempts else "Never", "backoffLimit": max_retry_attempts}
