"""trainyard.kernels.apply_rope: the Triton kernel (run by Triton's interpreter on CPU) against the eager
reference, and the eager reference against the two models it serves: transformers' `apply_rotary_pos_emb`
(layout "hf") and the built-in model's `apply_rope` (layout "pairs").

Tolerances, float32: Triton against eager 1e-6 absolute / 1e-5 relative (the same float32 operations; on a
GPU the compiler may fuse a multiply-add, a last-bit difference); eager against transformers and the built-in
model 1e-6 / 1e-5 (the same operations in float32: equal up to rounding). bfloat16: 1e-2 absolute and
relative, against the eager path and against float32 math on the same bf16-valued inputs and upstream
gradients (both round one float32 result to bf16: at most 2^-8 = 3.9e-3 relative apart).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before trainyard.kernels (tests/conftest.py sets it too)

import pytest
import torch

from trainyard.kernels import apply_rope, dispatch
from trainyard.kernels import rope as rope_module

needs_triton = pytest.mark.skipif(not dispatch.triton_installed(), reason="Triton is not installed")
FP32 = dict(atol=1e-6, rtol=1e-5)
BF16 = dict(atol=1e-2, rtol=1e-2)

# (batch, seq, q heads, k heads, head_dim): GQA, the smallest head_dim, odd pair counts (3, 65), one
# position, one head
SHAPES = [(2, 3, 4, 2, 8), (1, 1, 1, 1, 2), (2, 5, 3, 1, 6), (1, 2, 2, 2, 130)]


def make(layout, batch, seq, hq, hk, dim, *, dtype=torch.float32, table_rows=None, per_batch=False, seed=0):
    """q, k and the tables of `layout`, as each model gives them: "hf" (batch or 1, seq, D) halves repeated,
    "pairs" (table_rows >= seq, D/2) from the built-in model's rope_tables."""
    from trainyard.engine.models.llama.model import rope_tables

    gen = torch.Generator().manual_seed(seed)
    if layout == "hf":
        q_shape, k_shape = (batch, hq, seq, dim), (batch, hk, seq, dim)
        # positions differ per row when per_batch (as HF position_ids may): angles of position p + row
        rows = torch.arange(batch)[:, None] if per_batch else torch.zeros(1, 1, dtype=torch.long)
        positions = (torch.arange(seq)[None, :] + rows).float()
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
        angles = positions[..., None] * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos(), emb.sin()
    else:
        q_shape, k_shape = (batch, seq, hq, dim), (batch, seq, hk, dim)
        cos, sin = rope_tables(dim, table_rows or seq, 10000.0)
    q = torch.randn(q_shape, generator=gen, dtype=torch.float32).to(dtype)
    k = torch.randn(k_shape, generator=gen, dtype=torch.float32).to(dtype)
    return q, k, cos.to(dtype), sin.to(dtype)


def values_and_grads(q, k, cos, sin, layout, backend, *, grad_dtype=None, seed=1):
    """Outputs and the gradients of q and k for random upstream gradients (rounded to grad_dtype first)."""
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    q_out, k_out = apply_rope(q, k, cos, sin, layout=layout, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    dq = torch.randn(q_out.shape, generator=gen).to(grad_dtype or q_out.dtype).to(q_out.dtype)
    dk = torch.randn(k_out.shape, generator=gen).to(grad_dtype or k_out.dtype).to(k_out.dtype)
    torch.autograd.backward((q_out, k_out), (dq, dk))
    return q_out.detach(), k_out.detach(), q.grad, k.grad


# ---------------------------------------------------------------------------------------------- Triton vs eager


@pytest.fixture(params=["joint", "separate"])
def launch(request, monkeypatch):
    """Both ways apply_rope launches: q and k in one kernel (trainyard::rope_qk, the default) and one launch
    per tensor (trainyard::rope); the fixture counts the launches of the way it picked."""
    joint = request.param == "joint"
    monkeypatch.setitem(rope_module.TUNING, "joint", joint)
    calls = []
    name = "_launch_qk" if joint else "_launch"
    original = getattr(rope_module, name)
    monkeypatch.setattr(rope_module, name, lambda *a, **kw: calls.append(a) or original(*a, **kw))
    return calls


@needs_triton
@pytest.mark.parametrize("layout", ["hf", "pairs"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_matches_eager(interpret, layout, shape, launch):
    q, k, cos, sin = make(layout, *shape, table_rows=shape[1] + 3, per_batch=True)
    triton_out = values_and_grads(q, k, cos, sin, layout, "triton")
    eager_out = values_and_grads(q, k, cos, sin, layout, "eager")
    for name, got, want in zip(("q", "k", "dq", "dk"), triton_out, eager_out):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, **FP32, msg=lambda m: f"{name}: {m}")
    # forward and backward: one launch each when joint, two each when separate
    assert len(launch) == (2 if rope_module.config_for().joint else 4)


@needs_triton
@pytest.mark.parametrize("layout", ["hf", "pairs"])
def test_joint_kernel_tiles_many_heads(interpret, layout, monkeypatch):
    """More heads than one tile holds (pairs 8 per tile: 2 heads of D = 8 at a time), q heads not a multiple of
    the tile (5) and k a single head: the joint kernel's loops over head tiles, against eager."""
    monkeypatch.setitem(rope_module.TUNING, "pairs", 8)
    q, k, cos, sin = make(layout, 2, 3, 5, 1, 8, table_rows=4)
    for got, want in zip(values_and_grads(q, k, cos, sin, layout, "triton"),
                         values_and_grads(q, k, cos, sin, layout, "eager")):
        torch.testing.assert_close(got, want, **FP32)


@needs_triton
@pytest.mark.parametrize("layout", ["hf", "pairs"])
def test_triton_matches_eager_bf16(interpret, layout, launch):
    q, k, cos, sin = make(layout, 2, 4, 4, 2, 16, dtype=torch.bfloat16)
    triton_out = values_and_grads(q, k, cos, sin, layout, "triton")
    eager_out = values_and_grads(q, k, cos, sin, layout, "eager")
    # against float32 math on the same (bf16-valued) inputs: one rounding of the output apart
    fp32_out = values_and_grads(q.float(), k.float(), cos.float(), sin.float(), layout, "eager",
                                grad_dtype=torch.bfloat16)
    for name, got, want, exact in zip(("q", "k", "dq", "dk"), triton_out, eager_out, fp32_out):
        assert got.dtype == torch.bfloat16, name
        torch.testing.assert_close(got, want, **BF16, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(got.float(), exact, **BF16, msg=lambda m: f"{name} vs float32: {m}")


@needs_triton
def test_triton_keeps_layout_and_inputs(interpret):
    """New tensors with the inputs' shapes and strides (the HF tensors go through the kernel as transposed
    views); q and k are not written."""
    q, k, cos, sin = make("hf", 2, 3, 4, 2, 8)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = apply_rope(q, k, cos, sin, layout="hf", backend="triton")
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    assert torch.equal(q, q0) and torch.equal(k, k0)
    # non-contiguous inputs: a strided q (every other head of a wider tensor)
    wide = torch.randn(2, 8, 3, 8)
    q_out, _ = apply_rope(wide[:, ::2], k, cos, sin, layout="hf", backend="triton")
    want, _ = apply_rope(wide[:, ::2], k, cos, sin, layout="hf", backend="eager")
    torch.testing.assert_close(q_out, want, **FP32)


# ---------------------------------------------------------------------------------------------- against the models


@pytest.mark.parametrize("backend", ["eager", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("head_dim", [16, 6])
def test_hf_layout_matches_transformers(interpret, backend, head_dim):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=64, intermediate_size=32, num_hidden_layers=1, vocab_size=32)
    batch, seq = 2, 5
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 4, seq, head_dim, generator=gen)
    k = torch.randn(batch, 2, seq, head_dim, generator=gen)
    # positions that differ per sequence (an offset, as with left padding or a cache)
    position_ids = torch.arange(seq)[None, :] + torch.tensor([[0], [7]])
    cos, sin = LlamaRotaryEmbedding(config)(q, position_ids)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = apply_rope(q, k, cos, sin, layout="hf", backend=backend)
    torch.testing.assert_close(got_q, want_q, **FP32)
    torch.testing.assert_close(got_k, want_k, **FP32)


@pytest.mark.parametrize("backend", ["eager", pytest.param("triton", marks=needs_triton)])
def test_pairs_layout_matches_builtin_model(interpret, backend):
    from trainyard.engine.models.llama import model as llama

    batch, seq, head_dim, max_seq = 2, 5, 16, 12
    cos, sin = llama.rope_tables(head_dim, max_seq, 500000.0)  # the model's buffers: (max_seq_len, D/2)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, 4, head_dim, generator=gen)
    k = torch.randn(batch, seq, 2, head_dim, generator=gen)
    want_q, want_k = llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin)
    # the whole tables, and their first seq rows (what the engine's swap passes)
    for c, s in ((cos, sin), (cos[:seq], sin[:seq])):
        got_q, got_k = apply_rope(q, k, c, s, layout="pairs", backend=backend)
        torch.testing.assert_close(got_q, want_q, **FP32)
        torch.testing.assert_close(got_k, want_k, **FP32)


# ---------------------------------------------------------------------------------------------- gradcheck, opcheck


@pytest.mark.parametrize("layout", ["hf", "pairs"])
@pytest.mark.parametrize("backend", ["eager", pytest.param("triton", marks=needs_triton)])
def test_gradcheck_float64(interpret, layout, backend, launch):
    q, k, cos, sin = make(layout, 1, 2, 2, 1, 6, dtype=torch.float64, table_rows=3, per_batch=True)
    q.requires_grad_()
    k.requires_grad_()
    fn = lambda q, k: apply_rope(q, k, cos, sin, layout=layout, backend=backend)  # noqa: E731
    # fast mode (random projections of the Jacobian) for the interpreter: the full check takes ~14 s there
    fast = backend == "triton"
    assert torch.autograd.gradcheck(fn, (q, k), fast_mode=fast)
    assert torch.autograd.gradgradcheck(fn, (q, k), fast_mode=fast)  # the backward is the op again


def _op_samples():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, 6, generator=gen)
    cos, sin = torch.randn(2, 3, 3, generator=gen), torch.randn(2, 3, 3, generator=gen)
    hf_view = torch.randn(2, 2, 3, 8, generator=gen).transpose(1, 2)  # (batch, seq, heads, D) view, as "hf" passes
    shared = torch.randn(1, 5, 4, generator=gen)  # batch-shared tables with more rows than seq
    return [
        (x, cos, sin, True, False),
        (x, cos, sin, False, True),
        (hf_view, shared, shared.flip(-1), False, False),
    ]


@needs_triton
@pytest.mark.parametrize("sample", range(3))
def test_opcheck(interpret, sample):
    x, cos, sin, interleaved, inverse = _op_samples()[sample]
    torch.library.opcheck(torch.ops.trainyard.rope.default, (x.requires_grad_(), cos, sin, interleaved, inverse))


@needs_triton
@pytest.mark.parametrize("sample", range(3))
def test_opcheck_joint(interpret, sample):
    """trainyard::rope_qk with a k of other heads (GQA: 1 head) and other strides than q."""
    x, cos, sin, interleaved, inverse = _op_samples()[sample]
    k = torch.randn(x.shape[0], x.shape[1], 1, x.shape[3], generator=torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.trainyard.rope_qk.default,
                          (x.requires_grad_(), k.requires_grad_(), cos, sin, interleaved, inverse))


# ---------------------------------------------------------------------------------------------- dispatch, errors


def test_eager_backend_and_plain_cpu_take_the_reference(monkeypatch):
    def no_kernel(*args):
        raise AssertionError("the Triton op ran")

    monkeypatch.setattr(rope_module, "_launch", no_kernel)
    monkeypatch.setattr(rope_module, "_launch_qk", no_kernel)
    q, k, cos, sin = make("hf", 1, 2, 2, 1, 4)
    want = apply_rope(q, k, cos, sin, backend="eager")  # under the interpreter too
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    got = apply_rope(q, k, cos, sin)  # auto on a CPU tensor, no interpreter: eager
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        apply_rope(q, k, cos, sin, backend="triton")


@needs_triton
def test_op_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        torch.ops.trainyard.rope(x, torch.ones(1, 2, 2), torch.zeros(1, 2, 2), True, False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        torch.ops.trainyard.rope_qk(x, x, torch.ones(1, 2, 2), torch.zeros(1, 2, 2), True, False)


def test_bad_arguments():
    q, k, cos, sin = make("pairs", 1, 4, 2, 1, 8)
    with pytest.raises(ValueError, match="layout"):
        apply_rope(q, k, cos, sin, layout="neox")
    with pytest.raises(ValueError, match="backend"):
        apply_rope(q, k, cos, sin, layout="pairs", backend="cuda")
    with pytest.raises(ValueError, match="even"):
        apply_rope(q[..., :7], k[..., :7], cos, sin, layout="pairs")
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rope(q, k, cos[:3], sin[:3], layout="pairs")  # fewer rows than seq
    with pytest.raises(ValueError, match="cos and sin"):  # HF tables are (.., D): these are (.., D/2)
        apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, layout="hf")
    with pytest.raises(ValueError, match="no gradient"):
        apply_rope(q, k, cos.requires_grad_(), sin, layout="pairs")
    with pytest.raises(ValueError, match="differ"):
        apply_rope(q, k[:, :3], cos.detach(), sin, layout="pairs")
