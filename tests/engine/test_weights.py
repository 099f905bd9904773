"""Weights I/O (trainyard/engine/models/hf/weights.py): HF safetensors layout that `from_pretrained` loads, and
piecewise loads into plain and sharded (FSDP2, TP, FSDP2 x TP) models, from local paths and S3."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from trainyard.engine.models.hf.weights import (INDEX_FILE, SINGLE_FILE, WeightNamesError, load_pretrained_into,
                                                write_pretrained)

from .launch import HF, run_on_two_hosts

WORKER = os.path.join(os.path.dirname(__file__), "weights_worker.py")
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
TOKENS = torch.arange(24).reshape(2, 12) * 5 % 128


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def llama(seed: int, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**CONFIG, **overrides})).eval()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def save(model: LlamaForCausalLM, out: str, **kwargs) -> list[str]:
    tied = model._tied_weights_keys if model.config.tie_word_embeddings else None
    return write_pretrained(model.state_dict(), out, config=model.config, tied=tied, **kwargs)


@pytest.mark.parametrize("layout", ["single", "sharded", "tied"])
def test_hf_from_pretrained_and_load_pretrained_into_reproduce_the_logits(tmp_path, layout):
    model = llama(0, tie_word_embeddings=layout == "tied")
    out = str(tmp_path / "model")
    files = save(model, out, max_shard_size=40_000 if layout == "sharded" else 5 * 2**30)
    names = [f.rsplit("/", 1)[-1] for f in files]
    assert names[-1] == "config.json"
    if layout == "sharded":  # 40 kB per file: several files, then the index, then the config
        shards = len(names) - 2
        assert shards > 1 and names[-2] == INDEX_FILE and names[0] == f"model-00001-of-{shards:05d}.safetensors"
        index = json.loads((tmp_path / "model" / INDEX_FILE).read_text())
        assert set(index["weight_map"]) == set(model.state_dict())
        assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.state_dict().values())
    else:
        assert names == [SINGLE_FILE, "config.json"]
        with safe_open(str(tmp_path / "model" / SINGLE_FILE), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert ("lm_head.weight" in f.keys()) == (layout != "tied")
    expected = logits(model)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(hf), expected)
    fresh = llama(1, tie_word_embeddings=layout == "tied")
    report = load_pretrained_into(fresh, out)
    assert torch.equal(logits(fresh), expected)
    assert report["tensors"] == len(dict(model.named_parameters()))  # the tied lm_head counts once
    assert report["files"] == [n for n in names if n.endswith(".safetensors")]


def test_missing_and_unexpected_names_are_refused_before_anything_is_copied(tmp_path):
    state = llama(0).state_dict()
    fresh = llama(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    write_pretrained({k: v for k, v in state.items() if k != "model.norm.weight"}, str(tmp_path / "a"))
    with pytest.raises(KeyError, match=r"1 missing .*\['model\.norm\.weight'\]; 0 unexpected"):
        load_pretrained_into(fresh, str(tmp_path / "a"))
    write_pretrained({**state, "extra.bias": torch.zeros(3)}, str(tmp_path / "b"))
    with pytest.raises(WeightNamesError, match=r"0 missing .* 1 unexpected .*\['extra\.bias'\]"):
        load_pretrained_into(fresh, str(tmp_path / "b"))
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    with pytest.warns(UserWarning, match="extra.bias"):
        report = load_pretrained_into(fresh, str(tmp_path / "b"), strict=False)
    assert report["unexpected"] == ["extra.bias"] and torch.equal(logits(fresh), logits(llama(0)))


def test_a_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path):
    state = llama(0).state_dict()
    write_pretrained({**state, "model.norm.weight": torch.ones(65)}, str(tmp_path))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight': file \(65,\), model \(64,\)"):
        load_pretrained_into(llama(1), str(tmp_path))


class Plain(nn.Module):
    """A non-HF module: bf16 (most bytes) and fp32 tensors, a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16).to(torch.bfloat16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("scale", torch.randn(16))
        self.register_buffer("cache", torch.randn(4), persistent=False)


def test_a_plain_module_gets_model_safetensors_and_a_summary(tmp_path):
    torch.manual_seed(0)
    model = Plain()
    files = write_pretrained(model.state_dict(), str(tmp_path))
    assert [f.rsplit("/", 1)[-1] for f in files] == [SINGLE_FILE, "trainyard_model.json"]
    assert json.loads((tmp_path / "trainyard_model.json").read_text()) == {
        "format": "trainyard", "version": 1, "tensors": 5, "parameters": 8 * 16 + 16 + 16 + 16 + 16,
        "dtype": "bfloat16", "total_size": (8 * 16 + 16) * 2 + 16 * 4 * 3, "files": [SINGLE_FILE]}
    written = load_file(str(tmp_path / SINGLE_FILE))
    assert "cache" not in written and written["proj.weight"].dtype == torch.bfloat16
    torch.manual_seed(1)
    fresh = Plain()
    load_pretrained_into(fresh, str(tmp_path))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_new_save_removes_the_weight_files_of_an_older_layout(tmp_path):
    out = str(tmp_path)
    save(llama(0), out, max_shard_size=40_000)
    (tmp_path / "notes.txt").write_text("kept")
    save(llama(2), out)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "notes.txt"]
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(llama(2)))


def test_write_refuses_bad_tied_declarations_and_paths(tmp_path):
    state = llama(0).state_dict()  # untied: lm_head differs from the embedding
    with pytest.raises(ValueError, match=r"tied\['lm_head\.weight'\] .* differ"):
        write_pretrained(state, str(tmp_path), tied={"lm_head.weight": "model.embed_tokens.weight"})
    with pytest.raises(ValueError, match="must be a non-empty str"):
        write_pretrained(state, tmp_path)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_pretrained_into(llama(1), str(tmp_path))


def test_s3_write_and_load(s3_bucket):
    model = llama(0)
    uri = f"s3://{s3_bucket}/model"
    files = save(model, uri, max_shard_size=100_000)
    assert files[0] == f"{uri}/model-00001-of-00004.safetensors" and files[-1] == f"{uri}/config.json"
    fresh = llama(1)
    report = load_pretrained_into(fresh, uri)
    assert torch.equal(logits(fresh), logits(model))
    data = sum(t.numel() * 4 for t in model.state_dict().values())
    assert data < report["bytes_read"] < data + 4 * 4096  # every byte once, plus four small headers


MIXTRAL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_models_read_only_their_rows(tmp_path, s3_bucket):
    """4 ranks: FSDP2 (dp 2) over TP (tp 2), which gives _StridedShard(0) on the colwise weights, from a
    local directory; FSDP2 over 4 with tied embeddings from S3. Uneven sizes: vocab 130, 134 = 2 x 67 MLP rows.
    And a Mixtral folder with its experts one by one into packed experts sharded one expert per rank."""
    config = {**CONFIG, "vocab_size": 130, "intermediate_size": 134}
    local, s3 = str(tmp_path / "w"), f"s3://{s3_bucket}/w"
    save(llama(0, **config), local, max_shard_size=50_000)
    save(llama(0, **config, tie_word_embeddings=True), s3)
    # a Mixtral folder as transformers writes it (experts one by one): FSDP2 over 4 gives each rank one expert
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(**MIXTRAL)).save_pretrained(tmp_path / "mixtral")
    cases = [dict(name="fsdp2xtp2", source=local, layout="fsdp2xtp2", config=config),
             dict(name="fsdp4", source=s3, layout="fsdp4", config={**config, "tie_word_embeddings": True}),
             dict(name="mixtral", source=str(tmp_path / "mixtral"), layout="fsdp4", config=MIXTRAL, mixtral=True)]
    results = run_on_two_hosts(WORKER, cases, tmp_path, processes_per_host=2, preload=HF)
    experts = results.pop("mixtral")
    assert experts["max_diff"] == 0.0, experts
    size = os.path.getsize(tmp_path / "mixtral" / "model.safetensors")
    assert all(b < 0.3 * size for b in experts["bytes_read"]), (experts["bytes_read"], size)
    total = {"fsdp2xtp2": sum(t.numel() * 4 for t in llama(0, **config).state_dict().values()),
             "fsdp4": sum(t.numel() * 4 for t in llama(0, **config, tie_word_embeddings=True).parameters())}
    for name, got in results.items():
        assert got["max_diff"] == 0.0, (name, got)
        # fsdp4: a quarter of every tensor; fsdp2xtp2: a quarter of the colwise weights, half of the rest
        # (rowwise weights are fetched as whole rows of this rank's dp half, then cut by column)
        bound = 0.3 if name == "fsdp4" else 0.45
        assert all(b < bound * total[name] for b in got["bytes_read"]), (name, got["bytes_read"], total[name])
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in results["fsdp2xtp2"]["placements"]
    assert "(Shard(dim=0), Shard(dim=1))" in results["fsdp2xtp2"]["placements"]
