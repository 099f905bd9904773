"""How the `trainyard` command line prints: tables (rich), sizes, times and durations.

On a terminal a table has box lines and wraps to the terminal's width. Piped or redirected, it is plain
text: no box lines, no escape codes, nothing cut to a width, no trailing blanks (one row per line, columns
aligned with spaces), so `grep`, `awk` and `cut` read it.
"""
from __future__ import annotations

import io
import re
import sys
from datetime import datetime, timezone

from rich import box
from rich.console import Console
from rich.table import Table

PIPED_WIDTH = 100_000  # no real row is wider: piped output is never wrapped or cut
_DURATION = re.compile(r"(\d+)([smhdw])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def console(file=None) -> Console:
    """A console on `file` (default: stdout as it is now) that never reads markup or emoji codes in the text
    it prints (job names and keys are data), and colours only on a terminal (rich's own rule)."""
    return Console(file=file or sys.stdout, markup=False, emoji=False, highlight=False)


def print_table(headers: list[str], rows: list[list[str]], *, right: tuple[str, ...] = (), file=None) -> None:
    """`rows` under `headers`; the columns named in `right` are right-aligned (numbers)."""
    out = console(file)
    terminal = out.is_terminal
    table = Table(box=box.ROUNDED if terminal else None, pad_edge=terminal, show_edge=terminal,
                  header_style="bold" if terminal else "")
    for i, h in enumerate(headers):  # the first column (a job's name, a key) stays whole, to be copied
        table.add_column(h, justify="right" if h in right else "left", overflow="fold", no_wrap=not terminal or i == 0)
    for row in rows:
        table.add_row(*row)
    if terminal:
        out.print(table)
        return
    buf = io.StringIO()
    Console(file=buf, width=PIPED_WIDTH, markup=False, emoji=False, highlight=False, color_system=None,
            force_terminal=False).print(table)
    out.file.write("".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines()))
    out.file.flush()


def fitting_columns(headers: list[str], rows: list[list[str]], width: int, *, keep: int = 1) -> int:
    """How many of the first columns fit `width` characters on a terminal (each its widest cell plus rich's
    borders and padding); at least `keep`."""
    used, n = 1, 0
    for i, h in enumerate(headers):
        used += max([len(h), *(len(r[i]) for r in rows)]) + 3
        if used > width and n >= keep:
            break
        n += 1
    return n


def human_size(n: int) -> str:
    """1536 -> '1.5 KiB'; bytes below 1 KiB as they are."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """75 -> '1m15s', 3720 -> '1h02m', 90000 -> '1d01h'; under a minute in seconds."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def local_time(t: datetime | None) -> str:
    """A time as this machine's local time to the second; '' for none."""
    if t is None:
        return ""
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def parse_duration(text: str) -> float:
    """'7d', '12h', '30m', '45s', '2w' or a sum of them ('1d12h') -> seconds. ValueError otherwise."""
    t = text.strip().lower()
    parts = _DURATION.findall(t)
    if not parts or "".join(n + u for n, u in parts) != t:
        raise ValueError(f"{text!r} is not a duration: use a number and a unit (s, m, h, d, w), e.g. 7d, 12h "
                         "or 30m")
    return float(sum(int(n) * _SECONDS[u] for n, u in parts))
