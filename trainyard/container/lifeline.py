"""A host's ranks end when the process that supervises them ends: the lifeline.

The supervisor of a local job (sdk/backends/local/supervisor.py) and the node agent of an EC2 instance (node.py) start the
driver with the read end of a pipe whose write end only they hold (`hand_over`: the descriptor's number in
`TRAINYARD_LIFELINE_FD`). The driver reads it in a thread (`watch`); the read returns only when every writer
is gone, that is when the supervisor has ended, however it ended (SIGKILL included, where no handler runs).
Then the driver kills every process below it at once (SIGKILL: a rank must not commit another checkpoint for
a job nobody follows), writes why (into the host's log file too, `TRAINYARD_HOST_LOG`, which the supervisor
names), and exits: the ranks are gone within a second or two of the supervisor,
instead of training on, unseen, as orphans.

`descendants` and `signal_all` are the /proc walk both the supervisor and the driver use to end a tree of
processes (ranks that torchrun starts in sessions of their own included).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

ENV = "TRAINYARD_LIFELINE_FD"
HOST_LOG_ENV = "TRAINYARD_HOST_LOG"  # the host's log file, where the driver says why it stopped


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def signal_all(pids, sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def kill_below(pid: int) -> None:
    """SIGKILL every process below `pid`, again until none is left (they may fork while we kill)."""
    for _ in range(5):
        left = descendants(pid)
        if not left:
            return
        signal_all(left, signal.SIGKILL)
        time.sleep(0.05)


class Lifeline:
    """The supervisor's side: a pipe whose write end this process keeps until it ends."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()  # both not inherited unless handed over

    def hand_over(self, env: dict) -> tuple[int, ...]:
        """Set `env`'s variable to the read end; returns the descriptors for Popen's `pass_fds`."""
        env[ENV] = str(self.read_fd)
        return (self.read_fd,)


LOST = threading.Event()  # set once the lifeline broke, before `on_lost` runs


def yield_if_lost(timeout: float = 30.0) -> None:
    """In the driver's main thread, at its end: when the lifeline broke, leave the ending to `on_lost` (which
    stops the ranks, says why and exits), instead of racing it with the ending of a launch its kills cut short."""
    if LOST.is_set():
        time.sleep(timeout)


def watch(on_lost: Callable[[], None], environ=os.environ) -> bool:
    """Start the driver's side, when it was handed a lifeline: `on_lost()` runs in a daemon thread once the
    supervisor is gone. Returns whether there is a lifeline to watch."""
    raw = environ.pop(ENV, None)  # not for the ranks: they are not the supervisor's to watch
    if not raw:
        return False
    fd = int(raw)
    os.set_inheritable(fd, False)

    def wait() -> None:
        try:
            while os.read(fd, 1):
                pass  # nobody writes: a read returns only at the end
        except OSError:
            pass
        LOST.set()
        on_lost()

    threading.Thread(target=wait, name="lifeline", daemon=True).start()
    return True
