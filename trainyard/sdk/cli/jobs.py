"""`trainyard jobs | metrics | report | rm | prune`: the jobs of this machine, read from their folders.

A job is `$TRAINYARD_HOME/jobs/<job>/` (see `jobstate.py`), whichever backend ran it; `open_job` gives its
handle. These commands only read a folder (`report` writes one file where it is told), or delete the whole
folder of a job that has ended: nothing outside `jobs_root()` is touched (a job's artifacts in object storage
stay).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from trainyard.errors import ConfigError
from trainyard.sdk.backends import open_job
from trainyard.sdk.jobs.format import console, fitting_columns, human_duration, local_time, print_table
from trainyard.sdk.jobs.job import TrainingJob
from trainyard.sdk.jobs.jobstate import TERMINAL, jobs_root

JOB_COLUMNS = ["name", "status", "hosts", "started", "duration", "last step/loss"]
NO_METRICS_HINT = ("a script reports metrics by printing lines that the Estimator's metric_definitions match "
                   "(metric_definitions=[{\"Name\": \"loss\", \"Regex\": \"loss=([0-9.]+)\"}]), or by appending JSON "
                   "rows such as {\"step\": 10, \"loss\": 2.3} to $SM_OUTPUT_DATA_DIR/metrics.jsonl")
# errors that mean "this folder is not a job we can read": missing or half-written files, a bad spec
UNREADABLE = (OSError, ValueError, KeyError, TypeError)


@dataclass
class JobInfo:
    """One folder under jobs_root(): a readable job (`job`, `desc`) or why it is not (`error`)."""

    name: str
    path: str
    job: TrainingJob | None = None
    desc: dict | None = None
    error: str | None = None

    @property
    def status(self) -> str | None:
        return self.desc["TrainingJobStatus"] if self.desc else None

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL

    @property
    def created(self) -> float:
        t = self.desc.get("CreationTime") if self.desc else None
        return t.timestamp() if isinstance(t, datetime) else _mtime(self.path)

    @property
    def end_time(self) -> float | None:
        """When it ended: TrainingEndTime, else the status's last change (a supervisor that died)."""
        if not self.ended:
            return None
        for k in ("TrainingEndTime", "LastModifiedTime"):
            if isinstance(self.desc.get(k), datetime):
                return self.desc[k].timestamp()
        return _mtime(os.path.join(self.path, "status.json"))


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _why(e: Exception) -> str:
    if isinstance(e, OSError) and e.filename:
        return f"{e.strerror or type(e).__name__}: {os.path.basename(str(e.filename))}"
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:100]}" if first else type(e).__name__


def read_job(name: str) -> JobInfo:
    """The job of folder `name`; an unreadable one carries the reason instead of raising."""
    info = JobInfo(name, os.path.join(jobs_root(), name))
    try:
        info.job = open_job(name)
        info.desc = info.job.describe()
    except UNREADABLE as e:
        info.job, info.desc, info.error = None, None, _why(e)
    return info


def list_jobs() -> list[JobInfo]:
    """Every folder under jobs_root(), newest first (by creation time)."""
    root = jobs_root()
    try:
        names = [n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))]
    except FileNotFoundError:
        names = []
    return sorted((read_job(n) for n in names), key=lambda i: (i.created, i.name), reverse=True)


def _number(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def last_step_loss(rows: list[dict]) -> str:
    """`step 120, loss 2.31` from the newest `step` and `loss` of the metric rows; without either, the
    newest other number (`train:acc 0.91`); '' for none."""
    step = loss = None
    for row in rows:
        step = row.get("step", step)
        loss = row.get("loss", loss)
    parts = ([f"step {_number(step)}"] if step is not None else []) + \
            ([f"loss {_number(loss)}"] if loss is not None else [])
    if parts:
        return ", ".join(parts)
    for row in reversed(rows):
        numbers = [(k, v) for k, v in row.items() if k != "timestamp" and isinstance(v, (int, float))]
        if numbers:
            return f"{numbers[-1][0]} {_number(numbers[-1][1])}"
    return ""


def job_row(info: JobInfo, now: float) -> list[str]:
    if info.desc is None:
        return [info.name, f"unreadable ({info.error})", "", local_time(datetime.fromtimestamp(info.created,
                                                                                               timezone.utc)), "", ""]
    d, spec = info.desc, info.job.spec
    created = d.get("CreationTime")
    end = info.end_time if info.ended else now
    duration = human_duration(end - created.timestamp()) if isinstance(created, datetime) and end else ""
    try:
        last = last_step_loss(info.job.metrics())
    except UNREADABLE as e:
        last = f"unreadable ({_why(e)})"
    return [info.name, d["TrainingJobStatus"], f"{spec.instance_count} x {spec.instance_type}",
            local_time(created if isinstance(created, datetime) else None), duration, last]


def show_jobs() -> int:
    """`trainyard jobs`."""
    jobs = list_jobs()
    if not jobs:
        print(f"no jobs under {jobs_root()}")
        return 0
    now = time.time()
    print_table(JOB_COLUMNS, [job_row(i, now) for i in jobs])
    return 0


def show_metrics(name: str, as_json: bool = False, tail: int | None = None) -> int:
    """`trainyard metrics JOB [--json] [--tail N]`."""
    rows = open_job(name).metrics()
    if not rows:
        print(f"no metrics for {name} yet: {NO_METRICS_HINT}", file=sys.stderr if as_json else sys.stdout)
        return 0
    if tail:
        rows = rows[-tail:]
    if as_json:
        for row in rows:
            print(json.dumps(row, default=str))
        return 0
    keys: list[str] = []
    for row in rows:
        keys += [k for k, v in row.items() if k not in keys and k != "timestamp"
                 and isinstance(v, (int, float, str, bool))]  # nested values: --json shows them
    keys = [k for k in ("step", "loss") if k in keys] + [k for k in keys if k not in ("step", "loss")]
    timed = any(isinstance(r.get("timestamp"), (int, float)) for r in rows)
    table = []
    for row in rows:
        cells = ["" if row.get(k) is None or isinstance(row.get(k), (dict, list)) else _number(row[k]) for k in keys]
        if timed:
            t = row.get("timestamp")
            cells.append(local_time(datetime.fromtimestamp(t, timezone.utc)) if isinstance(t, (int, float)) else "")
        table.append(cells)
    headers = keys + (["time"] if timed else [])
    out = console()
    if out.is_terminal:  # the columns that fit, whole, rather than every column squeezed to a few characters
        shown = fitting_columns(headers, table, out.width, keep=min(2, len(headers)))
        if shown < len(headers):
            left = headers[shown:]
            headers, table = headers[:shown], [r[:shown] for r in table]
            print_table(headers, table, right=tuple(keys))
            print(f"{len(left)} more column(s) do not fit this terminal: {', '.join(left)}; "
                  f"trainyard metrics {name} --json shows every one")
            return 0
    print_table(headers, table, right=tuple(keys))
    return 0


def write_job_report(name: str, path: str | None = None) -> int:
    """`trainyard report JOB [-o FILE]`: the job's HTML report (sdk/jobs/report.py); prints the path written.
    1 when plotly, which draws it, is not installed."""
    job = open_job(name)
    try:
        print(job.report(path))
    except ImportError as e:
        print(f"trainyard: {e}", file=sys.stderr)
        return 1
    return 0


def job_folder(name: str) -> str:
    """The folder of job `name`, which must be a plain name of a folder directly under jobs_root()."""
    root = jobs_root()
    path = os.path.join(root, name)
    if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
        raise ConfigError("JOB", f"{name!r} is not a job name (a job is a folder directly under {root})")
    if not os.path.isdir(path) or os.path.islink(path):
        raise ConfigError("JOB", f"no job named {name!r} under {root} (`trainyard jobs` lists them)")
    return path


def remove(names: list[str], force: bool = False) -> int:
    """`trainyard rm JOB [JOB...] [--force]`: 0 when every job was deleted, else 1 (2: a name is no job)."""
    rc = 0
    for name in names:
        try:
            path = job_folder(name)
        except ConfigError as e:
            print(f"trainyard: {e}", file=sys.stderr)
            rc = max(rc, 2)
            continue
        info = read_job(name)
        if info.desc is None and not force:
            print(f"trainyard: {name}: its status cannot be read ({info.error}); pass --force to delete the "
                  f"folder {path} anyway", file=sys.stderr)
            rc = max(rc, 1)
            continue
        if info.desc is not None and not info.ended:
            if not force:
                print(f"trainyard: {name} is running ({info.status}): `trainyard stop {name}` it first, or pass "
                      "--force to stop it and delete it", file=sys.stderr)
                rc = max(rc, 1)
                continue
            try:
                info.job.stop()
            except TimeoutError as e:
                print(f"trainyard: {name}: {e}; not deleted", file=sys.stderr)
                rc = max(rc, 1)
                continue
            print(f"stopped {name}")
        shutil.rmtree(path)
        print(f"deleted {name} ({path})")
    return rc


def prune(older_than_s: float, older_than: str, dry_run: bool = False) -> int:
    """`trainyard prune --older-than DURATION [--dry-run]`: delete the folders of ended jobs whose end is
    older than that. Running and unreadable jobs are never deleted."""
    now = time.time()
    old = [i for i in list_jobs() if i.ended and now - i.end_time >= older_than_s]
    if not old:
        print(f"no ended jobs older than {older_than} under {jobs_root()}")
        return 0
    for i in sorted(old, key=lambda i: i.end_time):
        ended = local_time(datetime.fromtimestamp(i.end_time, timezone.utc))
        if not dry_run:
            shutil.rmtree(i.path)
        print(f"{'would delete' if dry_run else 'deleted'} {i.name} ({i.status}, ended {ended})")
    return 0
