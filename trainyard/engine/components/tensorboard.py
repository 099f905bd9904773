"""TensorBoard event files of the metrics rows, for jobs with SageMaker's `tensorboard_output_config`.

Rank 0 writes them with torch's `SummaryWriter` into the contract's folder (`tensorboardoutputconfig.json`'s
`LocalPath`, default /opt/ml/output/tensorboard), which the host's driver syncs to
`<s3_output_path>/<job>/tensorboard-output/` while the job runs. Every number of a row is a scalar at the row's
step, under the row's key (`loss`, `lr`, `grad_norm`, `tokens_per_s`, `step_time_s`, `mfu`, `tflops_per_device`,
`model_state_bytes`, `peak_memory_bytes`, ...); a nested figure's tag joins its keys with `/`
(`comm_by_dim/dp_shard/inter_bytes`), which TensorBoard shows as one group per first key. The row's
`fingerprint` (what the figures were measured on) is written once as text. The writer flushes after every row,
so the synced files follow the run.

The writer needs the `tensorboard` package (`pip install 'trainyard[tensorboard]'`, in the training image): a
job that asks for event files without it fails when the engine starts, not after training.
"""
from __future__ import annotations

import importlib.util
import json
import math
from typing import Any

INSTALL_HINT = "pip install 'trainyard[tensorboard]'"
# keys of a metrics row that are not figures of the step: its number, and what it ran on (written as text)
NOT_SCALARS = ("step", "fingerprint")


def require_tensorboard() -> None:
    """Raise ImportError naming the extra when the tensorboard package is missing (without importing it)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError("the job asked for TensorBoard event files (tensorboard_output_config) and the tensorboard "
                          f"package that writes them is not installed: {INSTALL_HINT}")


def scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """{tag: value} of every finite number in `row` (bools and NaN left out), nested dicts flattened with `/`."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if not prefix and key in NOT_SCALARS:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, tag + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[tag] = float(value)
    return out


class TensorBoardWriter:
    """The metrics rows of one process as TensorBoard scalars in `log_dir`."""

    def __init__(self, log_dir: str) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when event files are asked for

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)
        self._described = False

    def write(self, step: int, row: dict[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self._writer.add_scalar(tag, value, global_step=step)
        if not self._described and isinstance(row.get("fingerprint"), dict):
            self._writer.add_text("fingerprint", "```\n" + json.dumps(row["fingerprint"], indent=1) + "\n```", step)
            self._described = True
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
