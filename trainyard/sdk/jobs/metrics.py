"""`metric_definitions`: metrics scraped from a job's log lines, as SageMaker scrapes CloudWatch.

A definition is `{"Name": "train:loss", "Regex": "loss = ([0-9.]+)"}`; a line that matches gives the
float of the regex's first group (SageMaker's rule). Lines keep the rank prefix the driver adds
(`[algo-1/0] `) out of the match, so `^`-anchored regexes work as they do on SageMaker.
`sdk/analytics.py` (SageMaker's `TrainingJobAnalytics`) reads the same rows.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable

from trainyard.sdk.jobs.joblog import LogReader, parse

_RANK_PREFIX = re.compile(r"^\[algo-\d+(?:/\d+)?\] ")


def scrape(lines: Iterable[str], definitions, timestamp: float | None = None) -> list[dict]:
    """One row per line that matched at least one definition: `{"timestamp": t, name: value, ...}`; t is the
    line's own stamp (`joblog.py`), else `timestamp`."""
    compiled = [(d["Name"], re.compile(d["Regex"])) for d in definitions]
    rows = []
    for line in lines:
        stamp, line = parse(line)
        line = _RANK_PREFIX.sub("", line)
        row = {}
        for name, rx in compiled:
            m = rx.search(line)
            if m is None:
                continue
            try:
                value = float(m.group(1))
            except (TypeError, ValueError):
                continue  # SageMaker drops values that are not numbers
            if math.isfinite(value):
                row[name] = value
        if row:
            rows.append({"timestamp": timestamp if stamp is None else stamp, **row})
    return rows


def scrape_files(paths: list[str], definitions) -> list[dict]:
    """`scrape` over log files (complete lines only, merged in time order), each row with its line's time."""
    return scrape(LogReader(paths).poll(final=True), definitions)


def final_metric_data_list(rows: list[dict]) -> list[dict]:
    """DescribeTrainingJob's `FinalMetricDataList`: the last value of each metric."""
    last: dict[str, tuple[float, float | None]] = {}
    for row in rows:
        for k, v in row.items():
            if k != "timestamp":
                last[k] = (v, row.get("timestamp"))
    return [{"MetricName": k, "Value": v, "Timestamp": t} for k, (v, t) in last.items()]


def measured_peak(row: dict) -> bool | None:
    """Whether the MFU of a job's rows is against a peak the engine measured at start-up (a CPU or an unknown
    GPU: it moves with the machine's load, so two identical runs can differ widely) rather than a datasheet's;
    None when `row` does not say (the engine says it once, in its first row's fingerprint)."""
    fingerprint = row.get("fingerprint")
    source = fingerprint.get("peak_source") if isinstance(fingerprint, dict) else None
    return source.startswith("measured") if isinstance(source, str) else None
