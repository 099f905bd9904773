"""`eventually(predicate, timeout)`: the one way tests wait. It polls instead of sleeping a fixed time, so a
test waits as long as the thing takes and no longer, and a wait that ends without it fails saying what."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def eventually(predicate: Callable[[], T], timeout: float, *, interval: float = 0.1,
               what: str | Callable[[], str] = "") -> T:
    """`predicate()` once it is truthy (polled every `interval` s), or AssertionError after `timeout` s naming
    `what` (a text, or a function giving one: read when the wait fails, e.g. the job's log)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"not within {timeout:g} s: {said or getattr(predicate, '__name__', 'the condition')}")
        time.sleep(interval)


def within(predicate: Callable[[], bool], timeout: float, *, interval: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout` passes; returns its last value (for waits whose end is
    checked by the test's own assertion, with its own message)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(interval)
    return bool(predicate())
