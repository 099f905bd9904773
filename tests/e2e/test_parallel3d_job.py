"""The seed's 3D layout scaled down, through `Estimator` and the built-in trainer: the README's job
(examples/parallel3d.py), a 6-layer model with pipeline 3 (2 layers per stage), tensor parallel 2 and data parallel
2 (MiCS p=2) on 12 processes over 3 emulated hosts of 4, against 1 process, then resumed on 1 process (slow: real
multi-process jobs)."""
import io
import os
import runpy

import pytest
import torch

from trainyard import Estimator
from trainyard.engine.components.checkpoint import list_steps

from .helpers import assert_no_processes_left, empty_prefix, read_tar, unuse_store, use_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "parallel3d.py")
CKPT = "s3://my-bucket/parallel3d"  # the example's checkpoint location


def _one_process(steps: int, ckpt: str | None = None) -> list[float]:
    """The example's hyperparameters on 1 process, `steps` of them on the example's schedule (its learning rate
    decays over its 5 steps): its losses."""
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=1,
                    processes_per_host=1, hyperparameters={"model": "6l", "global_batch_size": 12,
                                                           "micro_batch_size": 2, "steps": steps, "decay_steps": 5},
                    checkpoint_s3_uri=ckpt, max_run=600)
    est.fit(logs=False)
    return [r["loss"] for r in est.latest_training_job.metrics()]


def _close(want: list[float], got: list[float]) -> None:
    assert len(got) == len(want), (want, got)
    for step, (x, y) in enumerate(zip(want, got), 1):
        assert abs(x - y) <= 1e-4 * abs(x), (step, want, got)


def test_the_readmes_3d_job_matches_one_process_and_resumes(monkeypatch):
    """examples/parallel3d.py is the README's block (the docs test checks it is the file; it runs here, once)."""
    empty_prefix("my-bucket", "parallel3d/")  # the example starts anew
    est = runpy.run_path(EXAMPLE)["est"]
    job = est.latest_training_job
    logs = job.log_text()
    assert "tp 2 x pp 3 (1f1b, 1 stage(s) per rank) x partition groups of 2 x 1 replica(s)" in logs, logs[-3000:]
    metrics = job.metrics()
    # one uninterrupted process for 6 steps: its first 5 are the 3D job's, its 6th the resumed run's below
    one = _one_process(6)
    _close(one[:5], [r["loss"] for r in metrics])
    # the pipeline crosses hosts, tensor parallelism stays inside them
    by_dim = metrics[-1]["comm_by_dim"]
    assert by_dim["pp"]["inter_bytes"] > 0 and by_dim["pp"]["intra_bytes"] == 0
    assert by_dim["tp"]["inter_bytes"] == 0 and by_dim["tp"]["intra_bytes"] > 0
    # the exported model holds every stage's weights
    exported = torch.load(io.BytesIO(read_tar(est.model_data)["model.pt"]), weights_only=True)
    assert {k for k in exported if k.startswith("layers.")} == {f"layers.{i}.{n}" for i in range(6) for n in (
        "attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
        "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
        "feed_forward.w3.weight")}
    assert all(not v.is_meta and v.shape[0] > 0 for v in exported.values())
    use_store(monkeypatch)
    assert list_steps(CKPT) == {5: True}
    unuse_store(monkeypatch)
    assert_no_processes_left(job)

    # one more step on 1 process, resumed from the 3D layout's checkpoint (each stage's tensor-parallel shards
    # gathered into one model): the uninterrupted process's 6th loss. (Resuming in the same 3D layout, and across
    # 3D layouts, is tests/engine/test_parallel3d.py's reshard test: a second 12-process job here cost 25 s of the
    # suite.)
    assert _one_process(6, CKPT) == pytest.approx(one[5:], rel=1e-4)
