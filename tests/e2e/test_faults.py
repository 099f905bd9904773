"""Checkpoints through an object store that fails 10% of requests and is slow for one step's upload (slow: a real
multi-process job)."""
import re

import boto3
import pytest
import torch

from trainyard import Estimator
from trainyard.engine.components import checkpoint as ckpt
from trainyard.engine.components.checkpoint.io import verify_step
from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model, init_weights
from trainyard.engine.components.optim import build_optimizer, build_scheduler

from .faulty_proxy import FaultyProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_job_with_a_checkpoint_every_step_survives_a_faulty_store(s3_endpoint, monkeypatch):
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="faulty")
    # step 1's data files take 2 s each to upload: the saves due meanwhile are skipped on every rank, not waited for
    with FaultyProxy(s3_endpoint, rate=0.1, seed=1, hold={"/step-00000001/rank-": 2.0}) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # the SDK, the drivers and every rank go through it
        est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                        processes_per_host=2, output_path="s3://faulty/out", checkpoint_s3_uri="s3://faulty/ckpt",
                        max_run=500, hyperparameters={"model": "tiny", "steps": 6, "checkpoint_every": 1,
                                                      "keep_last": 10, "global_batch_size": 8, "seq_len": 32})
        est.fit(logs=False)
        counts = dict(proxy.counts)
    job = est.latest_training_job
    described = job.describe()
    assert described["TrainingJobStatus"] == "Completed"
    skipped = {int(s) for s in re.findall(r"checkpoint step (\d+) skipped: step \d+'s upload is still in flight",
                                          "\n".join(described.get("Warnings", [])))}
    faults = counts["500"] + counts["503"] + counts["dropped"]
    print(f"faulty proxy: {counts}")
    assert faults >= 6 and all(counts[k] > 0 for k in ("500", "503", "dropped")), counts
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    steps = ckpt.list_steps("s3://faulty/ckpt")
    # every step due was saved or skipped (named), the one after the slow one among the skipped, the last saved
    assert 2 in skipped and 6 not in skipped and sorted(steps) == sorted({1, 2, 3, 4, 5, 6} - skipped), (
        steps, skipped, described.get("Warnings"))
    assert all(steps.values()), steps
    # each save's bytes and GB/s per rank are in the metrics (an asynchronous one's in the row of the next save due)
    saves = {e["step"]: e for row in job.metrics() for e in row.get("checkpoint_io", []) if e["op"] == "save"}
    assert 6 in saves and set(saves) <= set(steps), saves
    assert all(len(e["gbps_per_rank"]) == 4 and min(e["bytes_per_rank"]) > 0 for e in saves.values()), saves
    for step in steps:  # every committed step is whole and loads
        verify_step(ckpt.step_uri("s3://faulty/ckpt", step), ckpt.storage_options("s3://faulty/ckpt"))
        model = build_model(MODEL_CONFIGS["tiny"])
        init_weights(model, 0, device="cpu")
        opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
        sched = build_scheduler(opt, warmup_steps=1, total_steps=6, min_lr_ratio=0.1)
        assert ckpt.load_checkpoint("s3://faulty/ckpt", step, model, opt, sched) == step
        assert all(torch.isfinite(p).all() for p in model.parameters())
