"""A job's log: one time-stamped line per event, files per source, read back as one time-ordered story.

Every line of `$TRAINYARD_HOME/jobs/<job>/logs/<source>.log` (`supervisor`, `algo-1`..`algo-N`) starts with
the UTC time it was written, to the millisecond, then one space:

    2026-11-24T08:01:02.123Z [algo-2/3] step 4/20 loss 6.1900

The writers stamp a line when it reaches them: the local supervisor reads each driver's output through a
pipe (`LinePump`, one thread per host, whole lines only, so two writers never share a line), the EC2
controller stamps each CloudWatch event with the event's own time. Readers (`LogReader`) merge the files by
time; the text after the stamp is what the process printed, so metric regexes see the line as on SageMaker.
A line without a stamp (a traceback the supervisor itself printed) takes the time of the line before it in
its file; a file with no stamp at all (a job of an older Trainyard) keeps its lines as they are, first.
"""
from __future__ import annotations

import re
import threading
import time
from datetime import datetime, timezone
from typing import BinaryIO

from trainyard.job.logstamp import stamp, stamped

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (.*)$", re.DOTALL)
# how long a follower holds back fresh lines so that a line another file gets a moment later, with an
# earlier time, is still printed before them (the pump writes within milliseconds of the read)
FOLLOW_HOLD_S = 0.5
# the longest line kept whole; a longer one is cut there and continued on the next line
MAX_LINE = 1 << 16




def parse(line: str) -> tuple[float | None, str]:
    """(epoch seconds or None, the text the process printed)."""
    m = _STAMP.match(line)
    if m is None:
        return None, line
    t = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    return t, m.group(2)


def text_of(line: str) -> str:
    """The line without its stamp."""
    return parse(line)[1]


class LinePump:
    """Copies a pipe into a log file, a stamp in front of every line, on a thread of its own."""

    def __init__(self, source: BinaryIO, path: str):
        self.source, self.path = source, path
        self.thread = threading.Thread(target=self._run, name=f"log-pump {path}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        lost = 0  # lines that could not be written (a full disk): the pipe is drained all the same, or the
        # process writing into it would block
        with self.source, open(self.path, "ab", buffering=0) as out:
            while True:
                line = self.source.readline(MAX_LINE)
                if not line:
                    return
                text = line.rstrip(b"\r\n").decode(errors="replace")
                try:
                    if lost:
                        out.write(stamped(f"[trainyard] {lost} line(s) of this log were lost: no space left on "
                                          f"device for {self.path}").encode() + b"\n")
                        lost = 0
                    out.write(stamped(text).encode() + b"\n")
                except OSError:
                    lost += 1

    def join(self, timeout: float) -> bool:
        """Wait until the pipe's writers are gone and every line is in the file. True if so."""
        self.thread.join(timeout)
        return not self.thread.is_alive()


class LogReader:
    """New lines of a job's log files, merged by time, from where the last call left off.

    `poll()` returns what is complete now, holding back the last `FOLLOW_HOLD_S` seconds (a follower calls
    it in a loop); `poll(final=True)` returns everything left. Lines come back stamped as stored.
    """

    def __init__(self, paths: list[str]):
        self.paths = paths
        self.offsets = dict.fromkeys(paths, 0)
        self.last_time = dict.fromkeys(paths, 0.0)
        self.pending: list[tuple[float, int, str]] = []  # (time, arrival order, line)
        self.arrivals = 0

    def _read_new(self) -> None:
        for path in self.paths:
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[path])
                    data = fh.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # only whole lines; the rest waits for its newline
            self.offsets[path] += end
            for line in data[:end].decode(errors="replace").splitlines():
                t, text = parse(line)
                if t is None:  # unstamped: it follows the line before it in its own file, with its time
                    t = self.last_time[path]
                    line = stamped(text, t) if t else text  # none before it (an older job's file): as it is
                self.last_time[path] = t
                self.pending.append((t, self.arrivals, line))
                self.arrivals += 1

    def poll(self, final: bool = False) -> list[str]:
        self._read_new()
        self.pending.sort()
        if final:
            ready, self.pending = self.pending, []
        else:
            horizon = time.time() - FOLLOW_HOLD_S
            n = next((i for i, (t, _, _) in enumerate(self.pending) if t > horizon), len(self.pending))
            ready, self.pending = self.pending[:n], self.pending[n:]
        return [line for _, _, line in ready]


def job_log_paths(jobdir: str, hosts: list[str]) -> list[str]:
    """The log files of a job: the supervisor's (or controller's), then one per host."""
    return [f"{jobdir}/logs/supervisor.log"] + [f"{jobdir}/logs/{h}.log" for h in hosts]
