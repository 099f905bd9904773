"""Model FLOPs per token, peak FLOPs and the hardware fingerprint (fast; MFU of a real run: test_train.py)."""
import pytest
import torch

from trainyard.engine.components import flops
from trainyard.engine.components.fingerprint import differences, fingerprint
from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model


def test_builtin_model_flops_by_hand():
    c = MODEL_CONFIGS["10m"]
    with torch.device("meta"):
        shape = flops.shape_of(build_model(c))
    head = c.dim // c.n_heads
    per_layer = 2 * c.dim * c.dim + 2 * c.dim * c.n_kv_heads * head + 3 * c.dim * c.ffn_hidden + 2 * c.dim
    n = c.n_layers * per_layer + c.dim + c.vocab_size * c.dim  # the head counts, the embedding table does not
    assert shape == flops.Shape(c.n_layers, c.n_heads, head, n)
    assert shape.flops_per_token(128) == 6 * n + 12 * c.n_layers * c.n_heads * head * 128


@pytest.mark.parametrize("tied", [False, True])
def test_hf_model_flops_count_a_tied_embedding_once(tied):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    shape = flops.shape_of(model)
    assert (shape.layers, shape.heads, shape.head_dim) == (2, 4, 16)
    # untied: the embedding table is a lookup and is left out; tied: that table is the head's weight
    assert shape.matmul_params == (total if tied else total - 1000 * 64)


def _expert_params(model, names: tuple[str, ...]) -> tuple[int, int]:
    """(every routed expert's parameters, one expert's), counted from the model's own tensors (experts first)."""
    packed = [p for n, p in model.named_parameters() if ".experts." in n and n.rsplit(".", 1)[-1] in names]
    return sum(p.numel() for p in packed), sum(p[0].numel() for p in packed[:len(names)])


def test_a_mixture_of_experts_counts_only_the_experts_a_token_goes_through():
    """6 N with N the active parameters: a token multiplies by its top_k routed experts, not by all of them (the
    trainer's MFU once counted every expert)."""
    c = MODEL_CONFIGS["moe-tiny"]
    with torch.device("meta"):
        model = build_model(c)
    total = sum(p.numel() for p in model.parameters())
    experts, one = _expert_params(model, ("w1", "w2", "w3"))
    assert experts == c.n_layers * c.n_experts * one
    idle = c.n_layers * (c.n_experts - c.top_k) * one
    assert flops.shape_of(model).matmul_params == total - c.vocab_size * c.dim - idle
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in hf.parameters())
    experts, one = _expert_params(hf, ("gate_up_proj", "down_proj"))
    assert experts == 2 * 8 * one == 2 * 8 * 3 * 64 * 32
    assert flops.shape_of(hf).matmul_params == total - 1000 * 64 - 2 * (8 - 2) * one
    # blocks partly dense (every second one sparse), and a shared expert beside the routed ones: only the sparse
    # blocks' routed experts are left out
    config = transformers.Qwen2MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                                         num_experts_per_tok=1, decoder_sparse_step=2, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in hf.parameters())
    experts, one = _expert_params(hf, ("gate_up_proj", "down_proj"))
    assert experts == 2 * 4 * one == 2 * 4 * 3 * 64 * 32  # 2 sparse blocks of the 4
    assert flops.shape_of(hf).matmul_params == total - 1000 * 64 - 2 * (4 - 1) * one


def test_unknown_model_has_no_shape_and_cpu_peak_is_measured():
    assert flops.shape_of(torch.nn.Linear(4, 4)) is None
    tflops, source = flops.peak(torch.device("cpu"), torch.float32)
    assert 0 < tflops < 100 and source.startswith("measured at start-up: 1024^3 float32 matmul on cpu")
    assert flops.table_peak(torch.device("cpu"), torch.bfloat16) is None


def test_fingerprint_and_its_differences():
    a = fingerprint(torch.device("cpu"), world_size=4, processes_per_host=2)
    assert a["device"] == "cpu" and a["hosts"] == 2 and a["device_count"] == 2 and a["torch"] == torch.__version__
    assert a["power_limit_w"] is None and a["cpu_cores"] >= 1
    assert differences(a, dict(a)) == []
    b = {**a, "device": "NVIDIA H100 80GB HBM3", "world_size": 8}
    assert differences(a, b) == ["device: 'cpu' != 'NVIDIA H100 80GB HBM3'"]  # the world size is not the hardware


def test_bench_compare_flags_differing_machines(tmp_path):
    import json
    import subprocess
    import sys

    here = fingerprint(torch.device("cpu"), world_size=1, processes_per_host=1)
    paths = []
    for i, fp in enumerate([here, here, {**here, "cpu_cores": here["cpu_cores"] + 1}]):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps({"rows": [], "fingerprint": fp}))
    root = __file__.rsplit("/tests/", 1)[0]
    compare = f"{root}/bench/compare.py"
    same = subprocess.run([sys.executable, compare, paths[0], paths[1]], capture_output=True, text=True)
    assert same.returncode == 0 and "comparable" in same.stdout
    other = subprocess.run([sys.executable, compare, paths[0], paths[2]], capture_output=True, text=True)
    assert other.returncode == 1 and f"cpu_cores: {here['cpu_cores']} != {here['cpu_cores'] + 1}" in other.stdout
