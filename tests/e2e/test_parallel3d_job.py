"""The seed's 3D layout scaled down, through `Estimator` and the built-in trainer: a 6-layer model with
pipeline 3 (2 layers per stage), tensor parallel 2 and data parallel 2 (MiCS p=2) on 12 processes over
3 emulated hosts of 4, against 1 process (slow: real multi-process jobs)."""
import pytest

from trainyard import Estimator
from trainyard.engine.components.checkpoint import list_steps

from .helpers import assert_no_processes_left, read_tar, unuse_store, use_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# 6 sequences per step: 3 micro-batches of 1 on each of the 2 data-parallel ranks (m = pp = 3)
HPS = {"model": "6l", "global_batch_size": 6, "micro_batch_size": 1, "seq_len": 32, "seed": 7, "lr": 0.01,
       "warmup_steps": 2, "decay_steps": 8}
LAYOUT = {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 3, "pipeline_schedule": "1f1b",
          "mics": {"partition_group_size": 2}}


def _est(steps, **kw):
    args = dict(entry_point="trainyard.engine.train", instance_type="local", instance_count=1, processes_per_host=1,
                hyperparameters={**HPS, "steps": steps}, max_run=600)
    args.update(kw)
    return Estimator(**args)


def test_seed_layout_matches_one_process_and_resumes(monkeypatch):
    one = _est(5)
    one.fit(logs=False)
    want = [r["loss"] for r in one.latest_training_job.metrics()]

    ckpt = "s3://e2e-ckpt/parallel3d"
    est = _est(4, instance_count=3, processes_per_host=4, distribution=LAYOUT, checkpoint_s3_uri=ckpt)
    est.fit(logs=False)
    job = est.latest_training_job
    logs = job.log_text()
    assert "tp 2 x pp 3 (1f1b, 1 stage(s) per rank) x partition groups of 2 x 1 replica(s)" in logs, logs[-3000:]
    metrics = job.metrics()
    got = [r["loss"] for r in metrics]
    assert len(got) == 4
    for step, (x, y) in enumerate(zip(want, got), 1):
        assert abs(x - y) <= 1e-4 * abs(x), (step, want, got)
    # the pipeline crosses hosts, tensor parallelism stays inside them
    by_dim = metrics[-1]["comm_by_dim"]
    assert by_dim["pp"]["inter_bytes"] > 0 and by_dim["pp"]["intra_bytes"] == 0
    assert by_dim["tp"]["inter_bytes"] == 0 and by_dim["tp"]["intra_bytes"] > 0
    # the exported model holds every stage's weights
    import io

    import torch
    exported = torch.load(io.BytesIO(read_tar(est.model_data)["model.pt"]), weights_only=True)
    assert {k for k in exported if k.startswith("layers.")} == {f"layers.{i}.{n}" for i in range(6) for n in (
        "attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
        "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
        "feed_forward.w3.weight")}
    assert all(not v.is_meta and v.shape[0] > 0 for v in exported.values())
    use_store(monkeypatch)
    assert list_steps(ckpt) == {4: True}
    unuse_store(monkeypatch)
    assert_no_processes_left(job)

    # resume in the same layout: step 5 continues the single-process curve
    again = _est(5, instance_count=3, processes_per_host=4, distribution=LAYOUT, checkpoint_s3_uri=ckpt)
    again.fit(logs=False)
    resumed = again.latest_training_job.metrics()
    assert [r["step"] for r in resumed] == [5]
    assert abs(resumed[0]["loss"] - want[4]) <= 1e-4 * abs(want[4]), (resumed, want)
