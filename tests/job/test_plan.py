"""The planner (trainyard.job.plan): shapes, memory and step-time formulas, the layouts it enumerates (every one
accepted by the SDK's own checks), ranking, cost and the errors for bad input. Torch-free and fast."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from trainyard.job.distribution import normalize
from trainyard.errors import ConfigError
from trainyard.job.plan import Layout, evaluate, layouts, plan, resolve_model
from trainyard.job.plan import memory
from trainyard.parallel.layout import check_cp_pp
from trainyard.job.plan.hardware import COMPILED_SPEEDUP, STEP_BYTES_PER_PARAM, hardware
from trainyard.parallel.shapes import from_preset

GiB = 2 ** 30


def _layout(**kw) -> Layout:
    base = dict(dp=8, partition_group_size=8, tp=1, pp=1, pipeline_schedule="none", virtual_stages=1,
                micro_batch_size=1, microbatches=1, activation_checkpointing="none", precision="bf16")
    return Layout(**(base | kw))


def test_preset_shapes_match_the_published_counts():
    assert from_preset("llama3-8b").total_params == pytest.approx(8.03e9, rel=0.005)  # Llama 3.1 8B: 8.03B
    assert from_preset("llama3-70b").total_params == pytest.approx(70.55e9, rel=0.005)
    assert from_preset("llama3.2-1b").total_params == pytest.approx(1.50e9, rel=0.01)  # untied head (model.py)


def test_hf_config_file_or_folder_reads_as_the_preset(tmp_path):
    config = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "max_position_embeddings": 8192, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for given in (str(tmp_path), str(tmp_path / "config.json")):
        shape = resolve_model(given)
        assert shape.total_params == from_preset("llama3-8b").total_params
        assert shape.flops_per_token(2048) == from_preset("llama3-8b").flops_per_token(2048)
    gpt2 = {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    shape = resolve_model(str(tmp_path))
    assert shape.tied_embeddings and not shape.gated_mlp and shape.total_params == pytest.approx(124.4e6, rel=0.01)


def test_an_hf_mixture_of_experts_config_reads_with_its_experts(tmp_path):
    """Mixtral 8x7B's config.json is the mixtral-8x7b preset (46.7B parameters, 12.9B active), not a 7B dense
    model; a config some of whose blocks stay dense is refused by name rather than planned as all-MoE."""
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
               "num_experts_per_tok": 2, "max_position_embeddings": 32768, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(mixtral))
    shape, preset = resolve_model(str(tmp_path)), from_preset("mixtral-8x7b")
    assert (shape.n_experts, shape.top_k, shape.expert_hidden) == (8, 2, 14336)
    assert shape.total_params == preset.total_params and shape.matmul_params == preset.matmul_params
    assert shape.flops_per_token(4096) == preset.flops_per_token(4096)
    qwen2 = {**mixtral, "model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4,
             "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
             "mlp_only_layers": []}
    del qwen2["num_local_experts"]
    (tmp_path / "config.json").write_text(json.dumps(qwen2))
    shape = resolve_model(str(tmp_path))
    assert (shape.n_experts, shape.top_k, shape.expert_hidden, shape.n_shared_experts) == (60, 4, 1408, 4)
    for key, value in (("mlp_only_layers", [0, 5]), ("decoder_sparse_step", 2)):
        (tmp_path / "config.json").write_text(json.dumps({**qwen2, key: value}))
        with pytest.raises(ConfigError, match=f"{key}=") as e:
            resolve_model(str(tmp_path))
        assert e.value.field == "model"
    (tmp_path / "config.json").write_text(json.dumps({**mixtral, "num_experts_per_tok": 9}))
    with pytest.raises(ConfigError, match="num_experts_per_tok=9"):
        resolve_model(str(tmp_path))
    # what the engine refuses is not planned: experts not packed as Mixtral's (GPT-OSS) are not spread, attention
    # within a sliding window is not split over the sequence; DBRX's nested experts are not read as a dense model
    gpt_oss = {**mixtral, "model_type": "gpt_oss", "sliding_window": 128}
    (tmp_path / "config.json").write_text(json.dumps(gpt_oss))
    found = plan(str(tmp_path), seq_len=4096, global_batch_size=16, instance_type="ml.p4d.24xlarge", instance_count=2)
    assert {p.layout.ep for p in found.layouts} == {1} and {p.layout.cp for p in found.layouts} == {1}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "dbrx", "d_model": 6144, "n_layers": 40,
                                                      "n_heads": 48, "vocab_size": 100352,
                                                      "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}}))
    with pytest.raises(ConfigError, match="keeps its experts in ffn_config"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("model, fragment", [("nope", "neither a built-in preset"), ("", "expected a preset")])
def test_unknown_model_is_a_config_error(model, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        resolve_model(model)
    assert e.value.field == "model"


def test_model_states_are_16_psi_over_p():
    shape = from_preset("llama3-8b")
    psi = shape.total_params
    for p in (1, 2, 8):
        m = memory.estimate(shape, _layout(partition_group_size=p), 2048)
        assert m.model_states == pytest.approx(16 * psi / p, rel=1e-6)
        assert (m.parameters, m.gradients, m.optimizer) == (pytest.approx(4 * psi / p), pytest.approx(4 * psi / p),
                                                            pytest.approx(8 * psi / p))


def test_checkpointing_and_pipeline_schedules_order_the_activations():
    shape = from_preset("llama3-8b")
    acts = {ac: memory.estimate(shape, _layout(activation_checkpointing=ac), 4096).activations
            for ac in ("none", "selective", "full")}
    assert acts["none"] > acts["selective"] > acts["full"]
    pipe = dict(dp=2, partition_group_size=2, pp=4, microbatches=8)
    gpipe = memory.estimate(shape, _layout(**pipe, pipeline_schedule="gpipe"), 4096).activations
    one_f = memory.estimate(shape, _layout(**pipe, pipeline_schedule="1f1b"), 4096).activations
    assert gpipe > one_f  # GPipe keeps all 8 micro-batches, 1F1B at most 4 on its first stage
    assert memory.in_flight(_layout(**pipe, pipeline_schedule="1f1b"), 0) == 4
    assert memory.in_flight(_layout(**pipe, pipeline_schedule="1f1b"), 3) == 1


def test_every_layout_is_one_the_sdk_accepts():
    shape = dataclasses.replace(from_preset("6l"), n_layers=8)  # 8 blocks: 2 stages x 2 virtual stages too
    found = layouts(shape, seq_len=128, global_batch_size=16, world=8, gpus_per_host=4)
    assert {(lay.tp, lay.pp) for lay in found} == {(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4), (1, 8)}  # no tp 4:
    # 2 kv heads
    assert {lay.pipeline_schedule for lay in found} == {"none", "gpipe", "1f1b", "interleaved_1f1b"}
    for lay in found:
        typed = normalize(lay.distribution(), world_size=8, processes_per_host=4)
        assert typed["mics"]["partition_group_size"] == lay.partition_group_size
        assert lay.dp * lay.micro_batch_size * lay.microbatches == 16


def test_plan_ranks_fitting_layouts_fastest_first_and_marks_the_rest():
    result = plan("llama3-70b", seq_len=4096, global_batch_size=32, instance_type="ml.p5.48xlarge", instance_count=4)
    fitting = [p for p in result.layouts if p.fits]
    rest = [p for p in result.layouts if not p.fits]
    assert fitting and rest and result.layouts[:len(fitting)] == fitting
    speeds = [p.tokens_per_s_per_gpu for p in fitting]
    assert all(later <= earlier * 1.01 for earlier, later in zip(speeds, speeds[1:]))  # within 1%: less memory
    assert speeds[0] == pytest.approx(max(speeds), rel=0.01)
    usable = result.hardware.usable_memory_bytes
    assert all(p.over_bytes == max(0, p.memory.total - usable) and p.over_bytes + p.host_over_bytes > 0 for p in rest)
    assert [p.over_bytes + p.host_over_bytes for p in rest] == sorted(p.over_bytes + p.host_over_bytes for p in rest)
    # 32 x 80 GiB cannot hold 70B's 1.13 TB of states on every GPU: DDP never fits
    assert all(not p.fits for p in result.layouts
               if p.layout.partition_group_size * p.layout.tp * p.layout.pp * p.layout.cp == 1)
    assert result.best is fitting[0]


def test_cpu_offload_moves_the_model_states_to_the_host_and_costs_time():
    shape, hw = from_preset("llama3-8b"), hardware("p5.48xlarge", 1)
    kept, offloaded = (evaluate(shape, _layout(cpu_offload=off), seq_len=4096, global_batch_size=8, hw=hw,
                                instance_count=1) for off in (False, True))
    states = kept.memory.model_states
    assert states == pytest.approx(16 * shape.total_params / 8, rel=1e-6)
    assert offloaded.memory.model_states == 0 and offloaded.memory.host == pytest.approx(states, rel=1e-6)
    assert kept.memory.host == 0
    # the GPU keeps activations and buffers: its peak drops by the parameters and optimizer states it no longer holds
    drop = kept.memory.parameters + kept.memory.optimizer
    assert kept.memory.total - offloaded.memory.total == pytest.approx(drop, rel=0.05)
    # slower: the host's AdamW over the rank's 1e9 parameters, at least
    assert offloaded.time.offload_s >= shape.total_params / 8 / 1e9 > 0 == kept.time.offload_s
    assert offloaded.time.step_s > kept.time.step_s
    assert offloaded.layout.distribution()["mics"]["cpu_offload"] is True
    assert normalize(offloaded.layout.distribution(), world_size=8, processes_per_host=8)["mics"]["cpu_offload"]


def test_offload_is_chosen_only_when_nothing_else_fits_and_host_memory_is_checked():
    one_gpu = plan("llama3-8b", seq_len=4096, global_batch_size=8, instance_type="p5.4xlarge")
    assert one_gpu.best.layout.cpu_offload  # 128 GB of states on one 80 GiB GPU: only offloaded layouts fit
    assert not any(p.fits for p in one_gpu.layouts if not p.layout.cpu_offload)
    eight = plan("llama3-8b", seq_len=4096, global_batch_size=16, instance_type="p5.48xlarge")
    assert not eight.best.layout.cpu_offload  # sharded over 8 GPUs it fits without: faster
    assert any(p.layout.cpu_offload for p in eight.layouts)
    # 70B on one GPU: its 1.1 TB of states do not fit in the host memory of a p5.4xlarge either
    big = plan("llama3-70b", seq_len=4096, global_batch_size=8, instance_type="p5.4xlarge")
    assert big.best is None
    worst = big.layouts[0]
    assert worst.layout.cpu_offload and worst.over_bytes == 0 and worst.host_over_bytes == \
        worst.memory.host - big.hardware.usable_host_memory_per_gpu > 0
    # CPU hosts have nothing to offload to: never enumerated there
    local = plan("10m", seq_len=64, global_batch_size=8, instance_type="local", processes_per_host=2)
    assert not any(p.layout.cpu_offload for p in local.layouts)


def test_compile_runs_the_tokens_faster_and_the_per_step_overhead_is_the_rank_s_parameters_at_memory_speed():
    shape, hw = from_preset("llama3.2-1b"), hardware("p5.4xlarge", 1)
    one = dict(dp=1, partition_group_size=1)
    eager, compiled = (evaluate(shape, _layout(**one, micro_batch_size=4), seq_len=2048, global_batch_size=4, hw=hw,
                                instance_count=1, compiled=c) for c in (False, True))
    assert compiled.time.compute_s == pytest.approx(eager.time.compute_s / COMPILED_SPEEDUP)
    for p, c in ((eager, False), (compiled, True)):
        assert p.time.overhead_s == pytest.approx(STEP_BYTES_PER_PARAM[c] * shape.total_params / 3.35e12, rel=1e-3)
        assert p.time.step_s == pytest.approx(p.time.compute_s + p.time.overhead_s)
    assert compiled.tokens_per_s_per_gpu > eager.tokens_per_s_per_gpu * COMPILED_SPEEDUP
    # once per step: more tokens a step, more tokens a second; sharded over 8 GPUs, an eighth of it each
    speeds = [evaluate(shape, _layout(**one, micro_batch_size=m), seq_len=2048, global_batch_size=m, hw=hw,
                       instance_count=1).tokens_per_s_per_gpu for m in (1, 2, 4, 8)]
    assert speeds == sorted(speeds) and speeds[0] < 0.7 * speeds[-1]
    eight = evaluate(shape, _layout(), seq_len=2048, global_batch_size=8, hw=hardware("p5.48xlarge", 1),
                     instance_count=1)
    assert eight.time.overhead_s == pytest.approx(eager.time.overhead_s / 8, rel=0.01)
    # the plan says which it is; CPU hosts have no memory figure, so no overhead
    assert plan("llama3.2-1b", seq_len=2048, global_batch_size=8, instance_type="p5.4xlarge", compile=True).compiled
    local = plan("tiny", seq_len=64, global_batch_size=8, instance_type="local", processes_per_host=2)
    assert not local.compiled and all(p.time.overhead_s == 0 for p in local.layouts)
    with pytest.raises(ConfigError) as e:
        plan("tiny", seq_len=64, global_batch_size=8, instance_type="local", compile="yes")
    assert e.value.field == "compile"


def test_less_compute_never_plans_a_slower_step_and_fp32_runs_at_the_fp32_rate():
    """MiCS's traffic and the offload's PCIe copies hide behind the same compute: counted once, so compile or no
    recomputation can only make a step faster (counted twice, an offloaded layout planned compiled 4.7% slower
    than eager, and selective checkpointing faster than none)."""
    shape, hw = from_preset("llama3.2-1b"), hardware("p5.48xlarge", 1)
    base = _layout(dp=2, partition_group_size=2, cp=4, microbatches=32, cpu_offload=True)
    speed = {(ac, c): evaluate(shape, dataclasses.replace(base, activation_checkpointing=ac), seq_len=4096,
                               global_batch_size=64, hw=hw, instance_count=1, compiled=c).tokens_per_s_per_gpu
             for ac in ("none", "selective", "full") for c in (False, True)}
    for ac in ("none", "selective", "full"):
        assert speed[ac, True] > speed[ac, False]
    for c in (False, True):
        assert speed["none", c] > speed["selective", c] > speed["full", c]
    # the engine leaves TF32 off: an fp32 layout's matrix multiplies run at the fp32 datasheet rate
    lay = _layout(dp=1, partition_group_size=1)
    one = hardware("p4de.24xlarge", 1)
    bf16, fp32 = (evaluate(shape, dataclasses.replace(lay, precision=p), seq_len=2048, global_batch_size=1, hw=one,
                           instance_count=1) for p in ("bf16", "fp32"))
    assert fp32.time.compute_s == pytest.approx(bf16.time.compute_s * 312 / 19.5)
    # local speeds are nominal: compile does not push them past the nominal peak
    local = plan("10m", seq_len=64, global_batch_size=8, instance_type="local", instance_count=2, compile=True)
    assert all(p.mfu <= 1 for p in local.layouts)


def test_several_counts_are_ranked_together_by_cost_per_token():
    result = plan("llama3-8b", seq_len=4096, global_batch_size=64, instance_type="p4d.24xlarge",
                  instance_count=[1, 2, 4])
    assert result.instance_counts == (1, 2, 4) and {p.instance_count for p in result.layouts} == {1, 2, 4}
    fitting = [p for p in result.layouts if p.fits]
    costs = [p.usd_per_million_tokens for p in fitting]
    assert all(later >= earlier / 1.01 for earlier, later in zip(costs, costs[1:]))  # same instance type: same order


def test_cost_and_time_to_train():
    hw = hardware("p5.48xlarge", 2)
    shape = from_preset("llama3-8b")
    p = evaluate(shape, _layout(dp=16, partition_group_size=16, micro_batch_size=2), seq_len=8192,
                 global_batch_size=32, hw=hw, instance_count=2, train_tokens=1e9)
    tokens_per_s = p.tokens_per_s_per_gpu * 16
    assert p.usd_per_million_tokens == pytest.approx(2 * 55.04 / (tokens_per_s * 3600) * 1e6)
    assert p.hours_to_train == pytest.approx(1e9 / tokens_per_s / 3600)
    assert p.usd_to_train == pytest.approx(p.hours_to_train * 2 * 55.04)
    assert p.mfu == pytest.approx(p.tokens_per_s_per_gpu * shape.flops_per_token(8192) / 989.4e12)


def test_hierarchical_mics_sends_less_across_hosts_than_flat_zero3():
    shape, hw = from_preset("llama3-8b"), hardware("p4d.24xlarge", 4)
    accumulate = dict(dp=32, microbatches=4)  # MiCS gathers inside a host every micro-batch, syncs replicas once
    zero3 = evaluate(shape, _layout(**accumulate, partition_group_size=32), seq_len=2048, global_batch_size=128,
                     hw=hw, instance_count=4)
    mics = evaluate(shape, _layout(**accumulate, partition_group_size=8), seq_len=2048, global_batch_size=128,
                    hw=hw, instance_count=4)
    assert mics.time.comm_inter_bytes < zero3.time.comm_inter_bytes
    assert mics.memory.model_states == pytest.approx(4 * zero3.memory.model_states, rel=1e-3)


@pytest.mark.parametrize("kwargs, field", [
    (dict(instance_type="ml.p9.48xlarge"), "instance_type"),
    (dict(instance_type="g5.48xlarge"), "instance_type"),  # no bf16 peak in the catalog
    (dict(instance_type="p5.4xlarge", instance_count=2), "instance_count"),  # no EFA figure
    (dict(seq_len=100_000), "seq_len"),
    (dict(seq_len=0), "seq_len"),
    (dict(global_batch_size=0), "global_batch_size"),
    (dict(precision="fp8"), "precision"),
])
def test_bad_input_names_the_field(kwargs, field):
    args = dict(seq_len=2048, global_batch_size=16, instance_type="p5.48xlarge", instance_count=1) | kwargs
    with pytest.raises(ConfigError) as e:
        plan("llama3-8b", **args)
    assert e.value.field == field


def test_the_planner_does_not_load_torch():
    code = ("import sys; from trainyard.job.plan import plan; plan('llama3-8b', seq_len=2048, global_batch_size=8, "
            "instance_type='p5.48xlarge'); print([m for m in ('torch', 'boto3') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_a_model_object_built_for_the_engine_plans_by_its_config():
    from trainyard.parallel.presets import MODEL_CONFIGS

    class Meta:  # what the engine's meta build gives: a module whose `config` is the ModelConfig
        config = MODEL_CONFIGS["llama3-8b"]

    class HFConfig:
        def to_dict(self):
            return {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}

    class HF:
        config = HFConfig()

    for model in (Meta(), HF(), MODEL_CONFIGS["llama3-8b"]):
        assert resolve_model(model).total_params == from_preset("llama3-8b").total_params
    with pytest.raises(ConfigError, match="no built-in ModelConfig"):
        resolve_model(type("Other", (), {"config": object()})())


def test_context_parallelism_divides_a_sequence_s_activations_and_adds_its_ring():
    """The rank's activations are those of seq_len / cp tokens (plus the ring's fp32 output); the model states are
    sharded over the cp ranks too (they share the partition group); the ring's bytes per layer and micro-batch are
    2 (cp - 1) KV + cp G, behind the attention (overlapped traffic)."""
    from trainyard.job.plan import steptime

    shape, hw = from_preset("llama3-8b"), hardware("ml.p4d.24xlarge", 1)
    one = _layout(dp=1, partition_group_size=1, tp=8)
    two = dataclasses.replace(one, tp=4, cp=2)
    assert two.world == 8 and two.distribution()["context_parallel_degree"] == 2
    a1 = memory.estimate(shape, one, 8192).activations
    a2 = memory.estimate(shape, two, 8192).activations
    per_token = (memory.per_layer_bytes(shape, "bf16") + 4 * shape.dim) / 4 * shape.n_layers
    assert a2 == pytest.approx(8192 / 2 * per_token, rel=1e-6) and a2 > a1  # tp 4 x cp 2 against tp 8
    t1 = steptime.estimate(shape, one, 8192, 1, hw, 1)
    t2 = steptime.estimate(shape, two, 8192, 1, hw, 1)
    kv = 2 * 8192 // 2 * shape.kv_dim / 4  # elements of the rank's keys and values (over tp 4)
    tp_bytes = lambda lay: 8 * shape.n_layers * 8192 // lay.cp * shape.dim * 2 * (lay.tp - 1) / lay.tp  # noqa: E731
    gathers = (2 * 2 + 4) * steptime._stage_params(shape, two) / 2  # MiCS over the 2 cp ranks: (2c + 4) Psi / 2
    assert t2.comm_intra_bytes - tp_bytes(two) - gathers == pytest.approx(
        shape.n_layers * (2 * kv * 2 + 2 * kv * 4), rel=1e-9)
    assert t1.comm_intra_bytes == pytest.approx(tp_bytes(one), rel=1e-9)
    assert memory.estimate(shape, two, 8192).parameters == pytest.approx(
        memory.estimate(shape, dataclasses.replace(one, tp=4), 8192).parameters / 2, rel=1e-6)


def test_the_plan_of_a_long_sequence_offers_context_parallel_layouts_and_auto_names_them():
    from trainyard.job.distribution import typed
    from trainyard.job.plan.auto import summary

    result = plan("llama3-8b", seq_len=8192, global_batch_size=2, instance_type="ml.p4d.24xlarge", instance_count=1)
    cps = {p.layout.cp for p in result.layouts}
    assert cps == {1, 2, 4, 8}
    for p in result.layouts:  # the SDK takes every one of them
        typed(p.layout.distribution(), world_size=8, processes_per_host=8)
    best_cp = next(p for p in result.layouts if p.layout.cp > 1)
    assert f", cp {best_cp.layout.cp}" in summary(best_cp)


def test_a_hugging_face_model_is_never_planned_with_context_and_pipeline_parallelism_together(tmp_path):
    """The engine refuses CP x PP for an HF model (its stages cannot take a rank's chunks): the planner, and so
    distribution='auto', never proposes it; the built-in model of the same shape gets such layouts."""
    config = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "max_position_embeddings": 8192, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    kw = dict(seq_len=8192, global_batch_size=4, instance_type="ml.p4d.24xlarge", instance_count=2)
    hf = plan(str(tmp_path), **kw)
    assert {p.layout.cp for p in hf.layouts} > {1} and {p.layout.pp for p in hf.layouts} > {1}
    assert not [p.layout for p in hf.layouts if p.layout.cp > 1 and p.layout.pp > 1]
    assert [p.layout for p in plan("llama3-8b", **kw).layouts if p.layout.cp > 1 and p.layout.pp > 1]
    with pytest.raises(ValueError, match="context_parallel_degree 2 with pipeline_parallel_degree 2: config's"):
        check_cp_pp(cp=2, pp=2, stages_take_cp=False, model="config")


def test_expert_parallelism_spreads_the_experts_and_its_all_to_all_is_waited_for():
    from trainyard.job.plan import steptime

    shape, hw = from_preset("mixtral-8x7b"), hardware("ml.p4d.24xlarge", 2)
    base = _layout(dp=16, partition_group_size=1, activation_checkpointing="full")
    spread = dataclasses.replace(base, ep=8)
    dense_block = shape.block_matrix_params - shape.block_expert_params + 2 * shape.dim
    root = shape.embedding_params + shape.head_params
    m1, m8 = memory.estimate(shape, base, 4096), memory.estimate(shape, spread, 4096)
    assert m1.parameters == (shape.n_layers * (shape.block_matrix_params + 2 * shape.dim) + root) * 4
    assert m8.parameters == round((shape.n_layers * dense_block + root) * 4
                                  + shape.n_layers * shape.block_expert_params / 8 * 4)
    assert spread.distribution()["expert_parallel_degree"] == 8
    t1, t8 = steptime.estimate(shape, base, 4096, 16, hw, 2), steptime.estimate(shape, spread, 4096, 16, hw, 2)
    # the all-to-all inside a host of 8 (full recompute: 6 per layer and micro-batch), nothing else intra-host at
    # p = 1; the spread experts' gradients cross the 2 hosts once, between the 2 ranks holding each expert
    a2a = shape.n_layers * (4 + 2) * 4096 * shape.top_k * 7 / 8 * shape.dim * 2
    assert t1.comm_intra_bytes == 0 and t8.comm_intra_bytes == pytest.approx(a2a, rel=1e-9)
    experts = shape.n_layers * shape.block_expert_params / 8
    dense = shape.n_layers * (shape.block_matrix_params - shape.block_expert_params + 2 * shape.dim) + \
        shape.embedding_params + shape.head_params
    assert t8.comm_inter_bytes == pytest.approx(2 * 4 * experts / 2 + 2 * 4 * dense * 15 / 16, rel=1e-9)
    result = plan("mixtral-8x7b", seq_len=4096, global_batch_size=16, instance_type="ml.p4d.24xlarge",
                  instance_count=2)
    eps = {p.layout.ep for p in result.layouts}
    assert eps == {1, 2, 4, 8} and any(p.layout.pp > 1 and p.layout.ep > 1 for p in result.layouts)
    # the built-in mixture of experts takes tensor parallelism: attention (and any shared expert) split, the routed
    # experts whole on the rank (n_experts / ep of them), outside MiCS, and their gradients summed over tp
    assert any(p.layout.tp > 1 and p.layout.ep > 1 for p in result.layouts)
    tp2 = dataclasses.replace(base, dp=8, tp=2)
    whole = memory.estimate(shape, tp2, 4096).parameters
    assert whole == round((shape.n_layers * ((shape.block_matrix_params - shape.block_expert_params) / 2
                                             + 2 * shape.dim) + root / 2 + shape.dim / 2) * 4
                          + shape.n_layers * shape.block_expert_params * 4)
    hf = dataclasses.replace(shape, experts_with_tp=False)  # a Hugging Face one does not (from_hf_config)
    result = plan(hf, seq_len=4096, global_batch_size=16, instance_type="ml.p4d.24xlarge", instance_count=2)
    assert {p.layout.tp for p in result.layouts} == {1} and {p.layout.ep for p in result.layouts} == {1, 2, 4, 8}
