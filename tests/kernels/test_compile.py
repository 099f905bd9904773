"""`torch.compile` traces through the ops: their fake implementations give the shapes, their autograd
formulas the backward, and a full graph needs no break (the AOT eager backend: no C++ compiler involved)."""
import pytest
import torch

from trainyard import kernels


def _block(x, w, gate, up, q, k, cos, sin, head, targets):
    h = kernels.rms_norm(x, w, 1e-6) + kernels.swiglu(gate, up)
    q, k = kernels.apply_rope(q, k, cos, sin, layout="pairs")
    return kernels.fused_linear_cross_entropy(h, head, targets) + q.square().mean() + k.square().mean()


@pytest.mark.usefixtures("interpret")  # the compiled graph calls the ops' Triton kernels through the interpreter
def test_a_compiled_full_graph_matches_eager_values_and_gradients():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    n, d, v = 6, 16, 40
    args = [torch.randn(n, d, generator=g), torch.rand(d, generator=g) + 0.5, torch.randn(n, d, generator=g),
            torch.randn(n, d, generator=g), torch.randn(1, n, 2, 8, generator=g), torch.randn(1, n, 1, 8, generator=g)]
    angles = torch.rand(n, 4, generator=g)
    args += [angles.cos(), angles.sin(), torch.randn(v, d, generator=g), torch.randint(0, v, (n,), generator=g)]
    leaves = [0, 1, 2, 3, 4, 5, 8]
    eager_in = [a.clone().requires_grad_(i in leaves) for i, a in enumerate(args)]
    compiled_in = [a.clone().requires_grad_(i in leaves) for i, a in enumerate(args)]
    want = _block(*eager_in)
    want.backward()
    got = torch.compile(_block, backend="aot_eager", fullgraph=True)(*compiled_in)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for i in leaves:
        torch.testing.assert_close(compiled_in[i].grad, eager_in[i].grad, rtol=1e-5, atol=1e-6)
