"""Which implementation a kernel op runs, decided per call from its inputs.

    "triton"  the Triton kernel: on CUDA tensors, and on CPU tensors when TRITON_INTERPRET=1 (Triton's
              interpreter: how CI tests the kernels themselves, on small shapes)
    "eager"   the eager PyTorch reference in the op's module (chunked where that saves memory)

`backend="auto"` (every op's default) picks "triton" when Triton is installed and the tensors are on a
device it runs on, else "eager"; "triton" asks for the kernel and fails clearly where it cannot run;
"eager" always takes the reference. Triton is an optional dependency (`pip install trainyard[kernels]`):
without it every op is eager.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

BACKENDS = ("auto", "triton", "eager")
# looked up once, at import: a plain constant is what torch.compile traces through best (no cache wrapper)
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton runs its kernels on CPU tensors with its interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(tensor) -> bool:
    return triton_installed() and (tensor.is_cuda or (tensor.device.type == "cpu" and interpreting()))


def choose(backend: str, tensor) -> str:
    """"triton" or "eager" for an op whose main input is `tensor`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "eager":
        return "eager"
    if triton_runs_on(tensor):
        return "triton"
    if backend == "triton":
        why = "Triton is not installed (pip install 'trainyard[kernels]')" if not triton_installed() else \
            f"the tensors are on {tensor.device}: Triton runs on CUDA, or on CPU with TRITON_INTERPRET=1"
        raise RuntimeError(f"backend='triton': {why}; use backend='auto' or 'eager'")
    return "eager"


def jit(fn):
    """`fn` jitted by Triton for the current mode, once per mode: `triton.jit` reads TRITON_INTERPRET when it
    wraps a function, so a kernel module can be imported before a test sets the switch."""
    return _jitted(fn, interpreting())


@functools.cache
def _jitted(fn, interpret: bool):
    import triton  # only here: a kernel module imports without Triton (the eager paths need none)

    return triton.jit(fn)


def on_device(tensor):
    """The context a kernel launch needs: the tensor's CUDA device (nothing on CPU)."""
    if tensor.is_cuda:
        import torch

        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()
