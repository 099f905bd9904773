"""TensorBoard event files from the engine (components/tensorboard.py, metrics_log.py, api.log_metrics), in one
process with a contract written here: every number of a row is a scalar at its step, readable by TensorBoard's
own event reader; without the tensorboard package a job that asks for event files fails at init, naming the extra."""
import importlib.util
import json
import math
import os

import numpy as np
import pytest

pytest.importorskip("tensorboard", reason="the event files need tensorboard: pip install 'trainyard[tensorboard]'")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from trainyard.engine.components.contract import TENSORBOARD_CONFIG  # noqa: E402
from trainyard.engine.components.tensorboard import TensorBoardWriter, scalars  # noqa: E402


def _job(tmp_path, monkeypatch, tensorboard: bool = True) -> tuple[str, str]:
    """A contract as the driver leaves it: the config folder (with tensorboardoutputconfig.json) and the output data
    folder. Returns (the TensorBoard folder, metrics.jsonl)."""
    config, data, tb = tmp_path / "input" / "config", tmp_path / "output" / "data", tmp_path / "output" / "tensorboard"
    config.mkdir(parents=True)
    if tensorboard:
        (config / TENSORBOARD_CONFIG).write_text(json.dumps({"LocalPath": str(tb), "S3OutputPath": "s3://bkt/tb"}))
    monkeypatch.setenv("SM_INPUT_CONFIG_DIR", str(config))
    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(data))
    return str(tb), str(data / "metrics.jsonl")


def _read(log_dir: str) -> EventAccumulator:
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every event
    acc.Reload()
    return acc


def test_scalars_are_every_finite_number_nested_keys_joined():
    row = {"step": 3, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 1200, "on": True, "bad": math.nan, "name": "x",
           "comm_by_dim": {"tp": {"intra_bytes": 10, "inter_s": 0.5}, "pp": {}},
           "fingerprint": {"device": "cpu", "peak_tflops_per_device": 0.1}}
    assert scalars(row) == {"loss": 2.5, "lr": 0.001, "tokens_per_s": 1200.0, "comm_by_dim/tp/intra_bytes": 10.0,
                            "comm_by_dim/tp/inter_s": 0.5}


def test_log_metrics_writes_the_rows_and_their_event_files(tmp_path, monkeypatch):
    import trainyard.engine as te

    tb, jsonl = _job(tmp_path, monkeypatch)
    rows = [{"loss": 3.0 / s + 0.123456789, "lr": 1e-3 * s, "mfu": 0.04, "comm_by_dim": {"dp_shard": {"intra_bytes": s}}}
            for s in (1, 2, 3)]
    rows[0]["fingerprint"] = {"device": "cpu", "cpu_model": "Test CPU"}
    te.init({})
    try:
        for step, row in enumerate(rows, 1):
            te.log_metrics(step, row)
    finally:
        te.finish()
    with open(jsonl) as fh:
        assert [json.loads(line) for line in fh] == [{"step": s, **r} for s, r in enumerate(rows, 1)]
    acc = _read(tb)
    assert {"loss", "lr", "mfu", "comm_by_dim/dp_shard/intra_bytes"} <= set(acc.Tags()["scalars"])
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3]
    # scalars are float32 in the event files: equal to the rows' values at that precision
    assert [e.value for e in loss] == [float(np.float32(r["loss"])) for r in rows]
    assert [e.value for e in acc.Scalars("comm_by_dim/dp_shard/intra_bytes")] == [1.0, 2.0, 3.0]
    assert "fingerprint/text_summary" in acc.Tags()["tensors"]  # what the figures were measured on, as text


def test_the_writer_flushes_every_row_so_a_synced_file_follows_the_run(tmp_path):
    writer = TensorBoardWriter(str(tmp_path))
    writer.write(1, {"loss": 1.5})
    assert [e.value for e in _read(str(tmp_path)).Scalars("loss")] == [1.5]  # readable before close
    writer.write(2, {"loss": 1.25})
    assert [e.step for e in _read(str(tmp_path)).Scalars("loss")] == [1, 2]
    writer.close()


def test_without_a_tensorboard_config_only_the_rows_are_written(tmp_path, monkeypatch):
    import trainyard.engine as te

    tb, jsonl = _job(tmp_path, monkeypatch, tensorboard=False)
    te.init({})
    try:
        te.log_metrics(1, {"loss": 1.0})
    finally:
        te.finish()
    assert open(jsonl).read() == '{"step": 1, "loss": 1.0}\n' and not os.path.exists(tb)


def test_a_job_asking_for_event_files_without_tensorboard_fails_at_init_naming_the_extra(tmp_path, monkeypatch):
    import trainyard.engine as te

    _job(tmp_path, monkeypatch)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ImportError, match=r"tensorboard_output_config.*pip install 'trainyard\[tensorboard\]'"):
        te.init({})  # before the process group: nothing to leave
    from trainyard.engine import api

    assert api._current is None
