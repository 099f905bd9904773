"""`transform(model, kernels=...)` (trainyard/engine/models/fused.py): the built-in model and an HF Llama train
the same with the ops swapped in as without them, one process, fp32 (tolerance: 1e-4 relative on each of
3 steps' losses: the ops round differently from the modules in float32 (1e-7 on the first loss), and two
AdamW steps carry that into the weights; the Triton path runs under TRITON_INTERPRET=1)."""
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trainyard.engine as te
from trainyard.engine.models.fused import LMHidden, backend_of
from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model

from .launch import HF, run_on_two_hosts

STEPS = 3
REL = 1e-4
WORKER = os.path.join(os.path.dirname(__file__), "api_worker.py")


def _hf():
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _batches(vocab: int) -> list[torch.Tensor]:
    """The same two sequences every step: the loss falls, so equal losses mean equal training."""
    rows = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    return [rows] * STEPS


def _losses(build, kernels, vocab: int) -> tuple[list[float], torch.nn.Module]:
    with torch.device("meta"):
        model = build()
    model = te.transform(model, kernels=kernels, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for rows in _batches(vocab):
        loss = te.lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("kernels", ["eager", "triton"])
def test_the_builtin_model_trains_the_same_with_kernels(engine, kernels, capsys):
    cfg = MODEL_CONFIGS["tiny"]
    want, _ = _losses(lambda: build_model(cfg), None, cfg.vocab_size)
    got, model = _losses(lambda: build_model(cfg), kernels, cfg.vocab_size)
    assert got == pytest.approx(want, rel=REL)
    assert want[-1] < want[0]  # it learns: the comparison is not between two constants
    out = capsys.readouterr().out
    n = cfg.n_layers
    assert f"kernels ({kernels}): rms_norm {2 * n + 1}, swiglu {n}, rope {n}, loss 1" in out
    assert isinstance(model(torch.zeros(1, 4, dtype=torch.long)), LMHidden)


def test_an_hf_llama_trains_the_same_with_kernels(engine, capsys, monkeypatch):
    from transformers.models.llama import modeling_llama

    # the swap replaces the family's rotary function process-wide: the test puts it back afterwards
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    want, _ = _losses(_hf, None, 96)
    got, model = _losses(_hf, "eager", 96)
    assert got == pytest.approx(want, rel=REL)
    assert "kernels (eager): rms_norm 5, swiglu 2, rope 2, loss 1" in capsys.readouterr().out
    out = model(torch.zeros(1, 4, dtype=torch.long))
    assert isinstance(out, LMHidden) and out.logits.shape == (1, 4, 96)  # logits on demand


@pytest.mark.parametrize("kernels", ["eager", "triton"])
def test_gemma2_trains_the_same_with_kernels(engine, kernels, capsys, monkeypatch):
    """Gemma's norms are x * (1 + w) with w starting at 0, its MLP is GELU-gated and Gemma 2 soft-caps its final
    logits: the norms were once swapped for x * w (every output 0, the loss stuck at ln V) and the cap dropped.
    Now the norms take the offset form, the MLP is left alone and named, the fused loss caps."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma2 import modeling_gemma2

    from .families import config

    monkeypatch.setattr(modeling_gemma2, "apply_rotary_pos_emb", modeling_gemma2.apply_rotary_pos_emb)
    build = lambda: AutoModelForCausalLM.from_config(config("gemma2"))  # noqa: E731  (soft-cap 2.0: it matters)
    want, _ = _losses(build, None, 128)
    got, model = _losses(build, kernels, 128)
    assert got == pytest.approx(want, rel=REL)
    assert want[-1] < want[0]
    out = capsys.readouterr().out
    assert f"kernels ({kernels}): rms_norm 17, swiglu 0, rope 4, loss 1; left alone (their maths is not the ops'): " \
           "Gemma2MLP x4" in out
    hidden = model(torch.zeros(1, 4, dtype=torch.long))
    assert isinstance(hidden, LMHidden) and hidden.softcap == 2.0


def test_modules_whose_maths_differs_are_left_alone_and_named(engine, capsys):
    """A norm by its class name that is not x * w nor x * (1 + w), and a gate/up/down MLP with another
    activation: the probes compare each with the op on a small random input and keep the module's own."""
    from torch import nn

    class ScaledRMSNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(n)), 1e-6

        def forward(self, x):  # an RMSNorm times 2 (w * 2): the op would be off by a factor
            return 2 * self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    class ReluMLP(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(n, 2 * n), nn.Linear(n, 2 * n), nn.Linear(2 * n, n)

        def forward(self, x):
            return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))

    class FlagRMSNorm(nn.Module):  # one class, instances that differ: Gemma's form or Llama's, and their eps
        def __init__(self, n, gemma, eps):
            super().__init__()
            self.weight, self.gemma, self.eps = nn.Parameter(torch.rand(n)), gemma, eps

        def forward(self, x):
            w = 1 + self.weight if self.gemma else self.weight
            return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    class SwitchMLP(ReluMLP):  # SiLU in one instance, GELU in another
        def __init__(self, n, act):
            super().__init__(n)
            self.act_fn = act

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    model = nn.Sequential(ScaledRMSNorm(8), ReluMLP(8), nn.LayerNorm(8, bias=False), FlagRMSNorm(8, False, 1e-6),
                          FlagRMSNorm(8, True, 1.0), SwitchMLP(8, nn.SiLU()), SwitchMLP(8, nn.GELU()))
    x = torch.randn(2, 3, 8)
    want = model(x)
    model = te.transform(model, kernels="eager")
    torch.testing.assert_close(model(x), want, rtol=1e-6, atol=1e-6)
    assert "rms_norm 2, swiglu 1, rope 0, loss 0; left alone (their maths is not the ops'): ScaledRMSNorm, ReluMLP, " \
           "LayerNorm, SwitchMLP" in capsys.readouterr().out


def test_kernel_modes_are_checked():
    assert [backend_of(k) for k in (None, "off", "eager", "eager-chunked", "triton", True)] == \
        [None, None, "eager", "eager", "triton", "auto"]
    from trainyard.engine.config import KERNEL_MODES

    assert all(backend_of(mode) in (None, "eager", "triton", "auto") for mode in KERNEL_MODES)  # the hyperparameter's
    with pytest.raises(ValueError, match="kernels='fast': use one of off, eager"):
        backend_of("fast")


@pytest.mark.slow
def test_sharded_layouts_with_kernels_match_the_single_process_oracle(tmp_path):
    """2 hosts x 2 processes, the ops' eager references swapped in, against one unsharded process without them
    (tests/engine/api_worker.py): under MiCS the fused loss reads the head's gathered weight; under TP the
    sequence-parallel norms see local tensors and give their weight gradients back as partial sums."""
    cases = [
        {"name": "llama mics p4 fused loss", "model": "llama", "distribution": {"mics": {"partition_group_size": 4}}},
        {"name": "hf mics p2 fused loss", "model": "hf", "distribution": {"mics": {"partition_group_size": 2}}},
        {"name": "llama tp2 x mics", "model": "llama",
         "distribution": {"tensor_parallel_degree": 2, "mics": {"partition_group_size": 2}}},
    ]
    results = run_on_two_hosts(WORKER, [{**c, "kind": "oracle", "microbatches": 2, "kernels": "eager"}
                                        for c in cases], tmp_path, preload=HF)
    for case in cases:  # the same bound as without kernels (test_api.py): the ops change rounding only
        assert results[case["name"]]["worst_rel_err"] < 1e-5, (case["name"], results[case["name"]])
