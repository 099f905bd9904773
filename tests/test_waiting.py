"""The tests' one wait (tests/waiting.py): it returns as soon as the condition holds, and fails naming it."""
import time

import pytest

from tests.waiting import eventually, within


def test_eventually_returns_the_first_truthy_value_without_waiting_longer():
    calls = []
    t0 = time.monotonic()
    assert eventually(lambda: calls.append(1) or (len(calls) >= 3 and "done"), 10, interval=0.01) == "done"
    assert len(calls) == 3 and time.monotonic() - t0 < 5


def test_eventually_fails_naming_what_it_waited_for():
    with pytest.raises(AssertionError, match=r"not within 0.05 s: the log said hello"):
        eventually(lambda: False, 0.05, interval=0.01, what=lambda: "the log said hello")


def test_within_says_whether_it_happened():
    assert within(lambda: True, 1) is True
    assert within(lambda: False, 0.05, interval=0.01) is False
