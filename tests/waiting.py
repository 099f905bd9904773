"""`eventually(predicate, timeout)`: the one way tests wait. It polls instead of sleeping a fixed time, so a
test waits as long as the thing takes and no longer, and a wait that ends without it fails saying what."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

from trainyard.sdk.jobs.jobstate import wait_for

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


# wait until true or timed out, returning the last value: the SDK's own poll (its callers check the result
# with their own message)
within = wait_for
