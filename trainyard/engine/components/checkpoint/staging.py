"""The copy of the state that an asynchronous save uploads, made in a thread of its own while the loop goes on.

With an accelerator, DCP's `DefaultStager` copies into pinned host memory on a stream of its own. On a host without
one, `HostCopies` copies tensor by tensor with `Tensor.copy_`, which lets go of the GIL while it copies: DCP's stager
copies whole storages holding it (`UntypedStorage.copy_`), so the loop's own thread stood still for the whole copy
of the state (~40 ms of 120 MB, on the bench's 2-core host), wherever it happened to be."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def stager():
    """The stager of a host: `DefaultStager` with an accelerator, `HostCopies` without."""
    if not torch.accelerator.is_available():
        return HostCopies()
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=True))


class HostCopies:
    """`stage(state)`: a future of a copy of `state` (nested dicts, lists and tuples of tensors and DTensors; other
    values are kept as they are: numbers and strings do not change in place). Each tensor is copied into a buffer kept
    for its place in the state from one save to the next (a new one where its shape, stride or dtype changed), so a
    save after the first allocates nothing; a DTensor's local shard is copied and given the same mesh, placements
    and global shape. A tensor met twice in one state (tied weights) is copied once. So a copy holds until the next
    `stage`: `AsyncSaver.save` waits for the upload of the last one first."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-copy")
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, state: dict[str, Any]) -> Future:
        return self._executor.submit(self._stage, state)

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        return self._copy(state, (), {})

    @torch.no_grad()
    def _copy(self, value: Any, where: tuple, seen: dict[int, Any]) -> Any:
        if isinstance(value, dict):
            return {k: self._copy(v, (*where, k), seen) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(v, (*where, i), seen) for i, v in enumerate(value))
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in seen:
            return seen[id(value)]
        if isinstance(value, DTensor):
            local = self._buffer(value.to_local(), where)
            copy = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        else:
            copy = self._buffer(value, where)
        seen[id(value)] = copy
        return copy

    def _buffer(self, tensor: torch.Tensor, where: tuple) -> torch.Tensor:
        buffer = self._buffers.get(where)
        if (buffer is None or buffer.shape != tensor.shape or buffer.stride() != tensor.stride()
                or buffer.dtype != tensor.dtype):
            buffer = self._buffers[where] = torch.empty_like(tensor, device="cpu")  # its strides, where dense
        return buffer.copy_(tensor)
