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
