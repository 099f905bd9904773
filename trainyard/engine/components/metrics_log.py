"""Rank 0's record of the steps: one JSON line per row in `$SM_OUTPUT_DATA_DIR/metrics.jsonl` (what `job.metrics()`
reads; the driver's first-step watch and the EC2 node's metrics shipper follow the file), and, when the job asked
for TensorBoard output, the same row's numbers as TensorBoard scalars (components/tensorboard.py).

Every row is flushed when written: a job that dies keeps every step it finished.
"""
from __future__ import annotations

import json
import os
from typing import Any

from trainyard.engine.components.contract import output_data_dir, tensorboard_dir_from_contract
from trainyard.engine.components.tensorboard import TensorBoardWriter

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Rows appended to `path` and, with `tensorboard_dir`, written as TensorBoard scalars there."""

    def __init__(self, path: str, tensorboard_dir: str = "") -> None:
        self.path = path
        self.tensorboard = TensorBoardWriter(tensorboard_dir) if tensorboard_dir else None
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = open(path, "a")

    @classmethod
    def from_contract(cls, env: dict | None = None) -> "MetricsLog":
        """The job's: `$SM_OUTPUT_DATA_DIR/metrics.jsonl`, and `tensorboardoutputconfig.json`'s folder."""
        return cls(os.path.join(output_data_dir(env), METRICS_FILE), tensorboard_dir_from_contract(env))

    def write(self, row: dict[str, Any]) -> None:
        """One row: `row["step"]` is its step."""
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.tensorboard is not None and isinstance(row.get("step"), int):
            self.tensorboard.write(row["step"], row)

    def close(self) -> None:
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
