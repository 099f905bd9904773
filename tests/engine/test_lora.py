"""LoRA adapters (peft) through the engine (issue 37): on 2 hosts x 2 processes, an HF Llama and an HF Qwen2 with
tied embeddings, each under MiCS p=2 and TP=2 x MiCS, train as one unsharded process does (losses and adapter
weights within 1e-5), only the adapters change (the frozen weights bit for bit), only they hold optimizer state;
the adapter export loads with `PeftModel.from_pretrained` and gives the trained model's logits; a checkpoint of the
adapters alone, resumed on 1 host x 2 over the base loaded from its safetensors, continues the loss curve. A meta-device
build starts as its base. An HF Llama under PP=2 (2 interleaved stages a rank) x MiCS does the same, its adapter and merged exports hold every
stage's adapters, and its adapter checkpoint resumes under MiCS, as the MiCS one does as a pipeline. Refused by name: other adapter types, DoRA, kernels,
a pipeline of tied embeddings, lora_dropout under tensor parallelism, targets that are no linear layer, splits that
do not carry onto LoRA layers (tests/engine/lora_worker.py)."""
import json
import math
import os
import re

import pytest
import torch

from .launch import HF, run_on_two_hosts

WORKER = os.path.join(os.path.dirname(__file__), "lora_worker.py")
TOL = 1e-5


@pytest.mark.slow
def test_lora_on_llama_and_tied_qwen2_matches_one_process_exports_and_resumes_on_another_layout(tmp_path):
    uri, base, export = str(tmp_path / "ckpt"), str(tmp_path / "base"), str(tmp_path / "adapter")
    cases = [{"name": "llama mics p2", "family": "llama", "tie": False, "layout": "mics p2", "steps": 4,
              "export": export, "uri": uri, "save_at": 2, "base": base},
             {"name": "llama tp2 x mics", "family": "llama", "tie": False, "layout": "tp2 x mics", "steps": 3},
             {"name": "qwen2 tied mics p2", "family": "qwen2", "tie": True, "layout": "mics p2", "steps": 3,
              "export": str(tmp_path / "qwen2-adapter")},
             {"name": "qwen2 tied tp2 x mics", "family": "qwen2", "tie": True, "layout": "tp2 x mics", "steps": 3}]
    # the pipeline, 2 stages a rank: each stage a cut of the PEFT model; the exports find the adapters of every stage
    cases.append({"name": "llama pp2 x mics", "family": "llama", "tie": False, "layout": "pp2 v2 x mics", "steps": 3,
                  "export": str(tmp_path / "pp-adapter"), "merged": str(tmp_path / "pp-merged"),
                  "uri": str(tmp_path / "pp-ckpt"), "save_at": 2, "base": str(tmp_path / "pp-base")})
    tied_pipeline = {"name": "tied pp2", "family": "qwen2", "tie": True, "layout": "pp2 x mics", "refused": True}
    dropping = {"name": "dropout", "family": "llama", "tie": False, "layout": "tp2 x mics", "refused": True,
                "dropout": 0.1}
    results = run_on_two_hosts(WORKER, cases + [tied_pipeline, dropping], tmp_path, preload=HF)
    assert "pipeline_parallel_degree 2: the engine cannot cut peft:hf:Qwen2ForCausalLM into stages " \
           "(Qwen2ForCausalLM ties its input embedding and LM head" in results["tied pp2"]["refused"]
    assert "tensor_parallel_degree 2 with lora_dropout > 0" in results["dropout"]["refused"]
    for case in cases:
        got = results[case["name"]]
        assert got["loss_err"] <= TOL and got["weight_err"] <= TOL, (case["name"], got["worst"], got)
        assert got["frozen_changed"] == [] and got["adapters_unchanged"] == [], (case["name"], got)
        # 4 layers x 7 wrapped linears x (A, B); the optimizer holds state for them and for nothing else
        assert got["adapters"] == 56 and len(got["stateful"]) == 56 and all(".lora_" in n for n in got["stateful"])
        if "export" in case:
            assert got["export_err"] <= TOL, (case["name"], got["export_err"])
        if "merged" in case:
            assert got["merged_err"] <= TOL, (case["name"], got["merged_err"])
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["peft_type"] == "LORA" and sorted(saved["target_modules"])
    # the checkpoint holds the adapters and their optimizer state, not the frozen base
    from trainyard.engine.components import checkpoint as ckpt
    from trainyard.engine.components.checkpoint.io import SafeReader

    keys = SafeReader(ckpt.step_uri(uri, 2)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("app.model.")]
    assert len(model_keys) == 56 and all(".lora_" in k for k in model_keys)

    run = tmp_path / "resume"
    run.mkdir()
    # on 1 host x 2, each checkpoint on the other layout: the MiCS one as a 2-stage pipeline (the base's files read
    # by each stage), the pipeline's (its stages' adapters) under MiCS
    resumed = run_on_two_hosts(WORKER, [
        {**cases[0], "layout": "pp2 x mics", "resume": True, "export": None},
        {**cases[-1], "layout": "mics p2", "resume": True, "export": None, "merged": None}], run, hosts=1, preload=HF)
    for name, steps in (("llama mics p2", ["3", "4"]), ("llama pp2 x mics", ["3"])):
        want, got = results[name]["losses"], resumed[name]["losses"]
        assert sorted(got) == steps
        assert got == pytest.approx({k: want[k] for k in got}, rel=TOL)
        assert resumed[name]["frozen_changed"] == []


def test_other_adapters_and_meta_builds_are_refused_by_name(engine):
    from peft import IA3Config, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import trainyard.engine as te

    from . import families

    def llama(device="cpu"):
        with torch.device(device):
            return AutoModelForCausalLM.from_config(families.config("llama"))

    ia3 = get_peft_model(llama(), IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                            feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError, match="IA3Config: the engine trains LoRA adapters"):
        te.transform(ia3)
    with pytest.raises(ValueError, match="kernels='eager' with a PEFT model"):
        te.transform(get_peft_model(llama(), LoraConfig(r=2, target_modules=["q_proj"])), kernels="eager")
    dora = get_peft_model(llama(), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="use_dora=True"):
        te.transform(dora)
    meta = get_peft_model(llama("meta"), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights="gaussian"))
    with pytest.raises(ValueError, match="init_lora_weights='gaussian' and the model was built on the meta device"):
        te.transform(meta)


def test_a_meta_built_lora_model_starts_as_its_base_and_its_adapters_as_peft_inits_them(engine):
    """On the meta device: the base by its _init_weights, A kaiming-uniform (nn.Linear's default), B zero; so the
    output is the base model's, and the same seed gives the same adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import trainyard.engine as te

    from . import families

    def built(seed):
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(families.config("llama"))
        return te.transform(get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "down_proj"])), seed=seed)

    model, again = built(3), built(3)
    state = dict(model.named_parameters())
    a = state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    b = state["base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"]
    bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) on fan_in: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert a.abs().max() <= bound and a.std() > bound / 3 and torch.equal(b, torch.zeros_like(b))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    tokens = torch.randint(0, families.VOCAB, (2, 8))
    with torch.no_grad(), model.disable_adapter():
        plain = model(tokens).logits
    assert torch.equal(model(tokens).logits.detach(), plain)


def test_lora_targets_that_match_no_linear_layer_and_unsplittable_tp_layers_are_named():
    """peft passes over a target name that matches nothing (a typo trains fewer layers, silently); the engine names
    it, and the tied head and embeddings, which are no linear layer LoRA may wrap here. Under tensor parallelism every
    LoRA layer whose split does not carry over is named at once (Phi-3's packed projections)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainyard.engine.models.hf import adapters, spec as hf_spec

    from . import families

    tied = AutoModelForCausalLM.from_config(families.config("qwen2", tie=True))
    with pytest.raises(ValueError, match="lora_targets: qproj names no linear layer of Qwen2ForCausalLM; .*q_proj"):
        adapters.wrap(tied, r=2, alpha=4, targets="qproj,v_proj", dropout=0.0)
    with pytest.raises(ValueError, match="lm_head names no linear layer .*the head tied to the input embedding"):
        adapters.wrap(tied, r=2, alpha=4, targets="lm_head", dropout=0.0)
    with pytest.raises(ValueError, match="embed_tokens names no linear layer"):
        adapters.wrap(tied, r=2, alpha=4, targets="embed_tokens", dropout=0.0)
    phi3 = get_peft_model(AutoModelForCausalLM.from_config(families.config("phi3")),
                          LoraConfig(r=2, target_modules="all-linear"))
    plan = hf_spec.tp_plan(phi3.get_base_model())
    with pytest.raises(ValueError, match=r"splits the LoRA layers down_proj, gate_up_proj, o_proj, qkv_proj as "
                                         r"colwise_gather_output, rowwise_split_input; .*leave down_proj, "
                                         r"gate_up_proj, o_proj, qkv_proj out of the targets"):
        adapters.lora_plan(phi3, "base_model.model", plan)


def test_frozen_weights_stay_frozen_through_every_tensor_parallel_style(engine):
    """torch's SequenceParallel (the engine's replicated_with_grad_allreduce: Qwen3's q/k norms) makes its weights
    new Parameters that require grad: under LoRA a frozen norm trained (a user's check, 2 processes, TP=2)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from trainyard.engine.distributed.tp import STYLE_NAMES, apply_tp_plan

    linear = {"colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input"}
    model = nn.ModuleDict({s: nn.Linear(8, 8) if s in linear else nn.Embedding(8, 8) if s == "embedding_rowwise"
                           else nn.LayerNorm(8) for s in STYLE_NAMES})
    trained = {"colwise", "sequence_parallel"}  # one of each kind stays trainable: only the frozen are turned off
    for style, module in model.items():
        module.requires_grad_(style in trained)
    apply_tp_plan(model, init_device_mesh("cpu", (1,)), {s: s for s in STYLE_NAMES})
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {f"{s}.{w}" for s in trained for w in ("weight", "bias")}


@pytest.mark.parametrize("bias", ["lora_only", "all"])
def test_the_adapter_export_holds_the_biases_lora_trains(engine, tmp_path, bias):
    """With `bias` set, PEFT's adapter holds the biases it trains; the export used to keep the LoRA weights alone, and
    the folder loaded with other logits (a user's check)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    import trainyard.engine as te

    from . import families

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(families.config("qwen2", tie=False)).save_pretrained(tmp_path / "base")
    model = te.transform(get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], bias=bias)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, families.VOCAB, (4, 9))
    for _ in range(2):
        te.forward_backward(model, x[:, :-1], x[:, 1:], te.lm_loss, microbatches=1)
        opt.step()
        opt.zero_grad()
    te.save_model(model, str(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_the_merged_export_puts_a_trained_copy_of_modules_to_save_in_the_modules_place(engine, tmp_path):
    """modules_to_save=["lm_head"]: the merged folder held the copy under PEFT's names and no lm_head.weight, and
    from_pretrained made a new head with a warning (a user's check: logits 1.97 apart)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import trainyard.engine as te

    from . import families

    torch.manual_seed(0)
    model = te.transform(get_peft_model(AutoModelForCausalLM.from_config(families.config("mistral", tie=False)),
                                        LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, families.VOCAB, (4, 9))
    te.forward_backward(model, x[:, :-1], x[:, 1:], te.lm_loss, microbatches=1)
    opt.step()
    te.save_model(model, str(tmp_path / "merged"), merged=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("modules_to_save" in n or "original_module" in n for n, _ in loaded.named_parameters())
    with torch.no_grad():
        assert (loaded(x).logits - model(x).logits).abs().max() <= 1e-5


def test_a_pipeline_of_a_peft_model_that_wraps_its_head_is_refused_naming_the_head():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainyard.engine.models.registry import resolve_spec

    from . import families

    for config, how in ((LoraConfig(r=4, target_modules=["lm_head", "q_proj"]), "wraps its LM head in a LoRA layer"),
                        (LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
                         r"trains a whole copy of its LM head \(modules_to_save\)")):
        spec = resolve_spec(get_peft_model(AutoModelForCausalLM.from_config(families.config("llama", tie=False)),
                                           config))
        assert spec.stages is None
        assert re.search(f"the PEFT model {how}.*leave lm_head out of target_modules", spec.no_stages), spec.no_stages
    plain = get_peft_model(AutoModelForCausalLM.from_config(families.config("llama", tie=False)),
                           LoraConfig(r=4, target_modules=["q_proj"]))
    assert resolve_spec(plain).stages is not None


def test_a_checkpoint_of_other_adapters_is_refused_as_another_models_not_skipped_as_damaged(engine, tmp_path):
    """An r=4 checkpoint resumed into an r=8 model was called damaged and skipped, and the advice was to move it away
    (a user's trial): the step is whole, and the model is another."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import trainyard.engine as te
    from trainyard.engine.components import checkpoint as ckpt

    from . import families

    def lora(r):
        torch.manual_seed(0)
        model = te.transform(get_peft_model(AutoModelForCausalLM.from_config(families.config("llama", tie=False)),
                                            LoraConfig(r=r, target_modules=["q_proj"])))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    uri = str(tmp_path / "ckpt")
    te.save_checkpoint(*lora(4), 3, uri=uri, trainable_only=True, blocking=True)
    with pytest.raises(ValueError, match=r"holds base_model\.model\.model\.layers\.\d\.self_attn\.q_proj\.lora_\w\."
                                         r"default\.weight of shape \[\d+, \d+\] where this model's is \[\d+, \d+\] "
                                         r"\(7 more differ\): it was saved from another model or with other adapters"):
        te.load_checkpoint(*lora(8), uri=uri)
    assert ckpt.committed_steps(uri) == [3]


def test_a_checkpoint_that_trained_what_is_frozen_here_is_refused(engine, tmp_path):
    """Saved with bias="all", resumed with bias="none": the step's trained biases were loaded into the frozen base
    biases, and the run went on as the bias="all" one (a user's trial). Refused both ways, naming the parameters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import trainyard.engine as te

    from . import families

    def lora(bias):
        torch.manual_seed(0)
        model = te.transform(get_peft_model(AutoModelForCausalLM.from_config(families.config("qwen2", tie=False)),
                                            LoraConfig(r=4, target_modules=["q_proj"], bias=bias)))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    te.save_checkpoint(*lora("all"), 2, uri=str(tmp_path / "all"), trainable_only=True, blocking=True)
    with pytest.raises(ValueError, match=r"holds trained values of \S+bias, .* \(\d+ parameters frozen in this "
                                         r"model\): it was saved with other adapters or bias settings"):
        te.load_checkpoint(*lora("none"), uri=str(tmp_path / "all"))
    te.save_checkpoint(*lora("none"), 2, uri=str(tmp_path / "none"), trainable_only=True, blocking=True)
    with pytest.raises(ValueError, match=r"holds no \S+bias.* trainable parameters of this model"):
        te.load_checkpoint(*lora("all"), uri=str(tmp_path / "none"))
    assert te.load_checkpoint(*lora("all"), uri=str(tmp_path / "all")) == 2  # the same settings resume
