"""The trainer end to end, in spawned processes: 1 vs 4 processes, resume from S3, learning.

Each case launches `python -m trainyard.engine.train` (plain, or under torchrun as
`python -m torch.distributed.run`) with a timeout, and reads the metrics.jsonl it writes.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from trainyard.engine.components import checkpoint as ckpt

# Spawned runs start torch in every process; on a 2-core machine 4 ranks take ~15 s.
RUN_TIMEOUT_S = 300
TINY = ["--model", "tiny", "--seq_len", "32", "--global_batch_size", "8", "--micro_batch_size", "1"]


def run_train(workdir, args, nproc: int | None = None, env: dict | None = None):
    """Run the trainer in `workdir`; returns (metrics records, stdout). nproc None: a plain process."""
    os.makedirs(workdir, exist_ok=True)
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    full_env.update(SM_OUTPUT_DATA_DIR=str(workdir), SM_MODEL_DIR=str(workdir / "model"),
                    SM_INPUT_CONFIG_DIR=str(workdir / "config"), OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run([*launcher, "-m", "trainyard.engine.train", *[str(a) for a in args]], cwd=workdir,
                          env=full_env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    metrics = workdir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return records, proc.stdout


def assert_losses_close(a, b, rel=1e-5):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=rel), (x, y)


@pytest.mark.slow
def test_one_and_four_processes_agree(tmp_path):
    args = [*TINY, "--steps", "5", "--seed", "11", "--dtype", "float32"]
    single, out = run_train(tmp_path / "one", args)
    # the four-process run also checkpoints activations and states its accumulation (8 / (1 x 4) = 2):
    # neither may change a loss
    multi, out4 = run_train(tmp_path / "four", args, nproc=4, env={"TRAINYARD_DISTRIBUTION": json.dumps(
        {"activation_checkpointing": "full", "gradient_accumulation_steps": 2})})
    assert "activation checkpointing full" in out4
    assert [r["step"] for r in single] == [1, 2, 3, 4, 5]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "compute_s", "comm_intra_s",
            "comm_inter_s", "inter_node_bytes", "intra_node_bytes", "comm", "comm_by_dim", "param_bytes", "grad_bytes",
            "optim_bytes", "model_state_bytes", "tflops_per_device", "mfu", "data_wait_s", "checkpoint_blocked_s",
            "cpu_rss_bytes", "fingerprint"} == set(single[0])
    assert "fingerprint" not in single[1]  # once per run
    print_ = multi[0]["fingerprint"]
    assert print_["device"] == "cpu" and print_["world_size"] == 4 and print_["cpu_cores"] == os.cpu_count()
    assert print_["torch"] == torch.__version__ and print_["peak_source"].startswith("measured at start-up")
    # MFU by hand from the tiny model's shapes: N = every parameter but the input embedding (6 N per token for
    # forward and backward) plus the attention term 12 L H Q T
    dim, layers, heads, kv, ffn, vocab, seq = 128, 2, 4, 2, 352, 512, 32
    head = dim // heads
    per_layer = 2 * dim * dim + 2 * dim * kv * head + 3 * dim * ffn + 2 * dim
    n = layers * per_layer + dim + vocab * dim
    per_token = 6 * n + 12 * layers * heads * head * seq
    for r in multi:
        hand = per_token * r["tokens_per_s"] / 4 / 1e12
        assert r["tflops_per_device"] == pytest.approx(hand, rel=0.01)
        assert r["mfu"] == pytest.approx(hand / print_["peak_tflops_per_device"], rel=0.01)
        assert 0 < r["mfu"] < 1 and r["data_wait_s"] >= 0 and r["checkpoint_blocked_s"] == 0
        assert r["cpu_rss_bytes"] > 50 * 2 ** 20  # torch alone
    # one process talks to nobody; four on one host (ZeRO-3 over 4) only inside the host
    assert single[0]["inter_node_bytes"] == single[0]["intra_node_bytes"] == 0
    assert multi[0]["inter_node_bytes"] == 0 and multi[0]["intra_node_bytes"] > 0
    assert multi[0]["comm"]["all_gather"]["calls"] > 0 and multi[0]["comm"]["reduce_scatter"]["calls"] > 0
    # the step's time splits into compute and the communication it waited for
    assert single[0]["comm_intra_s"] == single[0]["comm_inter_s"] == 0
    for r in multi:
        assert r["comm_intra_s"] > 0 and r["comm_inter_s"] == 0 and r["compute_s"] > 0
        assert r["compute_s"] + r["comm_intra_s"] == pytest.approx(r["step_time_s"], rel=1e-6)
        assert r["comm"]["all_gather"]["intra_s"] > 0
    # model states are sharded four ways (fp32 AdamW: 16 bytes per parameter in all)
    assert multi[0]["model_state_bytes"] == pytest.approx(single[0]["model_state_bytes"] / 4, rel=0.05)
    assert "step 5/5 loss" in out
    assert_losses_close(single, multi)
    for x, y in zip(single, multi):
        assert x["lr"] == y["lr"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)
    # the exported full weights agree as well (Adam normalises the updates of near-zero gradients,
    # so a few elements carry summation-order noise larger than the losses do)
    w1 = torch.load(tmp_path / "one" / "model" / "model.pt")
    w4 = torch.load(tmp_path / "four" / "model" / "model.pt")
    assert w1.keys() == w4.keys()
    for key in w1:
        torch.testing.assert_close(w1[key], w4[key], rtol=1e-3, atol=1e-5)
    config = json.loads((tmp_path / "four" / "model" / "config.json").read_text())
    assert config["model_config"]["dim"] == 128 and config["hyperparameters"]["steps"] == 5


@pytest.mark.slow
def test_resume_from_s3_on_another_process_count(tmp_path, s3_bucket):
    uri = f"s3://{s3_bucket}/jobs/resume/checkpoints"
    # decay_steps fixes the schedule's length, so the 4-step part follows the 6-step schedule
    common = [*TINY, "--seed", "5", "--decay_steps", "6", "--save_model", "false"]
    first, _ = run_train(tmp_path / "first", [*common, "--steps", "4", "--checkpoint_every", "2",
                                              "--checkpoint_uri", uri], nproc=2)
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert ckpt.list_steps(uri) == {2: True, 4: True}
    assert ckpt.latest_committed_step(uri) == 4

    # resumed on 1 process: DCP reshards; the URI now comes from the contract's checkpointconfig.json
    config_dir = tmp_path / "second" / "config"
    config_dir.mkdir(parents=True)
    (config_dir / "checkpointconfig.json").write_text(json.dumps({"LocalPath": "/opt/ml/checkpoints", "S3Uri": uri}))
    second, out = run_train(tmp_path / "second", [*common, "--steps", "6", "--checkpoint_every", "2"])
    assert f"resumed from step 4 at {uri}" in out
    assert [r["step"] for r in second] == [5, 6]
    assert ckpt.list_steps(uri) == {4: True, 6: True}  # step 2 purged: keep_last 2

    whole, _ = run_train(tmp_path / "whole", [*common, "--steps", "6"])
    assert_losses_close(first + second, whole)


@pytest.mark.slow
def test_loss_decreases_on_synthetic_data(tmp_path):
    records, _ = run_train(tmp_path, ["--model", "tiny", "--steps", "30", "--seq_len", "64", "--save_model", "false"])
    losses = [r["loss"] for r in records]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses


@pytest.mark.slow
def test_the_kernels_choice_is_in_the_first_metrics_row(tmp_path):
    """kernels=auto: each op's implementation goes into the job's first metrics row and transform's line. On
    CPU without the interpreter nothing is measured and every op takes its eager reference (on CUDA under
    compile the row carries the measured times: trainyard/kernels/auto.py)."""
    rows, out = run_train(tmp_path, [*TINY, "--steps", "2", "--kernels", "auto", "--dtype", "float32"],
                          env={"TRITON_INTERPRET": "0"})
    assert "kernels (auto): rms_norm 5, swiglu 2, rope 2, loss 1; auto: eager (not compiled)" in out
    assert rows[0]["kernels"]["rms_norm"] == {"backend": "eager", "ours_ms": None, "compile_ms": None,
                                              "why": "not compiled"}
    assert set(rows[0]["kernels"]) == {"rms_norm", "swiglu", "rope", "loss"} and "kernels" not in rows[1]
