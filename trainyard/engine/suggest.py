"""Did-you-mean hints for mistyped names (hyperparameters, distribution keys).

The engine imports nothing of the SDK and the job layers, so it keeps its own one-function twin of
`trainyard.job.errors.close_match`.
"""
from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """` (did you mean 'PREFIXbest'?)` for the closest of `known` to `name` (difflib's ratio >= 0.6), or
    "" when none is close. `prefix` puts the path in front of the suggestion (`mics.`, `--`)."""
    found = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean '{prefix}{found[0]}'?)" if found else ""
