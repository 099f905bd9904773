"""trainyard.kernels.swiglu: the Triton kernels (run by Triton's interpreter on CPU) against the eager
reference and plain PyTorch formulas, the custom op's registrations, and which implementation runs.

Every test runs with TRITON_INTERPRET=1 (the `interpret` fixture of conftest.py; monkeypatched, so it does not leak into the
rest of the session). The kernels are jitted lazily for the current mode, so when triton was imported makes
no difference. Shapes stay small: the interpreter runs one program at a time.

Tolerances (rtol = atol), from the errors seen plus margin:
    float32, Triton vs eager reference and vs the written-out formulas   1e-5   (seen: <= 5e-7)
    float64, Triton vs the formulas in float64                          torch's defaults (1e-7 / 1e-7)
    bf16/fp16, Triton vs the eager reference                            rtol 2e-2, atol 1e-2
    bf16/fp16, Triton vs float32 formulas on the same inputs            2e-2
    bf16 a with a float32 b (float32 out) vs the reference              1e-2
The bf16 ones are loose because Triton's interpreter casts float32 to bf16 by truncation (its
`_convert_float` is called without a rounding mode; fp16 casts go through numpy and round to nearest even,
as GPUs do for both): silu(a) and the output are each cut by up to one bf16 ulp (2**-7 relative) where
eager rounds to nearest (half an ulp).
"""
import importlib
import os

import pytest
import torch

from trainyard.kernels import swiglu

from .helpers import count_calls

# The module, by its name: `trainyard.kernels.swiglu` as an attribute is the function, which the package's
# `from trainyard.kernels.swiglu import swiglu` binds over the submodule (so `import ... as` gives the function).
S = importlib.import_module("trainyard.kernels.swiglu")

pytestmark = [pytest.mark.skipif(not S.dispatch.triton_installed(), reason="Triton is not installed"),
              pytest.mark.usefixtures("interpret")]

# one element, odd sizes (masked tail of the 1024-element block), 3-D, more than one block (2500 elements)
SHAPES = [(1,), (3,), (4, 67), (2, 3, 130), (2500,)]


@pytest.fixture
def triton_calls(monkeypatch):
    """Counts the Triton forward launches (the wrapped launcher still runs)."""
    return count_calls(monkeypatch, S)


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b, dout = (3 * torch.randn(shape, generator=g) for _ in range(3))  # a wide: sigmoid's tails too
    return a.to(dtype).requires_grad_(), b.to(dtype).requires_grad_(), dout.to(dtype)


def _value_and_grads(fn, a, b, dout):
    out = fn(a, b)
    return (out, *torch.autograd.grad(out, (a, b), dout))


def _formulas(a, b, dout):
    """out, da, db written out with torch.sigmoid (no autograd)."""
    a, b = a.detach(), b.detach()
    s = torch.sigmoid(a)
    return a * s * b, dout * b * s * (1 + a * (1 - s)), dout * a * s


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_matches_the_reference_and_the_formulas(shape, triton_calls):
    a, b, dout = _inputs(shape, torch.float32)
    got = _value_and_grads(swiglu, a, b, dout)
    assert len(triton_calls) == 1
    reference = _value_and_grads(S.swiglu_reference, a, b, dout)
    for g, r, f, name in zip(got, reference, _formulas(a, b, dout), ("out", "da", "db")):
        assert g.shape == shape and g.dtype == torch.float32, name
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(g, f, rtol=1e-5, atol=1e-5, msg=name)


def test_float64_matches_the_formulas():
    a, b, dout = _inputs((4, 67), torch.float64)
    got = _value_and_grads(lambda a, b: swiglu(a, b, backend="triton"), a, b, dout)
    for g, f in zip(got, _formulas(a, b, dout)):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, f)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_in_and_out(dtype):
    a, b, dout = _inputs((2, 3, 130), dtype)
    got = _value_and_grads(lambda a, b: swiglu(a, b, backend="triton"), a, b, dout)
    reference = _value_and_grads(S.swiglu_reference, a, b, dout)
    for g, r, f in zip(got, reference, _formulas(a.float(), b.float(), dout.float())):
        assert g.dtype == dtype
        torch.testing.assert_close(g, r, rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(g.float(), f, rtol=2e-2, atol=2e-2)


def test_mixed_dtypes_non_contiguous_and_empty():
    a = torch.randn(67, 4, dtype=torch.bfloat16).t()  # (4, 67), not contiguous
    b = torch.randn(4, 67)
    out = swiglu(a, b, backend="triton")
    assert out.dtype == torch.float32  # promoted, as F.silu(a) * b is
    torch.testing.assert_close(out, S.swiglu_reference(a, b), rtol=1e-2, atol=1e-2)  # the bf16 cast of silu
    assert swiglu(torch.empty(0, 3), torch.empty(0, 3), backend="triton").shape == (0, 3)
    with pytest.raises(ValueError, match="same shape"):
        swiglu(torch.randn(2, 3), torch.randn(3), backend="triton")


def test_gradcheck_eager_and_triton_in_float64():
    a, b, _ = _inputs((3, 5), torch.float64)
    for backend in ("eager", "triton"):
        assert torch.autograd.gradcheck(lambda a, b: swiglu(a, b, backend=backend), (a, b))


def test_opcheck_and_the_fake_implementation():
    """opcheck: schema, fake (meta) kernel, autograd registration, AOT dispatch with dynamic shapes."""
    a, b, dout = _inputs((4, 67), torch.float32)
    torch.library.opcheck(torch.ops.trainyard.swiglu, (a, b))
    torch.library.opcheck(torch.ops.trainyard.swiglu_backward, (dout, a.detach(), b.detach()))

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(2, 5, 130, dtype=torch.bfloat16)
        out = torch.ops.trainyard.swiglu(a, torch.empty_like(a))
        assert (out.shape, out.dtype) == ((2, 5, 130), torch.bfloat16)
        assert swiglu(a, torch.empty(2, 5, 130), backend="triton").dtype == torch.float32


def test_which_implementation_runs(monkeypatch, triton_calls):
    eager = []
    reference = S.swiglu_reference
    monkeypatch.setattr(S, "swiglu_reference", lambda *a: eager.append(a) or reference(*a))
    a, b, _ = _inputs((2, 3), torch.float32)

    swiglu(a, b, backend="eager")  # eager, even where Triton runs
    assert (len(eager), len(triton_calls)) == (1, 0)
    swiglu(a, b)  # auto on CPU under the interpreter: Triton
    assert (len(eager), len(triton_calls)) == (1, 1)

    monkeypatch.delenv("TRITON_INTERPRET")
    swiglu(a, b)  # auto on CPU without the interpreter: eager
    assert (len(eager), len(triton_calls)) == (2, 1)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        swiglu(a, b, backend="triton")
    with pytest.raises(ValueError, match="backend="):
        swiglu(a, b, backend="cuda")
    assert os.environ.get("TRITON_INTERPRET") is None


@pytest.mark.parametrize("tuning", [{"fwd_block": 256, "fwd_warps": 2, "bwd_block": 512, "bwd_warps": 8},
                                    {"fwd_block": 2048, "bwd_block": 128}])
def test_other_launch_configurations_match_the_reference(monkeypatch, tuning):
    """The block sizes and warps the GPU sweep tries (S.TUNING): 2500 elements, a masked tail in every case."""
    for key, value in tuning.items():
        monkeypatch.setitem(S.TUNING, key, value)
    assert S.config_for().fwd_block == tuning["fwd_block"]
    a, b, dout = _inputs((2500,), torch.float32)
    got = _value_and_grads(swiglu, a, b, dout)
    for g, r in zip(got, _value_and_grads(S.swiglu_reference, a, b, dout)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
