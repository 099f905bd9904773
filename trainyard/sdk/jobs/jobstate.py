"""A local job's folder and its status file: written by the supervisor, read by `Job` handles.

    $TRAINYARD_HOME/jobs/<job>/
        spec.json        the JobSpec
        runtime.json     endpoint, master port, whether hosts get a private /opt/ml
        status.json      TrainingJobStatus, transitions, FailureReason, HostPhases, and for EC2 jobs the
                         instances' InstanceTimes (sdk/backends/ec2/billing.py) (atomic rewrites)
        hosts/algo-N/    each host's /opt/ml root
        hosts/algo-N.phases.json   the phases the host's driver timed (container/phases.py)
        logs/algo-N.log  each host's driver output (rank-prefixed lines); logs/supervisor.log
        torchrun/algo-N/ torchrun's per-rank log files
"""
from __future__ import annotations

import os
import time
from datetime import datetime

from trainyard.container.failure import headline
from trainyard.job.jsonio import now_iso, read_json, write_json
from trainyard.job import space
from trainyard.job.storage import output_prefix
from trainyard.sdk.store import trainyard_home

TERMINAL = ("Completed", "Failed", "Stopped")
__all__ = ["TERMINAL", "Status", "job_dir", "jobs_root", "now_iso", "pid_alive", "read_json", "record_outcome",
           "wait_for", "write_json"]


def jobs_root() -> str:
    return os.path.join(trainyard_home(), "jobs")


def job_dir(job_name: str) -> str:
    return os.path.join(jobs_root(), job_name)


class Status:
    """The status document, with SageMaker's secondary-status transitions: in time order and contiguous
    (each one ends when the next starts), the first starting at `CreationTime`, the last one open (no
    `EndTime`) while the job runs; the final one (Completed, Failed, Stopped, MaxRuntimeExceeded) starts
    and ends at `TrainingEndTime`. `HostPhases` (trainyard/container/phases.py) is kept here too."""

    def __init__(self, path: str):
        self.path = path
        self.doc = read_json(path) if os.path.exists(path) else {
            "TrainingJobStatus": "InProgress", "SecondaryStatus": "Starting", "SecondaryStatusTransitions": [],
            "CreationTime": now_iso(),
        }

    def transition(self, secondary: str, message: str, *, status: str | None = None, at: str | None = None) -> None:
        """Enter `secondary` now, or `at` (a time another process recorded: a host's upload, a node's report),
        kept between the current transition's start and now so that the list stays ordered."""
        trans = self.doc["SecondaryStatusTransitions"]
        t = _between(at, trans[-1]["StartTime"], now_iso()) if trans else self.doc["CreationTime"]
        if trans and "EndTime" not in trans[-1]:
            trans[-1]["EndTime"] = t
        entry = {"Status": secondary, "StartTime": t, "StatusMessage": message}
        if status in TERMINAL:
            entry["EndTime"] = t
            self.doc["TrainingEndTime"] = t
        trans.append(entry)
        self.doc["SecondaryStatus"] = secondary
        if status:
            self.doc["TrainingJobStatus"] = status
        if secondary == "Training":
            self.doc["TrainingStartTime"] = t
        self.doc["LastModifiedTime"] = max(t, now_iso(), key=datetime.fromisoformat)
        self.save()

    def update(self, **fields) -> None:
        self.doc.update(fields)
        self.doc["LastModifiedTime"] = now_iso()
        self.save()

    def save(self) -> None:
        # the status says the disk is full: it is written whatever filled it (job/space.py)
        space.write_anyway(os.path.dirname(self.path), lambda: write_json(self.path, self.doc))


def _between(t: str | None, lo: str, hi: str) -> str:
    """`t` (None: `hi`) kept within [lo, hi], all ISO 8601 times."""
    if t is None:
        return hi
    parsed = datetime.fromisoformat(t)
    if parsed < datetime.fromisoformat(lo):
        return lo
    return hi if parsed > datetime.fromisoformat(hi) else t


def record_outcome(status: Status, spec, outcome: str, reason: str, *, artifacts: bool, log) -> str:
    """Write a job's end into its status and say it with `log`: `outcome` is Completed, Failed, Stopped or
    MaxRuntimeExceeded; `artifacts` when the first host got as far as uploading. Returns TrainingJobStatus."""
    if artifacts:
        status.update(ModelArtifacts={"S3ModelArtifacts": output_prefix(spec.output_path, spec.job_name) + "/model.tar.gz"})
    if outcome == "MaxRuntimeExceeded":
        reason = f"MaxRuntimeExceeded: the job ran longer than max_run={spec.max_run}s and was stopped"
    if reason:
        status.update(FailureReason=reason[:1024])
    final = {"Completed": "Completed", "Failed": "Failed"}.get(outcome, "Stopped")
    message = {"Completed": "Training job completed", "Failed": "Training job failed",
               "Stopped": "Training job stopped", "MaxRuntimeExceeded": "Job stopped: max_run reached"}[outcome]
    status.transition(outcome, message, status=final)
    log(f"job {spec.job_name}: {final}" + (f": {headline(reason)}" if reason else ""))
    return final


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
