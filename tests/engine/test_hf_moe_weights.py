"""Mixture-of-experts folders as published checkpoints (and transformers' own `save_pretrained`) store them: every
expert's matrices one by one (`experts.3.w1.weight`), Mixtral's MoE block under `block_sparse_moe`. The engine's
model holds them packed (`experts.gate_up_proj`, `experts.down_proj`); `load_pretrained_into` reads the one into
the other by transformers' own conversion rules, each rank only its experts' bytes. Checked against the model
transformers writes, on Mixtral, Qwen3-MoE, Qwen2-MoE (with a shared expert) and OLMoE; and refusals by name."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import (MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from trainyard.engine.models.hf import weights
from trainyard.engine.models.hf.weights import WeightNamesError, load_pretrained_into

SMALL = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
FAMILIES = {
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(intermediate_size=24, num_local_experts=4,
                                                        num_experts_per_tok=2)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(moe_intermediate_size=12, num_experts=4,
                                                            num_experts_per_tok=2, head_dim=8)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(moe_intermediate_size=12, num_experts=4,
                                                            num_experts_per_tok=2,
                                                            shared_expert_intermediate_size=20)),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(intermediate_size=12, num_experts=4, num_experts_per_tok=2)),
}


def _model(family: str, seed: int):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**SMALL, **extra)).eval()


def _saved(family: str, tmp_path) -> tuple[torch.nn.Module, str]:
    model = _model(family, 0)
    model.save_pretrained(tmp_path / family)
    return model, str(tmp_path / family)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_stored_one_by_one_load_into_the_packed_model_exactly(family, tmp_path):
    source, folder = _saved(family, tmp_path)
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        names = list(f.keys())
    assert any(".experts.0." in n for n in names) and not any(n.endswith("gate_up_proj") for n in names)
    model = _model(family, 1)
    report = load_pretrained_into(model, folder, model_type=model.config.model_type)
    want = source.state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys() and report["missing"] == report["unexpected"] == []
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert "model.layers.1.mlp.experts.gate_up_proj" in got  # the packed tensors were among those read
    tokens = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, source(tokens).logits)


def test_a_rank_reads_only_the_bytes_of_its_experts(tmp_path, monkeypatch):
    """A rank holding experts 1 and 2 of 4 (as expert parallelism or FSDP's Shard(0) gives it) fetches their
    matrices alone, and gets exactly those rows."""
    source, folder = _saved("mixtral", tmp_path)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    full = source.state_dict()[name]
    fs, root = weights.filesystem(folder)
    entries, _ = weights._read_headers(fs, [f"{root}/model.safetensors"])
    entry = weights._convert(entries, {name: full}, "mixtral")[0][name]
    assert entry.shape == tuple(full.shape) and len(entry.parts) == 4
    target = torch.zeros(2, *full.shape[1:])
    real = weights.local_indices
    monkeypatch.setattr(weights, "local_indices",
                        lambda t, dim: torch.tensor([1, 2]) if t is target and dim == 0 else real(t, dim))
    fetched = weights._fetch_and_copy(fs, [weights._plan_read(name, target, entry)])
    assert torch.equal(target, full[1:3])
    assert fetched == 4 * full[0, :24].numel() * full.element_size()  # w1 and w3 (24 x 16 each) of 2 experts


def test_a_missing_expert_or_no_model_type_is_refused_by_name(tmp_path):
    source, folder = _saved("qwen3_moe", tmp_path)
    model = _model("qwen3_moe", 1)
    with pytest.raises(WeightNamesError, match=r"missing .*model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        load_pretrained_into(model, folder)  # no model_type: the files' names as they are
    from safetensors.torch import save_file
    tensors = _file_tensors(folder)
    for drop, said in ((".experts.3.up_proj", r"gate_up_proj: the files hold experts \[0, 1, 2\] for its part 2 of 2; "
                                              r"the model has 4 \(0-3\)"),
                       (".experts.3.down_proj", r"down_proj: the files hold experts \[0, 1, 2\] for its part 1 of 1")):
        save_file({k: v for k, v in tensors.items() if drop not in k}, f"{folder}/model.safetensors",
                  metadata={"format": "pt"})
        with pytest.raises(WeightNamesError, match=r"unexpected .*experts\.\d\.(gate|down)_proj\.weight.*" + said):
            load_pretrained_into(model, folder, model_type="qwen3_moe")
    odd = {k: (v.to(torch.bfloat16) if ".experts.1.gate_proj" in k else v) for k, v in tensors.items()}
    save_file(odd, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightNamesError, match=r"expert 1's part 1 is \(12, 16\) torch.bfloat16, expert 0's "
                                               r"\(12, 16\) torch.float32"):
        load_pretrained_into(model, folder, model_type="qwen3_moe")


def test_experts_both_packed_and_one_by_one_are_refused_not_picked(tmp_path):
    """Two copies of the same weights that may differ: which one is meant is not for the loader to guess."""
    from safetensors.torch import save_file

    source, folder = _saved("olmoe", tmp_path)
    packed = {"model.layers.0.mlp.experts.down_proj": source.state_dict()["model.layers.0.mlp.experts.down_proj"]}
    save_file({**_file_tensors(folder), **packed}, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightNamesError, match=r"model\.layers\.0\.mlp\.experts\.down_proj: the files hold it packed "
                                               r"as well"):
        load_pretrained_into(_model("olmoe", 1), folder, model_type="olmoe")


def test_a_pipeline_stage_leaves_the_other_stage_s_experts_to_it(tmp_path):
    """Under pipeline parallelism a stage holds some layers; the other stage's experts (and Mixtral's renamed
    router) are converted like its own and are not unexpected."""
    source, folder = _saved("mixtral", tmp_path)
    model = _model("mixtral", 1)
    mine = {n: t for n, t in weights.model_tensors(model).items() if ".layers.1." not in n}
    others = frozenset(n for n in weights.model_tensors(model) if ".layers.1." in n)
    report = load_pretrained_into(model, folder, model_type="mixtral", targets=mine, elsewhere=others)
    assert report["missing"] == report["unexpected"] == []
    want = source.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in mine.items())


def test_lora_on_the_packed_experts_is_refused_by_name(engine):
    peft = pytest.importorskip("peft")
    import trainyard.engine as te

    model = peft.get_peft_model(_model("mixtral", 0), peft.LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match=r"LoRA on model\.layers\.0\.mlp\.\w+ \(peft's ParamWrapper.*name the "
                                         r"linear layers to adapt instead of all-linear"):
        te.transform(model)


def _file_tensors(folder: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}
