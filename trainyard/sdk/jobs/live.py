"""The live line of a followed job: phase, step k/N, loss, tokens/s, MFU, elapsed and ETA, and the newest warning
of the metrics rows (a straggler named, a checkpoint save skipped).

`fit()`, `wait()`, `logs()` and `trainyard logs -f` follow a job through `Follow`: on a terminal (or in a
notebook) a `rich` live line stays at the bottom while the job's log lines scroll above it; anywhere else
(CI, a file, a pipe) the log lines are printed as they are and the progress comes as plain lines, one when
the phase changes and one every `PLAIN_EVERY_S` while it trains, with no control characters.

The figures come from what the job writes anyway: the status document (phase, creation time), algo-1's
metrics rows (step, loss, tokens/s, MFU; read from where the last look left off) and, for a script that
writes no rows, its log lines: `step K/N`, `step K` or `step=K` (N is then the `steps` hyperparameter), the loss
after it, and the lines a `metric_definitions` entry named `loss` (or `...:loss`) matches.
`TRAINYARD_PROGRESS` = `live` | `plain` | `off` overrides the choice.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from rich.console import Console
from rich.live import Live
from rich.text import Text

from trainyard.sdk.jobs.joblog import parse
from trainyard.sdk.jobs.metrics import measured_peak

PLAIN_EVERY_S = 30.0
MODE_ENV = "TRAINYARD_PROGRESS"
MODES = ("live", "plain", "off")
# SageMaker's secondary statuses, as the four phases a user follows
PHASES = {"Starting": "Starting", "Pending": "Starting", "LaunchingMLInstances": "Starting",
          "PreparingTrainingStack": "Starting", "Downloading": "Downloading",
          "DownloadingTrainingImage": "Downloading", "Training": "Training", "Uploading": "Uploading"}
# `step 5/100`, and without the total `step 5 loss 4.97` or `step=5 loss=4.9` (N then from the `steps` hyperparameter)
_STEP = re.compile(r"\bstep[\s=:]*(\d+)(?:\s*/\s*(\d+))?\b", re.IGNORECASE)
_LOSS = re.compile(r"\bloss[\s=:]+(-?[0-9.]+(?:e[-+]?\d+)?)", re.IGNORECASE)
RATE_WINDOW = 20  # ETA from the pace of the last this-many steps


@dataclass
class Snapshot:
    phase: str
    step: int | None = None
    total: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    mfu_measured: bool = False
    """The MFU's peak was measured at start-up (a CPU, an unknown GPU), not a datasheet's: it moves with the
    machine's load, so the line says so."""
    elapsed_s: float = 0.0
    eta_s: float | None = None
    warning: str | None = None
    """The newest warning of the metrics rows, with its step (a straggler named, a checkpoint skipped)."""

    def text(self) -> str:
        parts = [self.phase]
        if self.step is not None:
            parts.append(f"step {self.step}/{self.total}" if self.total else f"step {self.step}")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        if self.mfu is not None:
            parts.append(f"MFU {100 * self.mfu:.1f}%" + (" of a measured peak" if self.mfu_measured else ""))
        parts.append(f"{duration(self.elapsed_s)} elapsed")
        if self.eta_s is not None:
            parts.append(f"ETA {duration(self.eta_s)}")
        if self.warning:
            parts.append(f"WARNING {self.warning}")
        return " | ".join(parts)


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def duration(seconds: float) -> str:
    s = int(max(0.0, seconds))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """What a job has done so far, from its folder; `snapshot()` is cheap to call often."""

    def __init__(self, job):
        self.job = job
        self.metrics_path = job.metrics_path()
        self.offset = 0
        steps = job.spec.hyperparameters.get("steps")
        self.total = int(steps) if str(steps).isdigit() else None
        # a `metric_definitions` entry named loss (SageMaker's `train:loss` too) feeds the line's loss
        self.loss_regexes = [re.compile(d["Regex"]) for d in job.spec.metric_definitions or ()
                             if d["Name"].rsplit(":", 1)[-1].lower() == "loss"]
        self.step: int | None = None
        self.loss = self.tokens_per_s = self.mfu = None
        self.warning: str | None = None
        self.mfu_measured = False
        self.seen: list[tuple[float, int]] = []  # (the stamp of the log line, step) as first seen
        self.step_times: list[float] = []  # the last rows' step_time_s

    def _at(self, step: int, total: int | None = None, when: float | None = None) -> None:
        if total:
            self.total = total
        if self.step is None or step > self.step:
            self.step = step
            if when is not None:
                self.seen = [*self.seen[-RATE_WINDOW:], (when, step)]

    def observe(self, text: str, when: float | None = None) -> None:
        """A log line (its text without the stamp, and the stamp's time): `step K/N` and `loss X` when a
        script prints them and writes no metrics rows."""
        if self.offset:  # rows are the better source
            return
        m = _STEP.search(text)
        if m:
            self._at(int(m.group(1)), int(m.group(2)) if m.group(2) else None, when)
        for regex in self.loss_regexes:
            found = regex.search(text)
            if found and found.groups():
                try:
                    self.loss = float(found.group(1))
                    return
                except ValueError:
                    pass
        loss = _LOSS.search(text, m.end()) if m else None
        if loss:
            self.loss = float(loss.group(1))

    def _read_rows(self) -> None:
        try:
            with open(self.metrics_path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            measured = measured_peak(row)
            if measured is not None:
                self.mfu_measured = measured
            if isinstance(row.get("step"), int):
                self.step = row["step"]  # the latest row's: a restarted job goes back to its checkpoint
            if isinstance(row.get("step_time_s"), (int, float)):
                self.step_times = [*self.step_times[-RATE_WINDOW:], float(row["step_time_s"])]
            for key in ("loss", "tokens_per_s", "mfu"):
                if isinstance(row.get(key), (int, float)):
                    setattr(self, key, float(row[key]))
            if isinstance(row.get("warnings"), list) and row["warnings"]:
                self.warning = f"at step {row.get('step')}: {row['warnings'][-1]}"

    def _eta(self) -> float | None:
        """The steps left at the pace of the last steps: the engine's own step times when it writes rows,
        else the time between the `step K/N` lines."""
        if not self.total or self.step is None:
            return None
        if self.step_times:
            return (self.total - self.step) * sum(self.step_times) / len(self.step_times)
        if len(self.seen) < 2:
            return None
        (t0, s0), (t1, s1) = self.seen[0], self.seen[-1]
        return (self.total - self.step) * (t1 - t0) / (s1 - s0) if s1 > s0 and t1 > t0 else None

    def snapshot(self, doc: dict | None = None) -> Snapshot:
        """The progress now; `doc` the job's status document when the caller has just read it (one
        DescribeTrainingJob per tick for a SageMaker job, not two)."""
        self._read_rows()
        doc = doc if doc is not None else self.job._status()
        secondary = doc.get("SecondaryStatus", "Starting")
        phase = PHASES.get(secondary, secondary)
        created = datetime.fromisoformat(doc["CreationTime"]) if doc.get("CreationTime") else None
        end = doc.get("TrainingEndTime")
        until = datetime.fromisoformat(end) if end else datetime.now(timezone.utc)
        elapsed = (until - created).total_seconds() if created else 0.0
        return Snapshot(phase=phase, step=self.step, total=self.total, loss=self.loss,
                        tokens_per_s=self.tokens_per_s, mfu=self.mfu, mfu_measured=self.mfu_measured,
                        elapsed_s=elapsed, eta_s=self._eta() if phase == "Training" else None,
                        warning=self.warning)


def mode(stream=None) -> str:
    """`live` on a terminal or in a notebook, else `plain`; `TRAINYARD_PROGRESS` overrides."""
    asked = os.environ.get(MODE_ENV, "").strip().lower()
    if asked in MODES:
        return asked
    console = Console(file=stream or sys.stdout)
    if console.is_jupyter:  # rich draws a live display in a notebook through ipywidgets
        return "live" if importlib.util.find_spec("ipywidgets") else "plain"
    return "live" if console.is_terminal else "plain"


class Follow:
    """Prints a job's log lines (`line()`) with its progress (`tick()`), live or plain (see the module).

    Use as a context manager: the live line is drawn between enter and exit, and its last state stays."""

    def __init__(self, job, *, show_lines: bool = True, stream=None):
        self.progress = Progress(job)
        self.stream = stream or sys.stdout
        self.mode = mode(self.stream)
        self.show_lines = show_lines
        self.live: Live | None = None
        self.last_plain = (None, 0.0, "")  # (phase, when, text) of the last plain progress line
        self.last: Snapshot | None = None

    def __enter__(self) -> "Follow":
        if self.mode == "live":
            console = Console(file=self.stream)
            self.live = Live(Text(""), console=console, refresh_per_second=4, transient=False,
                             redirect_stdout=False, redirect_stderr=False)
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        self.tick(force=True)
        if self.live is not None:
            self.live.stop()

    def line(self, stamped_line: str) -> None:
        """One log line, as stored (stamped): printed, and read for steps."""
        when, text = parse(stamped_line)
        self.progress.observe(text, when)
        if not self.show_lines:
            return
        if self.live is not None:
            self.live.console.print(stamped_line, markup=False, highlight=False, emoji=False, soft_wrap=True)
        else:
            print(stamped_line, file=self.stream, flush=True)

    def tick(self, force: bool = False, doc: dict | None = None) -> None:
        """Redraw the live line; in plain mode print a progress line when one is due. Plain mode with no
        log lines asked for (SageMaker's logs="None") prints nothing at all. `doc`: the job's status document,
        when just read."""
        if self.mode == "off":
            return
        if self.live is None and not self.show_lines:
            return
        snap = self.last = self.progress.snapshot(doc)
        if self.live is not None:
            self.live.update(Text(snap.text(), style="bold"), refresh=force)
            return
        phase, when, said = self.last_plain
        now, line = time.monotonic(), f"[progress] {snap.text()}"
        due = force or snap.phase != phase or (snap.phase == "Training" and now - when >= PLAIN_EVERY_S)
        if due and line != said:  # the same line twice says nothing new (a job that had ended already)
            print(line, file=self.stream, flush=True)
            self.last_plain = (snap.phase, now, line)


class Transfer:
    """Progress of one long transfer on this machine (the code upload): a rich bar on a terminal; plain, one
    line when it is done. `advance(n)` is boto3's transfer callback (bytes since the last call)."""

    def __init__(self, label: str, total_bytes: int, stream=None):
        self.label, self.total, self.done = label, total_bytes, 0
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.bar = None
        if mode(self.stream) == "live":
            from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)
            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                           TimeRemainingColumn(), console=Console(file=self.stream), transient=True)

    def __enter__(self) -> "Transfer":
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total)
        return self

    def advance(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)

    def __exit__(self, exc_type, *_) -> None:
        if self.bar is not None:
            self.bar.stop()
        if exc_type is None and mode(self.stream) != "off":
            took = time.monotonic() - self.started
            print(f"[trainyard] {self.label} in {took:.1f} s", file=self.stream, flush=True)
