"""Seeing a host's first training step from its driver, which runs torchrun and none of the training code.

The first of these, on this host, counts as its first step:

- a new line in `<root>/output/data/metrics.jsonl` (rank 0 of the first host appends one per step: the
  built-in trainer does);
- a line of one of the host's ranks (torchrun's per-rank `stdout.log` / `stderr.log`, which `--redirects 3
  --tee 3` writes besides the console) that one of the job's `metric_definitions` regexes matches (what
  SageMaker turns into a metric row), or that starts with `step <number>` (`step 4/100 loss ...`,
  `Step 10: ...`; a line such as `resumed from step 3` does not);
- the marker file the driver names in `$TRAINYARD_FIRST_STEP_FILE`, which the engine's built-in trainer
  creates on every rank once its first step is done.

A thread polls every `POLL_S` and reads only what was appended since its last look; the time it notices a
line is the time recorded, so the first step's end is late by at most `POLL_S`. A host whose ranks print
no such line and run no engine trainer sees no first step.
"""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable, Iterable

from trainyard.container.polling import PollThread
from trainyard.job.jsonio import now_iso

POLL_S = 0.25  # how late the first step's end may be recorded, at most
READ_BYTES = 1 << 20  # at most this much of one file per look: a chatty rank cannot stall the watch
STEP_LINE = re.compile(r"^\s*step\s*[:=#]?\s*\d+", re.IGNORECASE)


def rank_logs(log_dir: str) -> str:
    """The glob of torchrun's per-rank output files under its `--log-dir`:
    `<log_dir>/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log`."""
    return os.path.join(log_dir, "*", "attempt_*", "*", "std*.log")


class FirstStepWatch(PollThread):
    """Calls `on_seen(time)` once, from its thread, when the first step shows; `stop()` ends the watch."""

    def __init__(self, metrics_file: str, rank_log_glob: str, regexes: Iterable[str],
                 on_seen: Callable[[str], None], poll: float = POLL_S, marker: str | None = None):
        self.metrics_file, self.rank_log_glob, self.on_seen = metrics_file, rank_log_glob, on_seen
        self.marker = marker
        self.patterns = [STEP_LINE, *(re.compile(r) for r in regexes)]
        # rows written before this run (a resumed job appends to the same file) are not its first step
        self.offsets = {metrics_file: _size(metrics_file)}
        self.seen = False
        super().__init__("first-step", poll)

    def look(self) -> bool:
        if self.check():
            self.seen = True
            self.on_seen(now_iso())
        return self.seen

    def check(self) -> bool:
        """One look: is there a first step now?"""
        if self.marker and os.path.exists(self.marker):
            return True
        if self._new_lines(self.metrics_file):
            return True
        for path in sorted(glob.glob(self.rank_log_glob)):
            if any(p.search(line) for line in self._new_lines(path) for p in self.patterns):
                return True
        return False

    def _new_lines(self, path: str) -> list[str]:
        """The complete lines appended to `path` since the last look (a line being written waits)."""
        offset = self.offsets.get(path, 0)
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(READ_BYTES)
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        if end == 0:
            if len(data) == READ_BYTES:  # one line longer than a whole read: skip it, it is no step line
                self.offsets[path] = offset + len(data)
            return []
        self.offsets[path] = offset + end
        return data[:end].decode(errors="replace").splitlines()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
