"""kernels=auto under torch.compile: the per-op decision from measured times (trainyard/kernels/auto.py), the
shapes it measures at, and what transform does with it. The measurement itself needs a GPU (CUDA events,
inductor on CUDA): bench/kernels_tune.py runs it there; here it is replaced by given times."""
import pytest
import torch

from trainyard.engine.models import fused
from trainyard.kernels import auto


def test_decide_keeps_ours_only_where_it_is_faster_by_the_margin():
    got = auto.decide({"rms_norm": (1.05, 0.68), "swiglu": (0.80, 0.90), "rope": (0.86, 0.88)}, margin=0.05)
    assert {op: c.backend for op, c in got.items()} == {"rms_norm": "eager", "swiglu": "triton", "rope": "eager"}
    assert (got["swiglu"].ours_ms, got["swiglu"].compile_ms) == (0.80, 0.90)
    # 0.86 is 2% under 0.88: a tie within the margin goes to inductor; with no margin ours wins
    assert auto.decide({"rope": (0.86, 0.88)}, margin=0.0)["rope"].backend == "triton"
    assert str(got["rms_norm"]) == "rms_norm inductor (ours 1.050 ms, compile 0.680 ms)"
    assert str(got["swiglu"]) == "swiglu ours (ours 0.800 ms, compile 0.900 ms)"


def test_decide_when_a_measurement_failed():
    got = auto.decide({"rms_norm": (None, 0.7), "swiglu": (0.9, None), "rope": (None, None)})
    assert [got[op].backend for op in ("rms_norm", "swiglu", "rope")] == ["eager", "triton", "eager"]
    assert got["rms_norm"].why == "ours failed" and got["swiglu"].why == "compile failed"
    assert "failed" in str(got["swiglu"])


def test_the_builtin_and_hf_models_shapes():
    from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model

    cfg = MODEL_CONFIGS["tiny"]
    got = fused.op_shapes(build_model(cfg))
    assert got == auto.OpShapes(cfg.dim, cfg.ffn_hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, "pairs")
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=50))
    assert fused.op_shapes(hf) == auto.OpShapes(64, 96, 4, 2, 16, "hf")


def test_plan_measures_only_auto_under_compile_on_cuda(monkeypatch):
    from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model

    model = build_model(MODEL_CONFIGS["tiny"])
    asked = []

    def measure(shapes, device, dtype, **kw):
        asked.append((shapes, device.type, dtype))
        return {"rms_norm": (1.05, 0.68), "swiglu": (0.70, 0.90), "rope": (1.49, 0.83)}, {}

    monkeypatch.setattr(auto, "measure", measure)
    choices, _ = fused.plan_backends(model, "auto", compile=True, device=torch.device("cuda"), dtype=torch.bfloat16)
    assert asked and asked[0][1:] == ("cuda", torch.bfloat16) and asked[0][0].rope_layout == "pairs"
    assert {op: c.backend for op, c in choices.items()} == \
        {"rms_norm": "eager", "swiglu": "triton", "rope": "eager", "loss": "triton"}
    line = fused.describe_choices("auto", choices, {})
    assert line.startswith("; under compile: rms_norm inductor (ours 1.050 ms, compile 0.680 ms), swiglu ours")
    asked.clear()
    for kw in ({"compile": False, "device": torch.device("cuda")}, {"compile": True, "device": torch.device("cpu")}):
        choices, _ = fused.plan_backends(model, "auto", dtype=None, **kw)
        assert not asked and all(c.ours_ms is None for c in choices.values())
    choices, _ = fused.plan_backends(model, "triton", compile=True, device=torch.device("cuda"), dtype=None)
    assert not asked and {c.backend for c in choices.values()} == {"triton"}


def test_unmeasured_auto_resolves_as_dispatch_does(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    choices, _ = fused.plan_backends(torch.nn.Linear(2, 2), "auto", compile=True, device=torch.device("cpu"),
                                     dtype=None)
    assert {c.backend for c in choices.values()} == {"eager"}  # CPU without the interpreter: the references
    assert fused.describe_choices("auto", choices, {}) == "; auto: eager (not measured off CUDA)"
    assert auto.as_record(choices)["rms_norm"] == {"backend": "eager", "ours_ms": None, "compile_ms": None,
                                                   "why": "not measured off CUDA"}


@pytest.mark.usefixtures("interpret")
def test_swap_takes_a_backend_per_op(monkeypatch):
    """The decision reaches the model: ops left to inductor run their eager reference, the others the op."""
    from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model
    from trainyard.kernels import rmsnorm
    import importlib

    swiglu_module = importlib.import_module("trainyard.kernels.swiglu")
    ran = []
    for module, name in ((rmsnorm, "_forward_triton"), (swiglu_module, "_forward_triton")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _m=module.__name__: ran.append(_m) or _o(*a))
    model = build_model(MODEL_CONFIGS["tiny"]).to_empty(device="cpu")  # built on meta; values do not matter here
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    fused.swap_kernels(model, "auto", fused_loss=True, backends={"rms_norm": "eager", "swiglu": "triton",
                                                                 "rope": "eager", "loss": "eager"})
    model(torch.zeros(1, 4, dtype=torch.long))
    assert set(ran) == {"trainyard.kernels.swiglu"}
