"""`trainyard.kernels.fused_linear_cross_entropy` (trainyard/kernels/cross_entropy.py) against
`F.cross_entropy(F.linear(hidden, weight), targets)` and its backward: loss, grad_hidden, grad_weight.

The Triton path runs on CPU under TRITON_INTERPRET=1 (set by tests/conftest.py before anything imports
Triton), on small shapes. Tolerances, float32: the op sums the same float32 terms as torch in another order
(per chunk, then over chunks; grad_weight accumulated chunk by chunk), so results agree to a few float32
ulps of the largest term: rtol 1e-5, atol 1e-6 (the gradients here are of order 1e-2..1e-1). bf16 inputs:
against the float32 reference of the same (bf16-rounded) inputs, 2e-2 of the largest magnitude: the op's
logits and logits' gradients are rounded to bf16 before the matmuls (8 bits of mantissa, 4e-3 relative).
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from trainyard.engine.components.meter import cpu_peak_bytes
from trainyard.kernels import cross_entropy as ce
from trainyard.kernels import dispatch, fused_linear_cross_entropy, vocab_parallel_fused_linear_cross_entropy

RTOL, ATOL = 1e-5, 1e-6
BACKENDS = ["eager", "triton"]


def _data(n, h, v, *, ignored=(), dtype=torch.float32, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*(lead or (n,)), h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / h ** 0.5
    targets = torch.randint(0, v, lead or (n,), generator=g)
    targets.view(-1)[list(ignored)] = -100
    return hidden.to(dtype), weight.to(dtype), targets


def _reference(hidden, weight, targets, reduction="mean", grad_out=None, softcap=None):
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    logits = F.linear(h, w)
    if softcap:  # Gemma 2's final-logit soft-capping, as transformers writes it
        logits = torch.tanh(logits / softcap) * softcap
    loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction=reduction)
    (loss if grad_out is None else loss * grad_out.flatten()).sum().backward()
    return loss.detach(), h.grad, w.grad


def _ours(hidden, weight, targets, reduction="mean", grad_out=None, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, targets, reduction=reduction, **kw)
    (loss if grad_out is None else loss * grad_out).sum().backward()
    return loss.detach(), h.grad, w.grad


def _close(got, want, **tol):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), **({"rtol": RTOL, "atol": ATOL} | tol))


@pytest.fixture
def small_blocks(monkeypatch):
    """The Triton kernel walks a row in blocks of 32 columns: V = 101 spans 4, the last one partial."""
    monkeypatch.setattr(ce, "MAX_BLOCK", 32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradients_match_torch(backend, reduction, small_blocks):
    # 37 tokens in chunks of 8 (the last one short), vocabulary 101 (not a multiple of a block), 5 ignored
    args = _data(37, 16, 101, ignored=(0, 3, 17, 18, 36))
    got = _ours(*args, reduction, backend=backend, chunk_size=8)
    _close(got, _reference(*args, reduction))
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_but_one_row_ignored(backend, small_blocks):
    args = _data(9, 8, 45, ignored=[i for i in range(9) if i != 4])
    got = _ours(*args, backend=backend, chunk_size=4)
    _close(got, _reference(*args))
    assert got[1][4].abs().sum() > 0 and got[1][:4].abs().sum() == 0  # ignored rows: zero gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_row_ignored_gives_nan_and_zero_gradients_as_torch(backend):
    args = _data(4, 8, 10, ignored=range(4))
    loss, gh, gw = _ours(*args, backend=backend)
    ref = _reference(*args)
    assert loss.isnan() and ref[0].isnan()
    assert gh.abs().sum() == gw.abs().sum() == ref[1].abs().sum() == ref[2].abs().sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_and_leading_dimensions(backend):
    one = _data(1, 8, 13, seed=1)
    _close(_ours(*one, backend=backend), _reference(*one))
    batched = _data(0, 8, 13, lead=(2, 5), ignored=(7,), seed=2)  # hidden (2, 5, H), targets (2, 5)
    got = _ours(*batched, backend=backend, chunk_size=3)
    _close(got, _reference(*batched))
    assert got[1].shape == (2, 5, 8)
    hidden, weight, targets = _data(14, 8, 13, seed=3)  # strided views: a transposed hidden, every 2nd target
    strided = (hidden.t().contiguous().t()[::2], weight, targets[::2])
    _close(_ours(*strided, backend=backend, chunk_size=3), _reference(*strided))


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduction_none_and_an_incoming_gradient(backend, small_blocks):
    args = _data(11, 8, 70, ignored=(2, 9), seed=3)
    grad_out = torch.randn(11, generator=torch.Generator().manual_seed(4))
    got = _ours(*args, "none", grad_out, backend=backend, chunk_size=4)
    _close(got, _reference(*args, "none", grad_out))
    assert got[0][2] == got[0][9] == 0
    # mean with a gradient other than 1: the stored gradients are scaled in the backward
    _close(_ours(*args, "mean", torch.tensor(2.5), backend=backend),
           _reference(*args, "mean", torch.tensor(2.5)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accumulate", ["weight", "float32"])
def test_bf16_inputs(backend, accumulate):
    """bf16 logits chunks (5 of 8 rows, the last short) overwritten in place by their gradient; grad_weight
    accumulated over the chunks in bf16 (as Liger) or in float32."""
    hidden, weight, targets = _data(37, 32, 300, ignored=(5,), dtype=torch.bfloat16, seed=5)
    loss, gh, gw = _ours(hidden, weight, targets, backend=backend, chunk_size=8, accumulate=accumulate)
    assert (loss.dtype, gh.dtype, gw.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    ref = _reference(hidden, weight, targets)  # float32 maths on the same bf16 values
    for got, want in zip((loss, gh, gw), ref):
        assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_soft_capped_logits(backend, reduction, interpret):
    """Logits around +-8 against a cap of 2 (tanh far from linear): the capped loss and its gradients."""
    hidden, weight, targets = _data(24, 16, 70, ignored=(3,), seed=11)
    weight = weight * 8
    grad_out = torch.rand(24) if reduction == "none" else None
    got = _ours(hidden, weight, targets, reduction, grad_out, backend=backend, chunk_size=8, softcap=2.0)
    want = _reference(hidden, weight, targets, reduction, grad_out, softcap=2.0)
    _close(got, want)
    uncapped = _reference(hidden, weight, targets, reduction, grad_out)
    assert (got[0] - uncapped[0]).abs().max() > 0.1  # the cap changes the loss: the test can fail
    with pytest.raises(ValueError, match="softcap must be > 0"):
        fused_linear_cross_entropy(hidden, weight, targets, softcap=-1.0)


def test_gradcheck_float64_eager():
    hidden, weight, targets = _data(6, 4, 7, ignored=(2,), dtype=torch.float64, seed=6)
    hidden.requires_grad_(), weight.requires_grad_()
    for reduction in ("mean", "sum", "none"):
        def f(h, w):
            return fused_linear_cross_entropy(h, w, targets, reduction=reduction, backend="eager", chunk_size=4)

        assert torch.autograd.gradcheck(f, (hidden, weight))


def test_backward_twice_and_scaled_gradients_leave_the_stored_ones_intact():
    args = _data(10, 8, 20, seed=7)
    h, w = (t.clone().requires_grad_() for t in args[:2])
    loss = fused_linear_cross_entropy(h, w, args[2], backend="eager")
    first = torch.autograd.grad(loss, (h, w), retain_graph=True)
    doubled = torch.autograd.grad(loss * 2, (h, w), retain_graph=True)
    again = torch.autograd.grad(loss, (h, w))
    _close(again, first, rtol=0, atol=0)
    _close(doubled, [2 * g for g in first], rtol=0, atol=0)
    # .backward(): the stored buffers become .grad without a copy; a second pass adds to them correctly, a
    # third is refused by torch's version check (never a silently wrong gradient)
    loss = fused_linear_cross_entropy(h, w, args[2], backend="eager")
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    _close((h.grad, w.grad), [2 * g for g in first])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_which_path_runs(monkeypatch):
    calls = []
    real = ce._rows_triton
    monkeypatch.setattr(ce, "_rows_triton", lambda *a: calls.append(1) or real(*a))
    args = _data(5, 8, 9)
    assert dispatch.interpreting()  # tests/conftest.py
    fused_linear_cross_entropy(*args, backend="eager")
    assert not calls
    fused_linear_cross_entropy(*args)  # auto: Triton under the interpreter
    assert calls
    calls.clear()
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU without the interpreter: the chunked eager path
    _close([fused_linear_cross_entropy(*args)], [_reference(*args)[0]])
    assert not calls
    with pytest.raises(RuntimeError, match="backend='triton'.*TRITON_INTERPRET=1"):
        fused_linear_cross_entropy(*args, backend="triton")


def test_chunk_size_rule():
    # the largest power of two <= H / 4, at most N: a chunk's fp32 logits are <= 1/4 of the (V, H) fp32 buffer
    assert ce.chunk_size_for(4096, 8192) == 1024  # Llama 3 8B: 1024 x 128256 x 4 B = 525 MB per chunk
    assert ce.chunk_size_for(1024, 4096) == 256
    assert ce.chunk_size_for(1000, 4096) == 128
    assert ce.chunk_size_for(16, 3) == 3 and ce.chunk_size_for(2, 10) == 1


def test_bad_arguments_are_named():
    h, w, t = _data(4, 8, 10)
    with pytest.raises(ValueError, match="reduction='avg'"):
        fused_linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(ValueError, match=r"weight must be \(vocab, H\)"):
        fused_linear_cross_entropy(h, w.t(), t)
    with pytest.raises(ValueError, match="same dtype"):
        fused_linear_cross_entropy(h, w.double(), t)
    with pytest.raises(ValueError, match="one target per row"):
        fused_linear_cross_entropy(h, w, t[:3])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_opcheck(reduction):
    hidden, weight, targets = _data(6, 8, 11, ignored=(1,), seed=8)
    hidden.requires_grad_(), weight.requires_grad_()
    torch.library.opcheck(torch.ops.trainyard.fused_linear_cross_entropy.default,
                          (hidden, weight, targets, -100, reduction, "eager", 4, 0.0, True))
    torch.library.opcheck(torch.ops.trainyard.fused_linear_cross_entropy.default,
                          (hidden, weight, targets, -100, reduction, "eager", 4, 2.0, False))


def test_opcheck_backward_op():
    hidden, weight, targets = _data(6, 8, 11, ignored=(1,), seed=9)
    torch.library.opcheck(torch.ops.trainyard.fused_linear_cross_entropy_backward.default,
                          (hidden, weight, targets, torch.randn(6), -100, "eager", 4, 0.0, True))


# ---- memory ------------------------------------------------------------------------------------------

def test_extra_peak_memory_is_a_fraction_of_eager():
    """V 32000, H 256, 1024 tokens, float32. Eager holds the (N, V) logits, their log-softmax and their
    gradient (131 MB each); the op holds its (V, H) float32 grad_weight buffer (33 MB), one chunk of
    logits (64 x V: 8 MB) and grad_hidden (1 MB). weight.grad is preallocated in both runs (as under
    gradient accumulation), so both are measured above inputs + weight + weight gradient."""
    n, h, v = 1024, 256, 32000
    hidden, weight, targets = _data(n, h, v, ignored=range(0, n, 50), seed=10)
    hidden.requires_grad_(), weight.requires_grad_()
    weight.grad = torch.zeros_like(weight)

    def eager():
        F.cross_entropy(F.linear(hidden, weight), targets).backward()

    def ours():
        fused_linear_cross_entropy(hidden, weight, targets, backend="eager").backward()

    fused, full = cpu_peak_bytes(ours), cpu_peak_bytes(eager)
    buffer = v * h * 4
    assert full >= 3 * n * v * 4  # what eager holds at its peak: logits, log-softmax, their gradient
    assert fused <= buffer + 2 * ce.chunk_size_for(h, n) * v * 4 + 2 * n * h * 4 + (1 << 20)
    assert fused <= full / 8, (fused, full)


def test_bf16_grad_weight_in_the_weights_dtype_holds_half_the_memory():
    """The eager path (what CPU runs; the Triton path allocates the same buffers) with bf16 inputs: with
    accumulate="weight" the (V, H) buffer is bf16 and becomes weight.grad's increment without a cast; with
    "float32" it is float32 and cast in the backward, 2 V H bytes more at least."""
    n, h, v = 256, 128, 8000
    hidden, weight, targets = _data(n, h, v, dtype=torch.bfloat16, seed=12)
    hidden.requires_grad_(), weight.requires_grad_()
    weight.grad = torch.zeros_like(weight)

    def run(accumulate):
        return cpu_peak_bytes(lambda: fused_linear_cross_entropy(hidden, weight, targets, backend="eager",
                                                                 accumulate=accumulate).backward())

    chunk = ce.chunk_size_for(h, n)
    low, high = run("weight"), run("float32")
    # bf16 buffer, one bf16 chunk and its float32 copy (the eager path's softmax), bf16 grad_hidden; beyond the
    # 1 MiB of small tensors, oneDNN's bf16 matmuls on a CPU with AMX take scratch of their own (26 and 51 KB a
    # matmul at these shapes, measured on this project's CI machine: 27 KB past 1 MiB): 256 KB more
    assert low <= 2 * v * h + 6 * chunk * v + 2 * n * h + (1 << 20) + (1 << 18), low
    assert high - low >= 2 * v * h, (low, high)
    with pytest.raises(ValueError, match="accumulate='fp8'"):
        fused_linear_cross_entropy(hidden, weight, targets, accumulate="fp8")


# ---- vocabulary-parallel, 2 gloo processes -------------------------------------------------------------

def _vocab_parallel_worker(rank: int, world: int, init_file: str) -> None:
    """One rank: each case's loss and gradients with the head split by vocabulary over the ranks, against
    the unsharded op on the full head (computed by every rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for v, reduction, dtype in ((101, "mean", torch.float32), (64, "sum", torch.float32),
                                    (101, "mean", torch.float64), (101, "mean", torch.bfloat16)):
            hidden, weight, targets = _data(23, 8, v, ignored=(0, 5, 22), dtype=dtype, seed=v)
            bounds = [v * r // world for r in range(world + 1)]  # uneven shards for v = 101: 50 + 51
            lo, hi = bounds[rank], bounds[rank + 1]
            want = _ours(hidden, weight, targets, reduction, backend="eager", chunk_size=8)
            h = hidden.clone().requires_grad_()
            w = weight[lo:hi].clone().requires_grad_()
            loss = vocab_parallel_fused_linear_cross_entropy(h, w, targets, vocab_start=lo, group=dist.group.WORLD,
                                                             reduction=reduction, chunk_size=8)
            loss.backward()
            tol = {torch.float64: {"rtol": 1e-12, "atol": 1e-14}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}
            _close((loss.detach(), h.grad, w.grad), (want[0], want[1], want[2][lo:hi]), **tol.get(dtype, {}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_matches_the_unsharded_op(tmp_path):
    """2 ranks, each this file run as a script (pytest's importlib mode leaves the test module unimportable
    by name in a torch.multiprocessing child), gloo over a file store."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [open(tmp_path / f"rank{r}.log", "w+") for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(tmp_path / "store")], env=env,
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(2)]
    try:
        for p in ranks:
            p.wait(timeout=300)
    finally:
        for p in ranks:
            p.kill()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    assert all(p.returncode == 0 for p in ranks), "\n".join(t[-3000:] for t in texts)


if __name__ == "__main__":  # one rank of test_vocab_parallel_matches_the_unsharded_op
    _vocab_parallel_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
