"""SageMaker's `sagemaker.utils` names that training notebooks use: job names from a base, and back.

    name_from_base("my-experiment")            -> "my-experiment-2026-11-27-01-23-45-678"
    name_from_base(base, short=True)           -> "<base>-261127-0123"
    unique_name_from_base("my-experiment")     -> "my-experiment-1795742625-1f2e"
    base_from_name("my-experiment-2026-11-27-01-23-45-678") -> "my-experiment"

As SageMaker's: the base is cut so that the whole name fits `max_length` (63, SageMaker's limit for job names).
"""
from __future__ import annotations

import re
import secrets
import time
from datetime import datetime, timezone

_STAMPED = re.compile(r"^(?P<base>.+?)-(?:\d{4}-\d{2}-\d{2}-\d{2}-\d{2}-\d{2}-\d{3}|\d{6}-\d{4}|\d{10}-[0-9a-f]{4})$")


def sagemaker_timestamp() -> str:
    """The time as SageMaker's names carry it: `YYYY-MM-DD-HH-MM-SS-mmm` (UTC)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d-%H-%M-%S-%f")[:-3]


def sagemaker_short_timestamp() -> str:
    """`YYMMDD-HHMM` (UTC)."""
    return datetime.now(timezone.utc).strftime("%y%m%d-%H%M")


def name_from_base(base: str, max_length: int = 63, short: bool = False) -> str:
    """`<base>-<timestamp>`, the base cut to fit `max_length`."""
    stamp = sagemaker_short_timestamp() if short else sagemaker_timestamp()
    return f"{_trim(base, max_length - len(stamp) - 1)}-{stamp}"


def unique_name_from_base(base: str, max_length: int = 63) -> str:
    """`<base>-<epoch seconds>-<4 random hex>`, the base cut to fit `max_length`."""
    suffix = f"{int(time.time())}-{secrets.token_hex(2)}"
    return f"{_trim(base, max_length - len(suffix) - 1)}-{suffix}"


def base_from_name(name: str) -> str:
    """The base of a name made by `name_from_base` or `unique_name_from_base`; other names as they are."""
    m = _STAMPED.match(name)
    return m["base"] if m else name


def _trim(base: str, room: int) -> str:
    if room < 1:
        raise ValueError(f"max_length leaves no room for the base {base!r}")
    return base[:room].rstrip("-") or base[:1]


__all__ = ["base_from_name", "name_from_base", "sagemaker_short_timestamp", "sagemaker_timestamp",
           "unique_name_from_base"]
