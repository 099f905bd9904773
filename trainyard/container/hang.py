"""Hang detection over the ranks' heartbeats (trainyard/engine/components/heartbeat.py), and the culprit.

`HangWatch.check()` reads every rank's heartbeat file; a job hangs when no rank's state (step, phase,
collective, its number, inside it or not) has changed for `timeout_s`. Ranks that have exited or whose
process is gone are not counted (a crash is the launcher's to report, not a hang).

`diagnose()` names the rank at fault, by the first rule that picks anyone:

1. a frozen process: stopped (`T` in /proc/<pid>/stat: SIGSTOP, a debugger) or one whose heartbeat thread
   stopped writing for `STALE_S` (a C call holding the GIL);
2. ranks outside any collective while others wait inside one: the others wait for them;
3. the ranks with the lowest collective number: they are behind the ones that went on.

The reason reads as SageMaker's FailureReason does, one line first:

    Hang: rank 3 (algo-2) stopped in backward at step 41 (SIGSTOP); ranks 0-2 wait in all_gather_into_tensor #5123
"""
from __future__ import annotations

import glob
import json
import os
import signal
import time
from dataclasses import asdict, dataclass

from trainyard.container.polling import PollThread
from trainyard.job.jsonio import write_json

STALE_S = 5.0  # a heartbeat older than this: the process does not run (its writer thread writes every 1 s)
STACKS_WAIT_S = 2.0  # after SIGUSR2, how long the ranks get to write their stacks
HANG_WATCH_ENV = "TRAINYARD_HANG_WATCH"  # "driver": the driver watches its own host's ranks (EC2 nodes)


def heartbeat_dir(log_dir: str) -> str:
    """Where a host's ranks keep their heartbeats: under the driver's torchrun log folder."""
    return os.path.join(log_dir, "heartbeat")


@dataclass(frozen=True)
class Beat:
    rank: int
    host: str
    pid: int
    time: float
    step: int | None
    phase: str
    collective: str | None
    seq: int
    waiting: bool

    @property
    def signature(self) -> tuple:
        return self.step, self.phase, self.collective, self.seq, self.waiting

    def to_dict(self) -> dict:
        return asdict(self)


def read_beats(pattern: str) -> dict[int, Beat]:
    """The heartbeats matching `pattern` (a glob of `rank-<R>.json` files), by rank."""
    beats = {}
    for path in glob.glob(pattern):
        try:
            with open(path) as fh:
                d = json.load(fh)
            beat = Beat(rank=int(d["rank"]), host=str(d.get("host", "?")), pid=int(d["pid"]),
                        time=float(d["time"]), step=d.get("step"), phase=str(d.get("phase", "?")),
                        collective=d.get("collective"), seq=int(d.get("seq", 0)), waiting=bool(d.get("waiting")))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced right now, or not a heartbeat
        beats[beat.rank] = beat
    return beats


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat (R, S, D, T, t, Z ...), or "" when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2,5"; [3] -> "rank 3"."""
    ranks = sorted(ranks)
    spans, start = [], ranks[0]
    for prev, r in zip(ranks, ranks[1:] + [None]):
        if r is None or r != prev + 1:
            spans.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = r
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {','.join(spans)}"


def stack_top(text: str) -> str:
    """The innermost frame of the main thread in a faulthandler dump: `train.py:52 in forward`."""
    blocks = text.split("\n\n")
    main = next((b for b in blocks if "Current thread" in b), None) or (blocks[-1] if blocks else "")
    for line in main.splitlines():
        line = line.strip()
        if line.startswith("File "):  # File "/x/train.py", line 52 in forward
            path, _, rest = line[len('File "'):].partition('", line ')
            return f"{os.path.basename(path)}:{rest}"
    return ""


# the heartbeat's phases (engine/components/heartbeat.py) as the diagnosis says them, where the name alone reads
# oddly ("stopped in starting")
PHASE_WORDS = {"starting": "start-up (before its first step)", "exited": "its exit"}


def diagnose(beats: list[Beat], now: float, states: dict[int, str] | None = None,
             stacks: dict[int, str] | None = None) -> tuple[str, list[int]]:
    """(the FailureReason's first line, the culprit ranks) for hung `beats`."""
    states = {b.pid: process_state(b.pid) for b in beats} if states is None else states
    stacks = stacks or {}
    frozen = [b for b in beats if states.get(b.pid) in ("T", "t") or now - b.time > STALE_S]
    waiting = [b for b in beats if b.waiting]
    if frozen:
        culprits = frozen
    elif waiting and len(waiting) < len(beats):
        culprits = [b for b in beats if not b.waiting]
    else:
        low = min(b.seq for b in beats)
        culprits = [b for b in beats if b.seq == low] if any(b.seq != low for b in beats) else beats
    parts = []
    for b in culprits:
        state = states.get(b.pid, "")
        how, why = (("stopped", "SIGSTOP") if state == "T" else ("stopped", "traced") if state == "t"
                    else ("stopped", f"no heartbeat for {now - b.time:.0f} s") if b in frozen
                    else ("is outside any collective", "") if b not in waiting and waiting
                    else ("is behind", f"last in {b.collective} #{b.seq}"))
        at = f" at step {b.step}" if b.step is not None else ""
        notes = [n for n in (why, stack_top(stacks.get(b.rank, ""))) if n]
        where = PHASE_WORDS.get(b.phase, b.phase)
        parts.append(f"rank {b.rank} ({b.host}) {how} in {where}{at}" + (f" ({'; '.join(notes)})" if notes else ""))
    groups: dict[tuple, list[int]] = {}
    for b in beats:
        if b not in culprits and b.waiting:
            groups.setdefault((b.collective, b.seq), []).append(b.rank)
    waits = [f"{ranks_text(r)} wait{'s' if len(r) == 1 else ''} in {c} #{s}" for (c, s), r in sorted(
        groups.items(), key=lambda kv: min(kv[1]))]
    return "Hang: " + "; ".join(parts + waits), sorted(b.rank for b in culprits)


class HangWatch:
    """No change in any live rank's heartbeat for `timeout_s` -> `check()` returns the beats, else None."""

    def __init__(self, pattern: str, timeout_s: float):
        self.pattern, self.timeout_s = pattern, timeout_s
        self.last: dict[int, tuple] | None = None
        self.since = 0.0

    def live(self) -> list[Beat]:
        return [b for b in read_beats(self.pattern).values()
                if b.phase != "exited" and process_state(b.pid) not in ("", "Z", "X")]

    def check(self, now: float) -> list[Beat] | None:
        beats = self.live()
        sig = {b.rank: b.signature for b in beats}
        if not beats or sig != self.last:
            self.last, self.since = sig, now
            return None
        return beats if now - self.since >= self.timeout_s else None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass  # gone already


def respond(beats: list[Beat], stack_file, report: str, say) -> str:
    """What follows a hang: every rank's stacks (SIGUSR2 -> faulthandler, `stack_file(beat)` is where its dump
    lands), the diagnosis, `report` (JSON: diagnosis, heartbeats, process states, stacks) and `say` lines, then
    SIGKILL for the hung ranks so that their launchers end at once. Returns the diagnosis (FailureReason)."""
    states = {b.pid: process_state(b.pid) for b in beats}
    for b in beats:
        _signal(b.pid, signal.SIGUSR2)
    time.sleep(STACKS_WAIT_S)
    stacks = {}
    for b in beats:
        try:
            with open(stack_file(b), errors="replace") as fh:
                stacks[b.rank] = fh.read()
        except OSError:
            stacks[b.rank] = ""
    reason, culprits = diagnose(beats, time.time(), states, stacks)
    write_json(report, {"reason": reason, "culprits": culprits, "beats": [b.to_dict() for b in beats],
                        "states": states, "stacks": stacks})
    say(reason)
    for b in sorted(beats, key=lambda b: b.rank):
        text = stacks[b.rank].strip() or f"(no stack: the process is in state {states.get(b.pid) or '?'})"
        say(f"rank {b.rank} ({b.host}) stacks:\n{text}")
    for b in beats:
        _signal(b.pid, signal.SIGKILL)
    return reason


class HostHangWatch(PollThread):
    """The hang watch of one host, in its driver, on a thread: where no process sees every host (EC2), each
    driver watches its own ranks; `reason` is the diagnosis once it fired. Its view is the host's: a host
    whose ranks only wait names no frozen rank, and the controller prefers the host that does."""

    def __init__(self, folder: str, timeout_s: float, say, poll: float = 1.0):
        super().__init__("hang-watch", poll)
        self.folder, self.say = folder, say
        self.watch = HangWatch(os.path.join(folder, "rank-*.json"), timeout_s)
        self.reason = ""

    def look(self) -> bool:
        beats = self.watch.check(time.time())
        if beats:
            self.reason = respond(beats, lambda b: os.path.join(self.folder, f"stack-rank-{b.rank}.txt"),
                                  os.path.join(self.folder, "hang.json"), self.say)
        return bool(beats)
