"""TensorBoard output and profiler traces of a real local job (slow: 2 emulated hosts x 1 process, the built-in
trainer, 4 steps of the tiny model, on the embedded store).

The job has SageMaker's `tensorboard_output_config` and Trainyard's `profiler={"steps": [2, 3], "ranks": [0]}`:
the event files synced to `<s3_output_path>/<job>/tensorboard-output/` hold every step's loss (read with
TensorBoard's own event reader, equal to job.metrics()), and `<output_path>/<job>/profiler-output/` holds one
Chrome trace, rank 0's, of steps 2-3; rank 1 (the other host) records none; the report lists the trace.
"""
import json
import os

import numpy as np
import pytest

from trainyard import Estimator
from trainyard.debugger import TensorBoardOutputConfig

from .helpers import assert_no_processes_left, store_client

pytest.importorskip("tensorboard", reason="the event files need tensorboard: pip install 'trainyard[tensorboard]'")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS = 4
HPS = {"model": "tiny", "steps": STEPS, "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 32, "seed": 5,
       "save_model": False}
# the scalars every row of the built-in trainer has (docs/engine.md's metrics)
TAGS = {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "tflops_per_device", "model_state_bytes",
        "cpu_rss_bytes", "data_wait_s", "checkpoint_blocked_s", "comm_intra_s"}


def _download(uri: str, dest) -> list[str]:
    """Every object under the `s3://` prefix `uri` into `dest`; returns their paths relative to the prefix."""
    s3 = store_client()
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    names = []
    for obj in s3.list_objects_v2(Bucket=bucket, Prefix=prefix.rstrip("/") + "/").get("Contents", []):
        rel = obj["Key"][len(prefix.rstrip("/")) + 1:]
        os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
        s3.download_file(bucket, obj["Key"], os.path.join(dest, rel))
        names.append(rel)
    return sorted(names)


def test_event_files_and_a_trace_reach_the_store(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2, processes_per_host=1,
                    hyperparameters=HPS, max_run=300, output_path="s3://e2e-observe/out",
                    tensorboard_output_config=TensorBoardOutputConfig(s3_output_path="s3://e2e-observe/tensorboard"),
                    profiler={"steps": [2, 3], "ranks": [0]},
                    environment={"TRAINYARD_OUTPUT_SYNC_S": "1"})  # scans every second while it runs
    est.fit(logs=False)
    job = est.latest_training_job
    rows = job.metrics()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))

    # TensorBoard: the synced event files, read by TensorBoard's reader, hold the loss of every step
    tb = est.latest_job_tensorboard_artifacts_path()
    assert tb == f"s3://e2e-observe/tensorboard/{job.name}/tensorboard-output"
    names = _download(tb, tmp_path / "tb")
    assert names and all(n.startswith("events.out.tfevents.") for n in names), names
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert TAGS <= set(acc.Tags()["scalars"]), sorted(acc.Tags()["scalars"])
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    assert [e.value for e in loss] == [float(np.float32(r["loss"])) for r in rows]  # float32 in the event files
    assert [e.value for e in acc.Scalars("mfu")] == [float(np.float32(r["mfu"])) for r in rows]

    # profiler: one Chrome trace, rank 0's, of steps 2-3; nothing from rank 1 on the other host
    prof = est.latest_job_profiler_artifacts_path()
    assert prof == f"s3://e2e-observe/out/{job.name}/profiler-output"
    assert _download(prof, tmp_path / "prof") == ["rank0-steps2-3.pt.trace.json"]
    with open(tmp_path / "prof" / "rank0-steps2-3.pt.trace.json") as fh:
        events = json.load(fh)["traceEvents"]
    assert sum(1 for e in events if e.get("name", "").startswith("aten::")) > 10
    assert not os.listdir(f"{job.dir}/hosts/algo-2/output/profiler")  # synced (so created) but empty
    log = job.log_text()
    assert "profiler: steps 2-3 of rank 0 written to rank0-steps2-3.pt.trace.json" in log

    # the report lists the trace, with its size and where it is
    pytest.importorskip("plotly", reason="the report needs plotly: pip install 'trainyard[report]'")
    page = open(job.report(str(tmp_path / "report.html")), encoding="utf-8").read()
    assert "<th>rank0-steps2-3.pt.trace.json</th><td>" in page and f"{prof}/rank0-steps2-3.pt.trace.json" in page
    assert_no_processes_left(job)
