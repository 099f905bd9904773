"""Which implementation a kernel op runs, decided per call from its inputs.

    "triton"  the Triton kernel: on CUDA tensors, and on CPU tensors when TRITON_INTERPRET=1 (Triton's
              interpreter: how CI tests the kernels themselves, on small shapes)
    "eager"   the eager PyTorch reference in the op's module (chunked where that saves memory)

`backend="auto"` (every op's default) picks "triton" when Triton is installed and the tensors are on a
device it runs on, else "eager"; "triton" asks for the kernel and fails clearly where it cannot run;
"eager" always takes the reference. Triton is an optional dependency (`pip install trainyard[kernels]`):
without it every op is eager.

Two registrations per Triton op (`register`): `trainyard::NAME`, a `torch.library.custom_op` (opaque to
torch.compile: it calls the op and treats it as a black box), and `trainyard::NAME_traceable`, a
`torch.library.triton_op` whose kernels are launched through `torch.library.wrap_triton`, so torch.compile
(AOT autograd, inductor) traces into it and sees the Triton kernels themselves: inductor then plans the
buffers around them, launches them from its own wrapper code and fuses the neighbouring pointwise ops with
each other across the op instead of stopping at an opaque call. `Ops.pick(tensor)` takes the traceable one
for CUDA tensors (torch >= 2.6) and the opaque one elsewhere: Triton's interpreter (TRITON_INTERPRET=1, CPU)
cannot run under torch.compile's fake tensors (wrap_triton hands the interpreter's kernel back as it is, and
it reads the fake tensors' data), so CPU keeps the custom op, which compiles as one opaque call. Both share
the same Python implementation, fake implementation and autograd formula.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

BACKENDS = ("auto", "triton", "eager")
# looked up once, at import: a plain constant is what torch.compile traces through best (no cache wrapper)
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton runs its kernels on CPU tensors with its interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(tensor) -> bool:
    return triton_runs_on_device(tensor.device)


def triton_runs_on_device(device) -> bool:
    return triton_installed() and (device.type == "cuda" or (device.type == "cpu" and interpreting()))


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


def launcher(fn):
    """The Triton kernel of `fn` to launch (`launcher(fn)[grid](...)`): `jit(fn)` wrapped by
    `torch.library.wrap_triton` where torch has it. Inside a triton_op's eager call wrap_triton returns the
    kernel itself (no overhead); while torch.compile traces, the launch becomes a node of the graph
    (`triton_kernel_wrapper_functional`); under the interpreter it returns the interpreter's kernel."""
    kernel = jit(fn)
    wrap = _wrap_triton()
    return kernel if wrap is None else wrap(kernel)


@functools.cache
def _wrap_triton():
    import torch

    return getattr(torch.library, "wrap_triton", None)


def traced(tensor) -> bool:
    """Whether `tensor` is a fake (or functional) tensor of torch.compile's tracing, not one with data."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def on_device(tensor):
    """The context a kernel launch needs: the tensor's CUDA device (nothing on CPU, nor while tracing)."""
    if tensor.is_cuda and not traced(tensor):
        import torch

        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def sm_count(tensor, default: int = 132) -> int:
    """Streaming multiprocessors of `tensor`'s GPU; `default` (an H100's 132) where none can be asked: fake
    CUDA tensors in a build without CUDA (the CPU test that traces the CUDA path)."""
    import torch

    if torch.cuda.is_available():
        return _sm_count(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())
    return default


@functools.cache
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class Ops:
    """One op's two registrations (see the module docstring): `opaque` (custom_op) and `traceable`
    (triton_op; None where torch has no triton_op)."""

    opaque: object
    traceable: object | None

    def pick(self, tensor):
        """The traceable op for CUDA tensors where it exists, else the opaque one."""
        return self.traceable if (self.traceable is not None and tensor.is_cuda) else self.opaque


def register(name: str, fn: Callable, *, fake: Callable, autograd: Callable | None = None,
             setup_context: Callable | None = None) -> Ops:
    """`fn` (annotated: the schema is inferred from it) as `trainyard::name` (custom_op, with `fake`) and
    `trainyard::name_traceable` (triton_op: its fake implementation is `fn` itself, run on fake tensors, so
    `fn` must be plain torch ops and `launcher(...)` kernel launches); both get the same autograd formula."""
    import torch

    opaque = torch.library.custom_op(f"trainyard::{name}", fn, mutates_args=())
    opaque.register_fake(fake)
    traceable = None
    if hasattr(torch.library, "triton_op") and triton_installed():
        traceable = torch.library.triton_op(f"trainyard::{name}_traceable", fn, mutates_args=())
    if autograd is not None:
        for op in (opaque, traceable):
            if op is not None:
                op.register_autograd(autograd, setup_context=setup_context)
    return Ops(opaque, traceable)
