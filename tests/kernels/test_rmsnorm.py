"""trainyard.kernels.rms_norm: the Triton kernels (run by Triton's interpreter on CPU) against the eager
reference and plain float32/float64 PyTorch, the custom op's registrations, and which implementation runs.

Every test runs with TRITON_INTERPRET=1 (the `interpret` fixture of conftest.py; monkeypatched, so it does not leak into the
rest of the session). The kernels are jitted lazily for the current mode, so when triton was imported makes
no difference. Shapes stay small: the interpreter runs one program at a time.

Tolerances (rtol = atol), from the errors seen plus margin:
    float32, Triton vs eager reference and vs plain float32 math      1e-5   (seen: 0 for y, <= 5e-7 for grads)
    float64, Triton vs the float64 reference                           torch's defaults (1e-7 / 1e-7)
    bf16, Triton vs the eager reference                                rtol 2e-2, atol 1e-2
    bf16, Triton vs float32 math on the same bf16 inputs               2e-2
    bf16 dweight vs both                                               2e-2 x sum over rows of |dy * normed|
    bf16 x with a float32 weight (float32 out) vs the reference        1e-2
The bf16 ones are loose because Triton's interpreter casts float32 to bf16 by truncation (its
`_convert_float` is called without a rounding mode; fp16 casts go through numpy and round to nearest even,
as GPUs do for both): the normalised x and y are each cut by up to one bf16 ulp (2**-7 relative) where
eager rounds to nearest (half an ulp). On a GPU the differences are the rare ties between float32 values
that differ in their last bits (reduction order, rsqrt).
"""
import os

import pytest
import torch

from trainyard.kernels import rms_norm
from trainyard.kernels import rmsnorm as R

from .helpers import count_calls

pytestmark = [pytest.mark.skipif(not R.dispatch.triton_installed(), reason="Triton is not installed"),
              pytest.mark.usefixtures("interpret")]

EPS = 1e-6
# hidden 1, 3, 67, 130 (odd, not powers of two: masked columns), one row, 3-D; 7 rows spread over the
# backward's 4 programs as 2+2+2+1 rows (a short last program).
SHAPES = [(1, 1), (4, 3), (1, 67), (7, 67), (2, 3, 130)]


@pytest.fixture
def triton_calls(monkeypatch):
    """Counts the Triton forward launches (the wrapped launcher still runs)."""
    return count_calls(monkeypatch, R)


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, dy


def _value_and_grads(fn, x, w, dy):
    y = fn(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


def _plain(x, w):
    """RMSNorm written out in the inputs' own precision (float32 or float64), no casts."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_matches_the_reference_and_plain_math(shape, triton_calls):
    x, w, dy = _inputs(shape, torch.float32)
    got = _value_and_grads(lambda x, w: rms_norm(x, w, EPS), x, w, dy)
    assert len(triton_calls) == 1
    reference = _value_and_grads(lambda x, w: R.rms_norm_reference(x, w, EPS), x, w, dy)
    plain = _value_and_grads(_plain, x, w, dy)
    for g, r, p, name in zip(got, reference, plain, ("y", "dx", "dweight")):
        assert g.shape == r.shape and g.dtype == torch.float32, name
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(g, p, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("shape", [(1, 3), (7, 67)])
def test_float64_matches_plain_float64_math(shape):
    x, w, dy = _inputs(shape, torch.float64)
    got = _value_and_grads(lambda x, w: rms_norm(x, w, EPS, backend="triton"), x, w, dy)
    for g, p in zip(got, _value_and_grads(_plain, x, w, dy)):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, p)


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 130)])
def test_bf16_in_bf16_out(shape):
    x, w, dy = _inputs(shape, torch.bfloat16)
    got = _value_and_grads(lambda x, w: rms_norm(x, w, EPS, backend="triton"), x, w, dy)
    reference = _value_and_grads(lambda x, w: R.rms_norm_reference(x, w, EPS), x, w, dy)
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
    plain = _value_and_grads(_plain, x32, w32, dy.float())
    for g, r, p in zip(got[:2], reference[:2], plain[:2]):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, r, rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(g.float(), p, rtol=2e-2, atol=2e-2)
    # dweight sums dy * normed over the rows, where the terms' roundings add up and cancellation can leave a
    # small sum: its error is measured against the sum of the terms' magnitudes.
    dweight = got[2]
    assert dweight.dtype == torch.bfloat16
    terms = (dy.float() * _plain(x32, torch.ones_like(w32))).abs().reshape(-1, shape[-1]).sum(0)
    for want in (reference[2].float(), plain[2]):
        assert ((dweight.float() - want).abs() <= 2e-2 * terms).all()


def test_the_reference_is_the_built_in_models_rmsnorm():
    from trainyard.engine.models.llama.model import RMSNorm

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w, _ = _inputs((3, 67), dtype)
        norm = RMSNorm(67, EPS).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(w)
            assert torch.equal(R.rms_norm_reference(x, w, EPS), norm(x))


def test_hf_llama_rmsnorm_computes_the_same():
    """HF's LlamaRMSNorm: the same operations (only `weight * normed` written the other way round)."""
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    for dtype in (torch.float32, torch.bfloat16):
        x, w, _ = _inputs((3, 67), dtype)
        norm = modeling_llama.LlamaRMSNorm(67, eps=EPS).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(w)
            assert torch.equal(R.rms_norm_reference(x, w, EPS), norm(x))


def test_mixed_dtypes_non_contiguous_input_and_zero_rows():
    x, _, _ = _inputs((67, 5), torch.bfloat16)
    x = x.detach().t()  # (5, 67), not contiguous
    w = torch.randn(67)  # float32 weight: the output is float32, as bf16 * fp32 is in the model
    y = rms_norm(x, w, EPS, backend="triton")
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, R.rms_norm_reference(x, w, EPS), rtol=1e-2, atol=1e-2)  # the bf16 cast
    zeros = torch.zeros(2, 3)
    torch.testing.assert_close(rms_norm(zeros, torch.ones(3), EPS, backend="triton"), zeros)  # rstd finite
    assert rms_norm(torch.empty(0, 3), torch.ones(3), EPS, backend="triton").shape == (0, 3)


def test_gradcheck_eager_and_triton_in_float64():
    x, w, _ = _inputs((3, 5), torch.float64)
    for backend in ("eager", "triton"):
        assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, EPS, backend=backend), (x, w))


def test_opcheck_and_the_fake_implementation():
    """opcheck: schema, fake (meta) kernel, autograd registration, AOT dispatch with dynamic shapes."""
    x, w, dy = _inputs((4, 67), torch.float32)
    torch.library.opcheck(torch.ops.trainyard.rms_norm, (x, w, EPS))
    _, rstd = torch.ops.trainyard.rms_norm(x.detach(), w.detach(), EPS)
    torch.library.opcheck(torch.ops.trainyard.rms_norm_backward, (dy, x.detach(), w.detach(), rstd))

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 130, dtype=torch.bfloat16)
        y, rstd = torch.ops.trainyard.rms_norm(x, torch.empty(130, dtype=torch.bfloat16), EPS)
        assert (y.shape, y.dtype) == ((2, 5, 130), torch.bfloat16)
        assert (rstd.shape, rstd.dtype) == ((2, 5), torch.float32)
        assert rms_norm(x, torch.empty(130), EPS, backend="triton").dtype == torch.float32


def test_which_implementation_runs(monkeypatch, triton_calls):
    eager = []
    reference = R.rms_norm_reference
    monkeypatch.setattr(R, "rms_norm_reference", lambda *a: eager.append(a) or reference(*a))
    x, w, _ = _inputs((2, 3), torch.float32)

    rms_norm(x, w, EPS, backend="eager")  # eager, even where Triton runs
    assert (len(eager), len(triton_calls)) == (1, 0)
    rms_norm(x, w, EPS)  # auto on CPU under the interpreter: Triton
    assert (len(eager), len(triton_calls)) == (1, 1)

    monkeypatch.delenv("TRITON_INTERPRET")
    rms_norm(x, w, EPS)  # auto on CPU without the interpreter: eager
    assert (len(eager), len(triton_calls)) == (2, 1)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        rms_norm(x, w, EPS, backend="triton")
    with pytest.raises(ValueError, match="backend="):
        rms_norm(x, w, EPS, backend="cuda")
    assert os.environ.get("TRITON_INTERPRET") is None


def test_rows_wider_than_the_kernel_take_the_reference_under_auto(monkeypatch, triton_calls):
    monkeypatch.setattr(R, "MAX_HIDDEN", 4)
    x, w, _ = _inputs((2, 5), torch.float32)
    torch.testing.assert_close(rms_norm(x, w, EPS), R.rms_norm_reference(x, w, EPS))
    assert not triton_calls
    with pytest.raises(ValueError, match="hidden size 5"):
        rms_norm(x, w, EPS, backend="triton")
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.randn(2, 3), torch.ones(4), EPS, backend="triton")


@pytest.mark.parametrize("tuning", [{"fwd_rows": 4, "fwd_warps": 2}, {"fwd_rows": 2, "bwd_warps": 8, "bwd_waves": 2}])
def test_other_launch_configurations_match_the_reference(monkeypatch, tuning):
    """The configurations the GPU sweep tries (R.TUNING): several rows per forward program, with a short last
    tile (7 rows in tiles of 4 or 2), other warps; 7 x 67 values and gradients against the reference."""
    for key, value in tuning.items():
        monkeypatch.setitem(R.TUNING, key, value)
    assert R.config_for(67).fwd_rows == tuning["fwd_rows"]
    x, w, dy = _inputs((7, 67), torch.float32)
    got = _value_and_grads(lambda x, w: rms_norm(x, w, EPS, backend="triton"), x, w, dy)
    want = _value_and_grads(lambda x, w: R.rms_norm_reference(x, w, EPS), x, w, dy)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
