"""The engine's public API (`trainyard.engine`): parsing, block and plan discovery, one-process behaviour, and
(slow) multi-process runs against an unsharded single-process oracle through the API only."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainyard.engine as te
from trainyard.parallel.parallelism import Parallelism
from trainyard.engine.distributed.tp import check_plan, resolve_plan
from trainyard.engine.models.registry import resolve_spec

from .api_worker import ResidualMLP, build, loss_fn, probe
from .launch import HF, run_on_two_hosts

WORKER = os.path.join(os.path.dirname(__file__), "api_worker.py")


def test_parallelism_parses_typed_and_sagemaker_forms():
    typed = Parallelism.parse({"tensor_parallel_degree": 2, "mics": {"partition_group_size": 2}})
    assert (typed.tp, typed.partition_group_size) == (2, 2)
    smp_v2 = Parallelism.parse({"torch_distributed": {"enabled": True}, "smdistributed": {"modelparallel": {
        "enabled": True, "parameters": {"hybrid_shard_degree": 4, "tensor_parallel_degree": 2}}}})
    assert (smp_v2.tp, smp_v2.partition_group_size) == (2, 4)
    smp_v1 = Parallelism.parse({"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "sharded_data_parallel_degree": 2, "sdp_hierarchical_allgather": True, "sdp_gradient_clipping": 1.0}}},
        "mpi": {"enabled": True, "processes_per_host": 8}})
    assert (smp_v1.partition_group_size, smp_v1.hierarchical_allgather, smp_v1.gradient_clipping) == (2, True, 1.0)
    dims = smp_v2.dims(world_size=16, processes_per_host=8)
    assert (dims.dp_shard, dims.dp_replicate, dims.tp) == (4, 2, 2)
    with pytest.raises(ValueError, match="unknown key"):
        Parallelism.parse({"tensor_parallel": 2})
    with pytest.raises(ValueError, match="partition_group_size 3 must divide"):
        Parallelism.parse({"mics": {"partition_group_size": 3}}).dims(world_size=4, processes_per_host=2)


def test_blocks_are_found_for_hf_and_plain_modules():
    hf = build("hf")
    assert [type(b).__name__ for b in resolve_spec(hf).blocks(hf)] == ["LlamaDecoderLayer"] * 4
    mlp = ResidualMLP()
    assert resolve_spec(mlp).blocks(mlp) == list(mlp.stack)  # the largest ModuleList, not named layers
    assert resolve_spec(mlp, blocks=[nn.Sequential]).blocks(mlp) == list(mlp.stack)
    assert resolve_spec(mlp, blocks=["stack.0", "stack.1"]).blocks(mlp) == list(mlp.stack)[:2]
    with pytest.raises(ValueError, match="select no module"):
        resolve_spec(mlp, blocks=[nn.Conv1d]).blocks(mlp)


def test_tp_plans_resolve_patterns_and_check_widths():
    hf = build("hf")
    plan = resolve_spec(hf).tp_plan(hf)
    resolved = resolve_plan(hf, plan)
    assert resolved["model.layers.3.self_attn.q_proj"] == "colwise"
    assert resolved["model.layers.0.mlp.down_proj"] == "rowwise"
    assert resolved["lm_head"] == "colwise_gather_output"
    mlp = ResidualMLP()
    with pytest.raises(ValueError, match=r"stack.0.1.out_features = 64"):
        check_plan(mlp, resolve_plan(mlp, {"stack.*.1": "colwise"}), 3)
    with pytest.raises(ValueError, match="num_attention_heads = 4"):
        resolve_spec(hf).check_tp(hf, 8)


def test_transform_keeps_real_weights_and_trains_one_process(engine):
    torch.manual_seed(0)
    model = ResidualMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model = te.transform(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 128, (4, 8))
    losses = []
    for _ in range(3):
        for i in range(2):
            with te.accumulate(model, i, 2):
                loss = loss_fn(model(x[i * 2:(i + 1) * 2]), x[i * 2:(i + 1) * 2]) / 2
                loss.backward()
        assert te.clip_grad_norm_(model, 1e9) > 0
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_meta_models_are_initialised_the_same_whatever_the_seed_of_the_process(engine):
    cfg = build("hf").config
    from transformers import LlamaForCausalLM

    def meta():
        with torch.device("meta"):
            return LlamaForCausalLM(cfg)

    a = te.transform(meta(), seed=7)
    torch.manual_seed(123)
    b = te.transform(meta(), seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not a.model.rotary_emb.inv_freq.is_meta and a.model.norm.weight.eq(1).all()
    c = te.transform(meta(), seed=8)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_api_errors_name_the_fix(engine):
    with pytest.raises(ValueError, match="call model = transform"):
        with te.accumulate(ResidualMLP(), 0, 1):
            pass
    with pytest.raises(ValueError, match="kernels"):
        te.transform(ResidualMLP(), kernels=["rmsnorm"])
    model = te.transform(ResidualMLP())
    with pytest.raises(ValueError, match="pipeline_parallel_degree 2 = 2 must divide the world size 1"):
        te.transform(ResidualMLP(), distribution={"pipeline_parallel_degree": 2})


def test_a_process_of_a_multi_host_job_started_without_a_launcher_is_refused(monkeypatch):
    """No distribution: each host runs the script once, as plain python (SageMaker's way). An engine script
    there would train one model per host, each alone: refused naming the fix, by te.init() before anything
    else. One host, or torchrun's RANK: fine."""
    from trainyard.engine.distributed.process import check_launched

    monkeypatch.setenv("SM_HOSTS", '["algo-1", "algo-2"]')
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=r"^distribution: this job has 2 hosts"):
        te.init()

    with pytest.raises(ValueError, match=r"distribution: this job has 2 hosts.*torch_distributed"):
        check_launched({"SM_HOSTS": '["algo-1", "algo-2"]'})
    check_launched({"SM_HOSTS": '["algo-1"]'})
    check_launched({"SM_HOSTS": '["algo-1", "algo-2"]', "RANK": "1"})
    check_launched({})


def test_checkpoints_without_a_location_are_skipped_with_one_note(engine, capsys, monkeypatch, tmp_path):
    """A script that saves and loads runs as well without checkpoint_s3_uri: load gives 0, save saves nothing."""
    monkeypatch.setenv("SM_INPUT_CONFIG_DIR", str(tmp_path))  # a contract without checkpointconfig.json
    monkeypatch.chdir(tmp_path)
    model = te.transform(ResidualMLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert te.load_checkpoint(model, opt) == 0
    for step in (1, 2):
        assert te.save_checkpoint(model, opt, step) == 0.0
    out = capsys.readouterr().out
    assert out.count("save_checkpoint: the job has no checkpoint location") == 1
    assert "load_checkpoint: the job has no checkpoint location" in out and "training starts at step 0" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written anywhere


def test_global_loss_and_evaluate_give_the_batch_mean(engine):
    torch.manual_seed(0)
    model = te.transform(ResidualMLP())
    x = torch.randint(0, 128, (4, 9))
    whole = loss_fn(model(x[:, :-1]), x[:, 1:]).item()
    parts = sum(loss_fn(model(x[i:i + 2, :-1]), x[i:i + 2, 1:]).detach() / 2 for i in (0, 2))
    assert te.global_loss(model, parts) == pytest.approx(whole, rel=1e-6)
    assert te.evaluate(model, x[:, :-1], x[:, 1:], loss_fn, microbatches=2) == pytest.approx(whole, rel=1e-6)
    assert torch.equal(te.predict(model, x[:, :-1]), model(x[:, :-1]).detach())


def test_an_optimizer_built_after_an_evaluation_trains_every_parameter(engine):
    """MiCS keeps the root gathered after a forward for its backward; without a backward (te.evaluate, or a
    forward under no_grad) the units are sharded again, so model.parameters() gives the sharded parameters."""
    torch.manual_seed(0)
    model = te.transform(ResidualMLP(), mixed_precision="bf16")  # sharded on one process too
    x = torch.randint(0, 128, (4, 9))
    from torch.distributed.tensor import DTensor

    te.evaluate(model, x[:, :-1], x[:, 1:], loss_fn)
    assert all(isinstance(p, DTensor) for p in model.parameters())  # the sharded ones, not gathered copies
    with torch.no_grad():
        model(x[:, :-1])
    assert all(isinstance(p, DTensor) for p in model.parameters())
    before = {k: v.clone() for k, v in te.full_state_dict(model).items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    after = te.full_state_dict(model)
    assert [k for k in before if torch.equal(before[k], after[k])] == []


def test_a_save_straight_to_object_storage_marks_the_location_and_the_sync_leaves_its_steps_there(
        engine, tmp_path, s3_bucket):
    """te.save_checkpoint to the job's S3 location marks it; the driver's checkpoint sync then restores only the
    script's own files into /opt/ml/checkpoints, not the steps that te.load_checkpoint reads from the store (it
    downloaded every kept step on every host, once more). A save into a local folder leaves no mark."""
    import boto3

    from trainyard.container.ckpt_sync import CheckpointSync

    uri = f"s3://{s3_bucket}/ckpt"
    model = te.transform(ResidualMLP())
    opt = torch.optim.AdamW(model.parameters())
    te.save_checkpoint(model, opt, 2, uri=uri, blocking=True)
    te.save_checkpoint(model, opt, 4, uri=uri)
    assert te.wait_for_checkpoints()
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="ckpt/notes.txt", Body=b"the script's own file")
    said = []
    local = tmp_path / "checkpoints"
    assert CheckpointSync(str(local), uri, interval=3600, say=said.append).restore() == 1
    assert os.listdir(local) == ["notes.txt"], os.listdir(local)
    assert any("left there (te.load_checkpoint reads them from the store)" in m for m in said), said
    assert te.load_checkpoint(model, opt, uri=uri) == 4
    te.save_checkpoint(model, opt, 1, uri=str(tmp_path / "folder"), blocking=True)
    assert not (tmp_path / "folder" / ".trainyard-engine-checkpoints.json").exists()


def test_a_mark_that_cannot_be_written_does_not_stop_the_save(monkeypatch):
    from trainyard.engine.components.checkpoint import manager

    def unreachable(uri):
        raise ConnectionError("the store is down")

    monkeypatch.setattr(manager, "filesystem", unreachable)
    said: list[str] = []
    manager.mark_direct("s3://nowhere/ckpt-unmarked", said.append)
    assert said and said[0].startswith("WARNING: s3://nowhere/ckpt-unmarked/.trainyard-engine-checkpoints.json not "
                                       "written (ConnectionError: the store is down)")


def test_checkpoint_keeps_extra_values_and_loads_without_optimizer(engine, tmp_path):
    model = te.transform(ResidualMLP())
    opt = torch.optim.AdamW(model.parameters())
    te.save_checkpoint(model, opt, 3, uri=str(tmp_path), extra={"tokens_seen": 4096, "ema": torch.ones(2)})
    assert te.load_checkpoint(model, opt, uri=str(tmp_path / "empty")) == 0
    torch.manual_seed(9)
    other = te.transform(ResidualMLP())
    extra = {"tokens_seen": 0, "ema": torch.zeros(2)}
    assert te.load_checkpoint(other, None, uri=str(tmp_path), extra=extra) == 3
    assert extra["tokens_seen"] == 4096 and isinstance(extra["tokens_seen"], int) and extra["ema"].eq(1).all()
    assert torch.equal(other.head.weight, model.head.weight)


def test_check_equivalence_reports_agreement_and_catches_a_wrong_layout(engine, capsys):
    ids = torch.randint(0, 128, (4, 9))
    report = te.check_equivalence(lambda: build("hf"), ids[:, :-1], ids[:, 1:], loss_fn, microbatches=2)
    assert report.ok and report.loss_rel_err < 1e-5 and "EQUIVALENT" in capsys.readouterr().out
    # a block forward that drops its residual on the sharded side only must be caught
    state = {"calls": 0}

    def build_broken():
        model = build("hf")
        state["calls"] += 1
        if state["calls"] == 2:
            layer = model.model.layers[1].mlp
            layer.forward = lambda x, f=layer.forward: 2 * f(x)
        return model

    bad = te.check_equivalence(build_broken, ids[:, :-1], ids[:, 1:], loss_fn, verbose=False)
    assert not bad.ok and bad.worst_grad[1] > 1e-3
    # a model built on the meta device (te.build_model's) is initialised for the reference as transform does
    moe = te.check_equivalence(lambda: te.build_model("moe-tiny"), ids[:, :-1] % 512, ids[:, 1:] % 512,
                               loss_fn, microbatches=2, verbose=False)
    assert moe.ok and moe.loss_rel_err < 1e-6, moe


@pytest.mark.slow
def test_layouts_match_a_single_process_oracle(tmp_path):
    """MiCS p=2 in a host, p=4 across 2 hosts with hierarchy, TP=2 x MiCS, PP=2 (HF and built-in), all with
    gradient accumulation, through the public API only; and a weight two blocks share under MiCS (the two
    blocks are one shard unit) and TP x MiCS (one DTensor parameter for both)."""
    cases = [
        {"name": "mlp mics p2", "model": "mlp", "distribution": {"mics": {"partition_group_size": 2}}},
        {"name": "hf mics p4 hierarchical", "model": "hf",
         "distribution": {"mics": {"partition_group_size": 4, "hierarchical_allgather": True}}},
        {"name": "mlp mics p4 hierarchical", "model": "mlp", "distribution": {"mics": {"partition_group_size": 4}}},
        {"name": "shared weight mics p2", "model": "shared", "distribution": {"mics": {"partition_group_size": 2}}},
        {"name": "shared weight tp2 x mics", "model": "shared", "distribution": {"tensor_parallel_degree": 2}},
        {"name": "hf tp2 x mics", "model": "hf", "distribution": {"tensor_parallel_degree": 2}},
        {"name": "hf pp2 x mics", "model": "hf", "distribution": {"pipeline_parallel_degree": 2}},
        {"name": "llama pp2 gpipe", "model": "llama",
         "distribution": {"pipeline_parallel_degree": 2, "pipeline_schedule": "gpipe"}},
    ]
    evaluate = {"name": "hf pp2 evaluate", "kind": "evaluate", "model": "hf",
                "distribution": {"pipeline_parallel_degree": 2}}
    prelu = {"name": "prelu under tp", "kind": "refused", "model": "prelu", "distribution": {"tensor_parallel_degree": 2}}
    results = run_on_two_hosts(WORKER, [{**c, "kind": "oracle", "microbatches": 2} for c in cases] + [evaluate, prelu],
                               tmp_path, preload=HF)
    # a parameter between the column- and the row-parallel layer, outside the plan: refused after the first backward
    assert "stack.0.2.weight, stack.1.2.weight, stack.2.2.weight, stack.3.2.weight got different gradients on the " \
           "ranks of one tensor-parallel group" in results["prelu under tp"]["refused"], results["prelu under tp"]
    for case in cases:
        assert results[case["name"]]["worst_rel_err"] < 1e-5, (case["name"], results[case["name"]])
    # evaluation under a pipeline: the loss on every rank, the logits on the last stage's 2 ranks
    got = results["hf pp2 evaluate"]
    assert got["loss_err"] < 1e-6 and got["predict_err"] < 1e-5 and got["ranks_with_output"] == 2, got


@pytest.mark.slow
def test_checkpoint_resumes_on_another_host_layout_with_the_same_losses(tmp_path):
    """Saved on 2 hosts x 2 processes, resumed on 1 host x 2, saved there and resumed on 2 hosts x 2 again: the loss
    curve of the uninterrupted run (3 launches; the layouts' agreement from step 1 is the oracle tests')."""
    uri = str(tmp_path / "ckpt")

    def run(name: str, hosts: int, steps: int, save_at: int) -> dict:
        (tmp_path / name).mkdir()
        return run_on_two_hosts(WORKER, [{"name": "c", "kind": "curve", "model": "hf", "uri": uri, "steps": steps,
                                          "save_at": save_at}], tmp_path / name, hosts=hosts, preload=HF)["c"]

    whole = run("whole", 2, 6, 2)["losses"]
    for name, hosts, start, steps in (("on-1-host", 1, 2, 4), ("on-2-hosts", 2, 4, 6)):
        got = run(name, hosts, steps, steps)  # resumes from the newest step, then saves its last
        assert got["start"] == start, (name, got)
        assert got["losses"] == pytest.approx({k: v for k, v in whole.items() if start < int(k) <= steps},
                                              rel=1e-5), name


@pytest.mark.slow
def test_export_of_a_tp_x_mics_model_loads_with_from_pretrained_and_back(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    out.mkdir()
    results = run_on_two_hosts(WORKER, [
        {"name": "export", "kind": "export", "distribution": {"tensor_parallel_degree": 2}, "dir": str(out)},
        {"name": "reload", "kind": "reload", "distribution": {"mics": {"partition_group_size": 2}},
         "dir": str(out)},
        {"name": "reload pp2", "kind": "reload", "distribution": {"pipeline_parallel_degree": 2}, "dir": str(out)},
        # and written again from 2 interleaved stages a rank (whose rank model is no Hugging Face model: the
        # export once lost its config.json there)
        {"name": "reload pp2 v2", "kind": "reload", "dir": str(out), "export_to": str(tmp_path / "again"),
         "distribution": {"pipeline_parallel_degree": 2, "virtual_stages": 2, "pipeline_schedule": "interleaved_1f1b"}},
        {"name": "busy", "kind": "busy", "uri": str(tmp_path / "ckpt")}],
        tmp_path, preload=HF)
    want = torch.load(out / "probe.pt")
    for folder in (out, tmp_path / "again"):
        assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        loaded = AutoModelForCausalLM.from_pretrained(str(folder))
        assert (loaded(probe()).logits - want).abs().max().item() < 1e-5
    assert results["reload"]["worst_abs_diff"] < 1e-5
    for name in ("reload pp2", "reload pp2 v2"):
        assert results[name]["worst_abs_diff"] < 1e-5 and results[name]["ranks_with_output"] == 2, results[name]
    # (the same launch) an upload still in flight on rank 0 alone is in flight for every rank: all skip or all save
    assert results["busy"] == {"held": [True] * 4, "released": [False] * 4}


def test_a_partial_init_is_refused_by_name(engine):
    def linear_only(module):
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)
            nn.init.zeros_(module.bias)

    with torch.device("meta"):
        model = ResidualMLP()
    with pytest.raises(ValueError, match=r"embed.weight \(Embedding\) was not filled"):
        te.transform(model, init=linear_only)
