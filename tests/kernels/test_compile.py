"""`torch.compile` traces through the ops: their fake implementations give the shapes, their autograd
formulas the backward, and a full graph needs no break (the AOT eager backend: no C++ compiler involved)."""
import importlib

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


def _cuda_block(x, w, gate, up, q, k, cos, sin, head, targets):
    """Every op, forward and backward ops both, as the CUDA path calls them (backend auto on CUDA tensors)."""
    rmsnorm = importlib.import_module("trainyard.kernels.rmsnorm")
    swiglu = importlib.import_module("trainyard.kernels.swiglu")  # (trainyard.kernels.swiglu is the function)
    rope = importlib.import_module("trainyard.kernels.rope")

    y, rstd = rmsnorm.OPS.pick(x)(x, w, 1e-6)
    dx, dw = rmsnorm.BACKWARD_OPS.pick(x)(y, x, w, rstd)
    s = kernels.swiglu(gate, up)
    da, db = swiglu.BACKWARD_OPS.pick(gate)(s, gate, up)
    q, k = rope.QK_OPS.pick(q)(q, k, cos, sin, True, False)  # apply_rope's slicing of the tables: see below
    h = kernels.rms_norm(x, w, 1e-6) + s + dx + da + db
    return kernels.fused_linear_cross_entropy(h, head, targets) + q.sum() + k.sum() + dw.sum()


@pytest.mark.skipif(not kernels.dispatch.triton_installed(), reason="Triton is not installed")
def test_the_cuda_path_traces_into_the_triton_kernels(monkeypatch):
    """The ops as they run on CUDA (trainyard::*_traceable, torch.library.triton_op) are not opaque to
    torch.compile: AOT autograd's trace of them holds the Triton kernels themselves, which inductor then
    launches and plans around.

    What a CPU machine can and cannot show: the inputs are fake CUDA tensors (FakeTensorMode; this torch has no
    CUDA), so the trace runs the ops' real Python (dispatch, shape checks, launch configuration, the
    wrap_triton launches) without the interpreter, and the recorded forward graph is the one inductor would
    get on a GPU. Only the forward can be traced this way (autograd refuses CUDA tensors in a build without
    CUDA), so the backward ops are called directly as part of it; views of fake CUDA tensors fail in this build
    too, so RoPE's op is called with tables already cut to (1, seq, D/2) (apply_rope's own slicing is plain
    torch, covered on CPU); running the recorded graph fails after recording for want of CUDA (expected
    below). Whether inductor compiles and runs the graph is left to the GPU
    sweep (bench/kernels_tune.py, its compile check)."""
    from functorch.compile import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the compiled kernels' path, as on a GPU
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    with FakeTensorMode(allow_non_fake_inputs=True):
        n, d, v = 6, 16, 40
        dev = "cuda"
        args = [torch.empty(n, d, device=dev), torch.empty(d, device=dev), torch.empty(n, d, device=dev),
                torch.empty(n, d, device=dev), torch.empty(1, n, 4, 8, device=dev),
                torch.empty(1, n, 2, 8, device=dev), torch.empty(1, n, 4, device=dev), torch.empty(1, n, 4, device=dev),
                torch.empty(v, d, device=dev), torch.zeros(n, dtype=torch.long, device=dev)]
        with pytest.raises(RuntimeError, match="not linked with support for cuda"):
            aot_function(_cuda_block, fw_compiler=record)(*args)
    assert graphs, "AOT autograd recorded no forward graph"
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    kernel_names = [graphs[0].graph.owning_module is not None and str(node.kwargs.get("kernel_idx"))
                    for node in graphs[0].graph.nodes if "triton_kernel_wrapper" in str(node.target)]
    # rms_norm twice (forward, forward again) and its backward, swiglu and its backward, rope_qk: six launches
    assert len(kernel_names) == 6, targets
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    launched = {kernel_side_table.get_kernel(int(i)).fn.__name__ for i in kernel_names}
    assert launched == {"_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_swiglu_fwd_kernel", "_swiglu_bwd_kernel",
                        "_rope_qk_kernel"}
    opaque = [t for t in targets if t.startswith("trainyard.")]
    # no op of ours left opaque but the fused loss (opaque by design: see trainyard/kernels/cross_entropy.py)
    assert opaque and all(t.startswith("trainyard.fused_linear_cross_entropy") for t in opaque), opaque
