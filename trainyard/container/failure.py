"""Which rank failed first, and the FailureReason a user reads.

When one rank dies, its peers fail moments later with collective errors (a gloo pair closed, an
NCCL communicator aborted). Those are echoes, not causes: a failure whose last lines look like one
ranks after any failure that does not, and so does a rank that torchrun itself ended with SIGTERM;
then the earliest wins.
"""
from __future__ import annotations

import os
import re
import signal as signals
from dataclasses import asdict, dataclass

FAILURE_REASON_LIMIT = 1024
# a host failed with an echo: how long the others get to report the cause (the supervisor, the EC2 controller)
ECHO_SETTLE_S = 20.0  # SageMaker keeps the first 1024 characters of /opt/ml/output/failure
LAST_LINES = 20

_ECHO = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ProcessGroupGloo|DistNetworkError"
    r"|DistBackendError|NCCL communicator was aborted|Socket Timeout|recvBytes|Timed out waiting"
)


# the last line of a Python traceback: `ValueError: boom`, as torchrun's prefix may put it (`[rank2]: ...`)
_OWN_ERROR = re.compile(r"^(?:\[rank\d+\]: )?\w+(?:\.\w+)*(?:Error|Exception|Interrupt|Exit)\b.*$", re.MULTILINE)


@dataclass(kw_only=True, slots=True)
class RankFailure:
    host: str
    rank: int
    local_rank: int
    exitcode: int
    """Exit code; negative for a signal (-9 is SIGKILL)."""
    signal: str
    """Signal name when exitcode < 0, else empty."""
    time: float
    last_lines: str

    @property
    def is_echo(self) -> bool:
        # SIGTERM is how torchrun ends a failed rank's peers; SIGKILL (say, the OOM killer) is a cause. A rank
        # whose traceback is its own error was ending already when torchrun's SIGTERM came: a cause too
        if _ECHO.search(self.last_lines):
            return True
        return self.signal == "SIGTERM" and not _OWN_ERROR.search(self.last_lines)

    def reason(self) -> str:
        how = f"was killed by {self.signal}" if self.signal else f"exited with code {self.exitcode}"
        head = f"{self.host} rank {self.rank} (local rank {self.local_rank}) {how}"
        body = self.last_lines.strip()
        text = f"{head}:\n{body}" if body else head
        if len(text) > FAILURE_REASON_LIMIT:  # keep the head and the end of the traceback
            keep = FAILURE_REASON_LIMIT - len(head) - len(":\n...\n")
            text = f"{head}:\n...\n{body[-keep:]}"
        return text

    def to_dict(self) -> dict:
        return asdict(self)


def headline(reason: str) -> str:
    """A FailureReason as one line (the log's FAILED line, an attempt's note, the job's last line): its first
    line, and where that is a rank's head ending in ':' with its traceback below, the traceback's last line (the
    exception) after it rather than a bare colon."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return f"{lines[0]} {lines[-1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def root_cause(failures: list[RankFailure]) -> RankFailure:
    """The failure that caused the others: non-echo first, then one that ended on its own (not by
    torchrun's SIGTERM), then the earliest, then the lowest rank."""
    return min(failures, key=lambda f: (f.is_echo, f.signal == "SIGTERM", f.time, f.rank))


# what `retry_class` names; anything else (an exception in the user's code, an import error, bad
# hyperparameters) is the user's to fix and is never retried
RETRY_CLASSES = ("hang", "lost host", "killed process", "collective error", "disk full", "data corruption",
                 "straggler")


def retry_class(reason: str) -> str | None:
    """The class of a job's FailureReason that a retry may cure (`max_retry_attempts`), or None.

    - hang: the hang detector's diagnosis (container/hang.py);
    - killed process: a rank ended by a signal of its own (SIGKILL from the OOM killer, SIGSEGV, SIGBUS ...);
    - lost host: a host's driver vanished without a report (its machine or container went away);
    - collective error: the root cause is itself a gloo/NCCL error (a link cut, a peer gone mid-collective);
    - disk full: ENOSPC (the space may have been freed: a retry that finds it full again fails the same way);
    - data corruption: a copy of a shard differed from its replicas (engine/components/sdc.py): the retry resumes
      from the last checkpoint, checked before it was saved;
    - straggler: with straggler_remove, ranks still slow at a committed checkpoint ended the attempt there
      (engine/components/stragglers.py): an elastic job goes on from it without their hosts.
    """
    head = reason.split("\n", 1)[0]
    if head.startswith("Hang:"):
        return "hang"
    if " was killed by SIG" in head:
        return "killed process"
    if "the driver exited with status" in head and head.endswith("and no report"):
        return "lost host"
    if "DataCorruption: data corruption: " in reason:
        return "data corruption"
    if "StragglerRemoval: straggler: " in reason:
        return "straggler"
    if _ECHO.search(reason):
        return "collective error"
    if "No space left on device" in reason:
        return "disk full"
    return None


def cause_rank(reason: str) -> int:
    """How surely a host's FailureReason names the cause: 0 a failure that is no echo, 1 a hang diagnosis
    that names a frozen rank (the host that holds it sees it), 2 another hang diagnosis, 3 an echo."""
    head = reason.split("\n", 1)[0]
    if head.startswith("Hang:"):
        return 1 if " stopped" in head.split(";", 1)[0] else 2
    return 3 if _ECHO.search(reason) else 0


def first_cause(reasons: list[str]) -> str:
    """The FailureReason of a job from its hosts' own (where no process saw every rank: EC2): the surest
    (`cause_rank`), the first of those."""
    return min(reasons, key=cause_rank)


def tail(text: str, lines: int = LAST_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def from_rank_logs(*, host: str, rank: int, local_rank: int, exitcode: int, when: float, stderr: str | None,
                   message: str = "") -> RankFailure:
    """A rank's failure from its output files (`stderr` and the `stdout.log` beside it): the last lines of its
    stderr, else (an exit without a traceback) those of its stdout, else `message` (what torchrun's error file
    said), else that it printed nothing. `when` is the exit's time; `exitcode` negative for a signal."""
    text = ""
    if stderr and os.path.exists(stderr):
        # the time of its last words is a finer clock than torchrun's whole seconds, unless the rank said
        # nothing near its end (a silent rank's last words are from its start)
        words = os.path.getmtime(stderr)
        if words >= when - 1.0:
            when = words
        with open(stderr, errors="replace") as fh:
            text = tail(fh.read())
        stdout = os.path.join(os.path.dirname(stderr), "stdout.log")
        if not text and exitcode > 0 and os.path.exists(stdout):  # an exit without a traceback: what it printed
            with open(stdout, errors="replace") as fh:
                printed = tail(fh.read())
            text = f"(nothing on stderr; its last lines on stdout:)\n{printed}" if printed.strip() else ""
    if not text and message and "To enable traceback" not in message:
        text = tail(message)
    if not text and exitcode > 0:  # a rank that exited printing nothing at all: say so, not a bare head
        text = "(it printed nothing on stdout or stderr)"
    signal = signals.Signals(-exitcode).name if exitcode < 0 and -exitcode in signals.valid_signals() else ""
    return RankFailure(host=host, rank=rank, local_rank=local_rank, exitcode=exitcode, signal=signal, time=when,
                       last_lines=text)
