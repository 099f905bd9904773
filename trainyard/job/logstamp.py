"""The time stamp that starts every line of a job's log (sdk/jobs/joblog.py says how the log is read back)."""
from __future__ import annotations

import time
from datetime import datetime, timezone


def stamp(t: float | None = None) -> str:
    """`2026-11-24T08:01:02.123Z` for epoch seconds `t` (now by default)."""
    t = time.time() if t is None else t
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(t * 1000) % 1000:03d}Z"


def stamped(text: str, t: float | None = None) -> str:
    """One line (no newline) with its stamp."""
    return f"{stamp(t)} {text}"
