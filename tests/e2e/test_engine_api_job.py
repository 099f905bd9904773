"""The bring-your-own-model example (examples/byom/train.py, the public API only) as an Estimator entry point: the
pair of jobs of docs/engine.md (examples/byom/jobs.py: 2 emulated hosts x 2 processes, MiCS p=2 with
check_equivalence first, an HF export that from_pretrained loads, then tensor parallelism 2 resuming, resharded,
from the first job's checkpoint), and the same script without a checkpoint location and under context
parallelism (slow: real multi-process jobs)."""
import json
import os
import re

import pytest
import torch

from trainyard import Estimator

from .helpers import assert_no_processes_left, empty_prefix, read_tar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BYOM = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "byom")


def _est(steps, distribution, ckpt, hosts=2, **hps):
    return Estimator(entry_point="train.py", source_dir=BYOM, instance_type="local", instance_count=hosts,
                     processes_per_host=2, distribution=distribution, checkpoint_s3_uri=ckpt, max_run=400,
                     hyperparameters={"steps": steps, "lr": 0.003, **hps})


def _steps(logs: str) -> list[int]:
    return [int(s) for s in re.findall(r"\] step (\d+) loss [\d.]+", logs)]


def test_the_docs_pair_of_jobs_trains_exports_and_resumes_on_another_layout(tmp_path, monkeypatch):
    """examples/byom/jobs.py, the pair of jobs docs/engine.md shows (the docs test checks the block is the file;
    it runs here, once): MiCS p=2 with the equivalence check, then tensor parallelism 2 resuming from step 5."""
    import runpy

    from transformers import AutoModelForCausalLM

    empty_prefix("my-bucket", "byom/")  # this run starts anew
    monkeypatch.chdir(os.path.join(BYOM, "..", ".."))
    jobs = runpy.run_path(os.path.join(BYOM, "jobs.py"))
    est, again = jobs["est"], jobs["again"]
    job = est.latest_training_job
    logs = job.log_text()
    assert "EQUIVALENT within" in logs and "NOT EQUIVALENT" not in logs, logs[-3000:]
    assert _steps(logs) == [1, 2, 3, 4, 5], logs[-3000:]
    assert "resumed from step" not in logs
    # the artifact is a Hugging Face model directory
    files = read_tar(est.model_data)
    assert {"config.json", "model.safetensors"} <= set(files), sorted(files)
    assert json.loads(files["config.json"])["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(_extract(files, tmp_path / "first"))
    logits = model(torch.arange(8).unsqueeze(0)).logits
    assert logits.shape == (1, 8, 256) and torch.isfinite(logits).all()
    assert_no_processes_left(job)

    # the second job: the same checkpoint location, tensor-parallel, resumed after step 5
    logs = again.latest_training_job.log_text()
    assert "resumed from step 5" in logs, logs[-3000:]
    assert _steps(logs) == [6, 7, 8], logs[-3000:]
    resumed = AutoModelForCausalLM.from_pretrained(_extract(read_tar(again.model_data), tmp_path / "again"))
    assert not torch.equal(resumed.lm_head.weight, model.lm_head.weight)  # trained on from step 5
    assert_no_processes_left(again.latest_training_job)


def test_the_same_script_runs_without_a_checkpoint_location():
    """load_checkpoint gives 0 and save_checkpoint saves nothing, each said once: one script for both cases. Here
    with the built-in mixture of experts (--model moe), its 4 experts spread over the 2 ranks (expert parallelism
    2 x MiCS p=2)."""
    est = _est(2, {"expert_parallel_degree": 2, "mics": {"partition_group_size": 2}}, None, hosts=1, model="moe")
    est.fit(logs=False)
    logs = est.latest_training_job.log_text()
    assert _steps(logs) == [1, 2], logs[-3000:]
    assert re.search(r"\] step 2 loss [\d.]+ experts \d\.\d\dx", logs), logs[-3000:]
    assert logs.count("load_checkpoint: the job has no checkpoint location") == 1, logs[-3000:]
    assert logs.count("save_checkpoint: the job has no checkpoint location") == 1, logs[-3000:]
    assert "model.safetensors" in read_tar(est.model_data)


def test_the_same_script_splits_each_sequence_under_context_parallelism():
    """Context parallelism 2 (1 host x 2: both ranks split every sequence of the HF Llama and share its MiCS
    group); the script's own loop takes its chunks with te.sequence_shard."""
    est = _est(2, {"context_parallel_degree": 2, "mics": {"partition_group_size": 1}}, None, hosts=1)
    est.fit(logs=False)
    logs = est.latest_training_job.log_text()
    assert _steps(logs) == [1, 2], logs[-3000:]
    assert "model.safetensors" in read_tar(est.model_data)


def _extract(files: dict[str, bytes], folder) -> str:
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return str(folder)
