"""FP8 training (models/float8.py; mixed_precision "float8", the built-in trainer's dtype float8): refused on CPU,
on GPUs below compute capability 8.9 and without torchao, before any work on the model, naming the setting and
the fix; and, with the capability check answered as a Hopper GPU's, which Linear layers of the built-in Llama and
of a Hugging Face Llama become torchao's Float8Linear (no FP8 matmul runs: none does on CPU)."""
import sys

import pytest
import torch
from torch import nn

from trainyard.engine.models import float8

torchao = pytest.importorskip("torchao", reason="the fp8 extra: pip install 'trainyard[fp8]'")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


class Untouchable(nn.Module):
    """A model that fails the moment anything walks it: the refusals must come first."""

    def __getattribute__(self, name):
        if name in ("modules", "named_modules", "parameters", "named_parameters", "children", "named_children",
                    "buffers", "config", "_modules", "_parameters"):
            raise AssertionError(f"the model was touched ({name}) before float8 was refused")
        return super().__getattribute__(name)


def test_float8_is_refused_on_cpu_before_the_model_is_touched(engine):
    import trainyard.engine as te

    with pytest.raises(ValueError) as e:
        te.transform(Untouchable(), mixed_precision="float8")
    msg = str(e.value)
    assert msg.startswith("mixed_precision 'float8' needs an NVIDIA GPU with FP8 tensor cores (compute capability "
                          "8.9 or newer")
    assert "runs on cpu: set mixed_precision to 'bf16' (or 'fp16' on GPUs without bfloat16)" in msg


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.float64])
def test_a_torch_dtype_that_is_no_compute_dtype_is_refused_naming_float8(engine, dtype):
    import trainyard.engine as te

    with pytest.raises(ValueError, match=r"a compute dtype is torch.bfloat16, torch.float16 or torch.float32; for "
                                         r"FP8 training give 'float8'"):
        te.transform(Untouchable(), mixed_precision=dtype)


def test_float8_is_refused_below_sm89_and_without_torchao(engine, monkeypatch):
    import trainyard.engine as te

    monkeypatch.setattr(float8, "capability", lambda device: (8, 0))  # an A100
    with pytest.raises(ValueError, match=r"mixed_precision 'float8' needs FP8 tensor cores .* has compute "
                                         r"capability 8\.0: set mixed_precision to 'bf16'"):
        te.transform(Untouchable(), mixed_precision="float8")
    monkeypatch.setattr(float8, "capability", lambda device: (9, 0))  # an H100 without torchao
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"mixed_precision 'float8' needs torchao's float8 training: "
                                          r"pip install 'trainyard\[fp8\]'"):
        te.transform(Untouchable(), mixed_precision="float8")


def test_builtin_trainer_refuses_dtype_float8_before_building_the_model(engine, monkeypatch):
    from trainyard.engine import trainer as trainer_module
    from trainyard.engine.config import TrainConfig

    def no_model(*_):
        raise AssertionError("the model was built before float8 was refused")

    monkeypatch.setattr(trainer_module, "build_model", no_model)
    with pytest.raises(ValueError, match=r"^dtype 'float8' needs an NVIDIA GPU .* runs on cpu: set dtype to "
                                         r"'bfloat16' \(or 'float16' on GPUs without bfloat16\)"):
        trainer_module.Trainer(TrainConfig(model="tiny", dtype="float8"))


@pytest.fixture
def hopper(monkeypatch):
    """The capability check answers as an H100's (nothing runs in FP8 in these tests)."""
    monkeypatch.setattr(float8, "capability", lambda device: (9, 0))


def linear_kinds(model: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_builtin_llama_gets_float8_linears_everywhere_but_the_head(engine, hopper, capsys):
    import trainyard.engine as te
    from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model

    model = te.transform(build_model(MODEL_CONFIGS["tiny"]), mixed_precision="float8")
    kinds = linear_kinds(model)
    projections = [f"layers.{i}.{part}" for i in range(2) for part in
                   ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    assert {k: v for k, v in kinds.items() if v == "Float8Linear"} == dict.fromkeys(projections, "Float8Linear")
    assert kinds["output"] == "Linear"
    # bf16 compute elsewhere, fp32 master weights, sharded by MiCS (FSDP2) after the conversion
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert getattr(model, "_trainyard_layout").mics.param_dtype == torch.bfloat16
    assert not te.scaler(model).enabled
    out = capsys.readouterr().out
    assert "float8 (torchao, dynamic tensorwise scaling, bf16 all-gather): 14 Linear layer(s) in FP8; left in " \
           "bfloat16: output (the LM head)" in out


def test_hf_llama_keeps_its_head_and_unaligned_layers_in_bf16(engine, hopper, capsys):
    import trainyard.engine as te
    from transformers import LlamaConfig, LlamaForCausalLM

    # intermediate 72 is not a multiple of 16: the MLP's three projections stay bf16; attention (64 wide) converts
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = te.transform(model, mixed_precision="float8")
    kinds = linear_kinds(model)
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert kinds[f"model.layers.{i}.self_attn.{proj}"] == "Float8Linear"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert kinds[f"model.layers.{i}.mlp.{proj}"] == "Linear"
    assert kinds["lm_head"] == "Linear"
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 8
    out = capsys.readouterr().out
    assert "8 Linear layer(s) in FP8; left in bfloat16: lm_head (the LM head); model.layers.0.mlp.gate_proj, " \
           "model.layers.0.mlp.up_proj, model.layers.0.mlp.down_proj and 3 more (widths not multiples of 16)" in out


def test_alignment_accounts_for_the_tensor_parallel_split(hopper):
    """Under tensor parallelism each rank multiplies 1/tp of a width: 48 is a multiple of 16 but 48/2 is not."""
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 48), nn.Linear(48, 32), nn.Linear(32, 64),
                          nn.Linear(64, 100))
    report = float8.convert(model, tp=2)
    assert report == {"float8": ["3"], "head": ["4"], "unaligned": ["1", "2"]}
    assert isinstance(model[3], Float8Linear) and type(model[1]) is nn.Linear and type(model[4]) is nn.Linear
