"""The decoder: configs, shapes, grouped-query attention, layout-independent init."""
import pytest
import torch
import torch.nn.functional as F

from trainyard.engine.models.llama.model import (MODEL_CONFIGS, ModelConfig, Transformer, apply_rope, build_model,
                                    count_parameters, init_weights, param_seed)


def _tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=32)
    return ModelConfig(**(base | overrides))


def test_registry_sizes():
    assert 8e6 <= count_parameters(build_model(MODEL_CONFIGS["10m"])) <= 12e6
    assert 0.3e6 <= count_parameters(build_model(MODEL_CONFIGS["tiny"])) <= 0.7e6


def test_built_on_meta_with_blocks_in_layers():
    model = build_model(MODEL_CONFIGS["tiny"])
    assert all(p.is_meta for p in model.parameters())
    assert list(model.layers.keys()) == ["0", "1"]
    # the rope tables are derived, not state
    assert not any("rope" in k for k in model.state_dict())


@pytest.mark.parametrize("field,value", [("n_kv_heads", 3), ("dim", 30), ("vocab_size", 0), ("norm_eps", 0.0)])
def test_config_checks_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        _tiny(**{field: value})


def test_forward_shape_and_causality():
    cfg = _tiny()
    model = build_model(cfg)
    init_weights(model, seed=0, device="cpu")
    tokens = torch.randint(0, cfg.vocab_size, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, cfg.vocab_size)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % cfg.vocab_size
    # positions before the change see the same prefix
    torch.testing.assert_close(model(changed)[:, :7], logits[:, :7])
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_gqa_matches_explicit_repeat():
    cfg = _tiny(n_heads=4, n_kv_heads=1)
    model = build_model(cfg)
    init_weights(model, seed=1, device="cpu")
    attn = model.layers["0"].attention
    assert attn.wk.weight.shape == (cfg.head_dim, cfg.dim)  # one kv head
    x = torch.randn(2, 5, cfg.dim)
    cos, sin = model.rope_cos, model.rope_sin
    q = apply_rope(attn.wq(x).view(2, 5, 4, -1), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(2, 5, 1, -1), cos, sin).transpose(1, 2).expand(2, 4, 5, -1)
    v = attn.wv(x).view(2, 5, 1, -1).transpose(1, 2).expand(2, 4, 5, -1)
    scores = (q @ k.transpose(-1, -2)) / cfg.head_dim ** 0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.wo((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 5, -1))
    torch.testing.assert_close(attn(x, cos, sin), expected)


def test_init_is_deterministic_and_seeded():
    def weights(seed):
        model = build_model(MODEL_CONFIGS["tiny"])
        init_weights(model, seed=seed, device="cpu")
        return model.state_dict()

    a, b, c = weights(7), weights(7), weights(8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    torch.testing.assert_close(a["norm.weight"], torch.ones_like(a["norm.weight"]))
    # residual output projections are scaled down by 1/sqrt(2 * n_layers)
    assert a["layers.0.attention.wo.weight"].std() < 0.7 * a["layers.0.attention.wq.weight"].std()
    # each parameter has its own stream: equal shapes do not get equal values
    assert not torch.equal(a["layers.0.attention.wq.weight"], a["layers.1.attention.wq.weight"])


def test_init_requires_materialised_params():
    with pytest.raises(ValueError, match="meta"):
        init_weights(build_model(MODEL_CONFIGS["tiny"]), seed=0)


def test_param_seed_is_stable():
    # crc32-based: the same in every process and Python run (hash() would be salted)
    assert param_seed(0, "output.weight") == param_seed(0, "output.weight")
    assert param_seed(0, "output.weight") != param_seed(1, "output.weight")
    assert 0 <= param_seed(2**40, "x") < 2**32  # the CPU generator uses 32 bits of a seed


def test_plain_cpu_model_matches_meta_then_init():
    cfg = _tiny()
    eager = Transformer(cfg)
    init_weights(eager, seed=3)
    meta = build_model(cfg)
    init_weights(meta, seed=3, device="cpu")
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    torch.testing.assert_close(eager(tokens), meta(tokens))
