"""Activation checkpointing changes memory, never results."""
import pytest
import torch
import torch.nn.functional as F

from trainyard.engine.distributed.ac import apply_ac
from trainyard.engine.models.llama.model import ModelConfig, build_model, init_weights

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)


def _grads(mode):
    model = build_model(CFG)
    init_weights(model, 1, device="cpu")
    apply_ac(list(model.layers.values()), mode)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_same_gradients_and_names(mode):
    plain, ac = _grads("none"), _grads(mode)
    assert plain.keys() == ac.keys()
    for name in plain:
        torch.testing.assert_close(ac[name], plain[name], rtol=0, atol=1e-6)


def test_recompute_happens_where_asked():
    model = build_model(CFG)
    init_weights(model, 1, device="cpu")
    calls = [0] * CFG.n_layers
    for i, block in enumerate(model.layers.values()):
        inner = block.forward

        def counted(*args, i=i, inner=inner, **kwargs):
            calls[i] += 1
            return inner(*args, **kwargs)

        block.forward = counted
    apply_ac(list(model.layers.values()), "selective")
    model(torch.randint(0, 64, (1, 9))).sum().backward()
    assert calls == [2, 1, 2, 1]  # blocks 0 and 2 ran their forward again in backward
    with pytest.raises(ValueError, match="activation_checkpointing"):
        apply_ac(list(model.layers.values()), "some")
