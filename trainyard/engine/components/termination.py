"""SIGTERM (a spot interruption, `stop()`, torchrun shutting down) turned into an orderly stop.

`Termination()` installs a SIGTERM handler that only records the signal and its time. At every step
boundary the trainer asks `requested()` (a 1-element all-reduce, so every rank stops after the same
step even if the signal reached them at different moments); then it finishes the save in flight,
writes an emergency checkpoint of the step it just completed if `time_left()` allows, and exits.
torchrun gives its workers 30 s after SIGTERM before SIGKILL, the local supervisor 30 s: the default
deadline leaves room for the exit.
"""
from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

# Seconds from SIGTERM by which the emergency checkpoint must be written (torchrun kills at 30 s).
DEFAULT_DEADLINE_S = 20.0


class Termination:
    def __init__(self, deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        self.deadline_s = deadline_s
        self.received_at: float | None = None
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()

    def requested(self, device: torch.device | str = "cpu") -> bool:
        """Whether any rank received SIGTERM (a collective when distributed)."""
        flag = torch.tensor([0 if self.received_at is None else 1], dtype=torch.int32, device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.received_at is None:  # another rank got it first: the clock starts now
            self.received_at = time.monotonic()
        return bool(flag.item())

    def time_left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.received_at) if self.received_at is not None else \
            self.deadline_s

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
