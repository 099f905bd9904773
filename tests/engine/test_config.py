"""Hyperparameters from the command line, the batch split, the LR schedule, the contract files."""
import dataclasses
import json

import pytest

from trainyard.engine import train
from trainyard.engine.components.contract import checkpoint_uri_from_contract
from trainyard.engine.config import TrainConfig, parse_hyperparameters
from trainyard.engine.components.optim import lr_factor


def test_defaults():
    cfg = parse_hyperparameters([])
    assert cfg == TrainConfig()
    assert (cfg.model, cfg.steps, cfg.global_batch_size, cfg.micro_batch_size, cfg.seq_len) == ("10m", 20, 8, 2, 128)


def test_sagemaker_style_values():
    cfg = parse_hyperparameters([
        "--steps", "20", "--lr", "0.001", "--model", "tiny", "--save_model", "False", "--max_grad_norm", "1",
        "--dataset", '"train"', "--global-batch-size", "16", "--seed=3", "--checkpoint_uri", "s3://b/p",
    ])
    assert (cfg.steps, cfg.lr, cfg.model, cfg.save_model, cfg.max_grad_norm) == (20, 0.001, "tiny", False, 1.0)
    assert (cfg.dataset, cfg.global_batch_size, cfg.seed, cfg.checkpoint_uri) == ("train", 16, 3, "s3://b/p")
    for raw, value in [("true", True), ("True", True), ("false", False), ('"false"', False)]:
        assert parse_hyperparameters(["--save_model", raw]).save_model is value


@pytest.mark.parametrize("argv,match", [
    (["--stepz", "3"], "--stepz"),
    (["--steps", "many"], "steps"),
    (["--steps", "2.5"], "steps"),
    (["--lr", "fast"], "lr"),
    (["--save_model", "maybe"], "save_model"),
    (["--model", "huge"], "model"),
    (["--steps", "0"], "steps"),
    (["--dtype", "float64"], "dtype"),
    (["--model", "tiny", "--seq_len", "4096"], "seq_len"),
    (["--straggler_remove", "true"], r"straggler_remove .* checkpoint_every \(0\)"),
    (["--straggler_remove", "true", "--checkpoint_every", "5", "--straggler_check_every", "0"],
     r"straggler_check_every \(0\)"),
])
def test_invalid_hyperparameters_are_named(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_hyperparameters(argv)


@pytest.mark.parametrize("argv,named", [
    (["--global_batch_sise", "16"], "--global_batch_sise (did you mean '--global_batch_size'?)"),
    (["--global-batch-sise=16"], "--global-batch-sise (did you mean '--global_batch_size'?)"),
    (["--checkpoint_asynch", "false", "--zzz", "1"],
     "--checkpoint_asynch (did you mean '--checkpoint_async'?), --zzz;"),
])
def test_unknown_hyperparameters_suggest_the_closest(argv, named):
    with pytest.raises(ValueError) as e:
        parse_hyperparameters(argv)
    assert str(e.value).startswith("unknown hyperparameter(s) " + named)
    with pytest.raises(ValueError, match="stray argument"):
        parse_hyperparameters(["16"])


@pytest.mark.parametrize("distribution,named", [
    ({"tensor_paralel_degree": 2}, "'tensor_paralel_degree' (did you mean 'tensor_parallel_degree'?)"),
    ({"pipline_schedule": "gpipe"}, "'pipline_schedule' (did you mean 'pipeline_schedule'?)"),
    ({"mics": {"partition_size": 2}}, "'mics.partition_size' (did you mean 'mics.partition_group_size'?)"),
    ({"deepspeed": {}}, "'deepspeed'; known:"),
])
def test_unknown_distribution_keys_name_the_path_and_the_closest(distribution, named):
    from trainyard.parallel.parallelism import Parallelism

    with pytest.raises(ValueError) as e:
        Parallelism.parse(distribution)
    assert str(e.value).startswith("distribution: unknown key(s) " + named)
    with pytest.raises(ValueError, match="mics must be a dict"):
        Parallelism.parse({"mics": 2})


@pytest.mark.parametrize("mics,named", [
    ({"replica_sync": "nccl"}, "mics.replica_sync must be one of ['bucketed', 'native'], got 'nccl'"),
    ({"replica_compression": "fp8"}, "mics.replica_compression must be one of ['bf16', 'int8'] or null, got 'fp8'"),
    ({"replica_sync": "native", "replica_compression": "int8"}, "needs mics.replica_sync 'bucketed'"),
    ({"replica_bucket_mb": 0}, "mics.replica_bucket_mb must be a number > 0, got 0"),
    ({"hierarchical_chunks": 0}, "mics.hierarchical_chunks must be an integer >= 1, got 0"),
    ({"cpu_offload": "yes"}, "mics.cpu_offload must be true or false, got 'yes'"),
    ({"cpu_offload": True, "replica_compression": "bf16"}, "with mics.cpu_offload the replicas sync through FSDP2's"),
])
def test_replica_sync_settings_are_checked(mics, named):
    from trainyard.parallel.parallelism import Parallelism

    with pytest.raises(ValueError) as e:
        Parallelism.parse({"mics": mics})
    assert named in str(e.value)
    assert Parallelism.parse({"mics": {"replica_compression": "int8", "hierarchical_chunks": 2}}).to_dict()["mics"][
        "replica_compression"] == "int8"


def test_docs_table_lists_every_hyperparameter_with_its_default():
    """docs/engine.md's hyperparameter table: one row per TrainConfig field, its default as written there."""
    import dataclasses
    import os
    import re

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "engine.md")) as fh:
        rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", fh.read(), re.M))
    for f in dataclasses.fields(TrainConfig):
        assert f.name in rows, f"docs/engine.md: no row for the hyperparameter {f.name}"
        want = '""' if f.default == "" else str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
        assert rows[f.name] == want, f"docs/engine.md: {f.name} default {rows[f.name]!r}, TrainConfig says {want!r}"


def test_batch_split_error_names_numbers_and_fix():
    cfg = TrainConfig(global_batch_size=8, micro_batch_size=2)
    assert cfg.accumulation(1) == 4 and cfg.accumulation(4) == 1
    with pytest.raises(ValueError, match=r"global_batch_size \(8\).*micro_batch_size \(2\).*data-parallel ranks \(3\).*multiple of 6"):
        cfg.accumulation(3)


def test_main_reports_errors_without_starting(monkeypatch, capsys):
    assert train.main(["--bogus", "1"]) == 2
    assert "--bogus" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train.main(["--model", "tiny"]) == 2
    assert "data-parallel ranks (3)" in capsys.readouterr().err


def test_schedule_warmup_then_cosine():
    kw = dict(warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    assert [lr_factor(s, **kw) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert lr_factor(20, **kw) == pytest.approx(0.1)
    assert lr_factor(12, **kw) == pytest.approx(0.55)  # halfway through the decay
    values = [lr_factor(s, **kw) for s in range(4, 21)]
    assert values == sorted(values, reverse=True)
    assert lr_factor(30, **kw) == pytest.approx(0.1)  # past the end: stays at the floor
    assert lr_factor(1, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) < 1.0


def test_checkpoint_uri_from_contract(tmp_path):
    env = {"SM_INPUT_CONFIG_DIR": str(tmp_path)}
    assert checkpoint_uri_from_contract(env) == ""
    (tmp_path / "checkpointconfig.json").write_text(json.dumps({"LocalPath": "/opt/ml/checkpoints", "S3Uri": "s3://b/ck"}))
    assert checkpoint_uri_from_contract(env) == "s3://b/ck"
    (tmp_path / "checkpointconfig.json").write_text("{oops")
    with pytest.raises(ValueError, match="checkpointconfig.json"):
        checkpoint_uri_from_contract(env)


def test_reconcile_distribution():
    from trainyard.engine.config import reconcile_distribution
    from trainyard.parallel.parallelism import Parallelism

    cfg = parse_hyperparameters(["--global_batch_size", "8", "--micro_batch_size", "2"])
    given = dataclasses.replace(cfg)
    cfg = reconcile_distribution(cfg, Parallelism.parse({"mixed_precision": "bf16", "gradient_clipping": 0.5,
                                                         "gradient_accumulation_steps": 2}), world_size=2)
    assert cfg.dtype == "bfloat16" and cfg.max_grad_norm == 0.5
    assert given.dtype == "auto"  # a new config: the one given is left as it was
    with pytest.raises(ValueError, match="does not match"):
        reconcile_distribution(cfg, Parallelism.parse({"gradient_accumulation_steps": 1}), world_size=2)
    with pytest.raises(ValueError, match="contradicts"):
        reconcile_distribution(cfg, Parallelism.parse({"mixed_precision": "fp32"}), world_size=2)
    untouched = parse_hyperparameters([])
    assert reconcile_distribution(untouched, Parallelism.parse({}), world_size=1) == parse_hyperparameters([])


@pytest.mark.parametrize("values, message", [
    ({"task": "chat"}, "task must be pretrain or sft, got 'chat'"),
    ({"task": "sft"}, "task sft fine-tunes a Hugging Face model: set model hf"),
    ({"lora_r": 8}, "lora_r 8: LoRA adapters are for model hf"),
    ({"model": "hf", "lora_r": -1}, "lora_r -1"),
    ({"model": "hf", "lora_r": 8, "lora_alpha": 0}, "lora_alpha must be > 0"),
    ({"model": "hf", "lora_dropout": 1.0}, r"lora_dropout must be in \[0, 1\)"),
    ({"model": "hf", "task": "sft", "kernels": "auto"}, "kernels 'auto' with task sft"),
    ({"model": "hf", "lora_merge": True}, "lora_merge merges LoRA adapters into the weights, and lora_r is 0"),
    ({"model": "hf", "lora_alpha": 32.0}, r"lora_alpha 32.0 set LoRA adapters, and lora_r is 0 \(no adapters"),
    ({"model": "hf", "lora_targets": "q_proj", "lora_dropout": 0.1},
     r"lora_targets 'q_proj', lora_dropout 0.1 set LoRA adapters, and lora_r is 0 .*: set lora_r, or leave them out"),
])
def test_fine_tuning_options_are_checked_by_name(values, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**values)
    TrainConfig(model="hf", task="sft", lora_r=8, lora_targets="q_proj,v_proj")  # and a valid one passes


@pytest.mark.parametrize("values, distribution, message", [
    ({"task": "sft"}, {"pipeline_parallel_degree": 2}, "task sft: pipeline_parallel_degree 2 and context_parallel"),
    ({"task": "sft"}, {"context_parallel_degree": 2}, "task sft: pipeline_parallel_degree 1 and context_parallel_"
                                                      "degree 2"),
    ({"lora_r": 4, "lora_dropout": 0.1}, {"tensor_parallel_degree": 2}, "lora_dropout 0.1 with tensor_parallel_"),
])
def test_fine_tuning_layouts_the_trainer_refuses_are_refused_with_the_distribution(values, distribution, message):
    """Before the job starts (the Estimator reconciles the hyperparameters with the distribution), not at rank 0
    after the hosts were launched (a user's trial)."""
    from trainyard.engine.config import reconcile_distribution
    from trainyard.parallel.parallelism import Parallelism

    cfg = TrainConfig(model="hf", global_batch_size=8, micro_batch_size=1, **values)
    with pytest.raises(ValueError, match=message):
        reconcile_distribution(cfg, Parallelism.parse(distribution), world_size=4)
    reconcile_distribution(cfg, Parallelism.parse({}), world_size=4)  # the same options on MiCS alone pass



def test_the_cpu_optimizer_is_foreach_where_it_can_be_and_steps_as_the_default_loop(engine):
    """On a CPU host build_optimizer asks for foreach AdamW (PyTorch's default there loops op by op over every
    DTensor shard), which steps bit-identically to that loop; a mix of DTensors and plain tensors (TP alone
    leaves some parameters plain) keeps the default: foreach takes no mix."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from trainyard.engine.components.optim import build_optimizer

    mesh = init_device_mesh("cpu", (1,))

    def model(dtensor: bool) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4))
        if dtensor:  # the Linear's weight only: a mix
            m[0].weight = nn.Parameter(distribute_tensor(m[0].weight.detach(), mesh, [Replicate()]))
        return m

    plain, mixed, loop = model(False), model(True), model(False)
    opts = [build_optimizer(m, lr=0.1, weight_decay=0.1) for m in (plain, mixed, loop)]
    assert [o.defaults["foreach"] for o in opts[:2]] == [True, None]
    for group in opts[2].param_groups:
        group["foreach"] = False  # PyTorch's loop
    for step in range(3):
        for m, opt in zip((plain, mixed, loop), opts):
            for i, p in enumerate(m.parameters()):
                grad = torch.linspace(-1.0, 1.0 + step, p.numel()).reshape(p.shape) * (i + 1)
                p.grad = distribute_tensor(grad, mesh, [Replicate()]) if isinstance(p, DTensor) else grad
            opt.step()
    for a, b, c in zip(plain.parameters(), mixed.parameters(), loop.parameters()):
        b = b.full_tensor() if isinstance(b, DTensor) else b
        assert torch.equal(a, c) and torch.equal(a, b)
    assert not torch.equal(plain[0].weight, model(False)[0].weight)  # it stepped
