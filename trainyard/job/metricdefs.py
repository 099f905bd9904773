"""`metric_definitions` as SageMaker takes them: `[{"Name": "train:loss", "Regex": "loss = ([0-9.]+)"}]`."""
from __future__ import annotations

import re


def check_metric_definitions(definitions: object) -> list[dict[str, str]]:
    """Validate `metric_definitions`; ValueError says which entry and why."""
    if definitions is None:
        return []
    if not isinstance(definitions, (list, tuple)):
        raise ValueError(f"expected a list of {{'Name': ..., 'Regex': ...}}, got {type(definitions).__name__}")
    out = []
    for i, d in enumerate(definitions):
        if not isinstance(d, dict) or set(d) != {"Name", "Regex"}:
            raise ValueError(f"entry {i}: expected {{'Name': ..., 'Regex': ...}}, got {d!r}")
        name, regex = d["Name"], d["Regex"]
        if not isinstance(name, str) or not 1 <= len(name) <= 255:
            raise ValueError(f"entry {i}: Name must be a string of 1-255 characters, got {name!r}")
        try:
            compiled = re.compile(regex)
        except (re.error, TypeError) as e:
            raise ValueError(f"entry {i} ({name}): Regex {regex!r} does not compile: {e}") from None
        if compiled.groups < 1:
            raise ValueError(f"entry {i} ({name}): Regex {regex!r} needs a group around the value, e.g. 'loss=(\\S+)'")
        out.append({"Name": name, "Regex": regex})
    names = [d["Name"] for d in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate metric name(s) {dup}")
    return out
