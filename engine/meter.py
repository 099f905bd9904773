"""Communication meter and memory accounting.

`CommMeter` counts, while active, every collective that goes through `torch.distributed` (FSDP2's
all-gathers, reduce-scatters and all-reduces, and the two hops of the hierarchical ones): calls and
bytes per kind and per group, split intra-host / inter-host by where the group's ranks live. A group
whose ranks are all on one host is intra-host; a group that spans hosts is inter-host.

Bytes are what this rank sends under the ring algorithm, for a full (unsharded) tensor of M bytes over
n ranks: all-gather and reduce-scatter M (n-1)/n, all-reduce 2 M (n-1)/n. docs/engine.md derives the
per-step totals of ZeRO-3, MiCS and hierarchical MiCS from these.

`model_state_bytes(model, optimizer)` is what this rank actually holds: the storage bytes of its
parameter shards, gradient shards and optimizer states.
"""
from __future__ import annotations

import inspect
import threading
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

# name in torch.distributed -> (kind, the argument holding the full tensor, ring factor)
_METERED = {
    "all_gather_into_tensor": ("all_gather", "output_tensor", 1),
    "all_gather_single": ("all_gather", "output_tensor", 1),
    "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
    "reduce_scatter_single": ("reduce_scatter", "input", 1),
    "all_reduce": ("all_reduce", "tensor", 2),
}


class CommMeter:
    def __init__(self, processes_per_host: int):
        self.processes_per_host = processes_per_host
        self._local = threading.local()
        self.reset()

    def reset(self) -> None:
        # (kind, group ranks) -> [calls, bytes]
        self.records: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(lambda: [0, 0])

    def record(self, kind: str, ranks: tuple[int, ...], full_bytes: int, factor: int) -> None:
        n = len(ranks)
        rec = self.records[(kind, ranks)]
        rec[0] += 1
        rec[1] += factor * full_bytes * (n - 1) // n if n > 1 else 0

    def spans_hosts(self, ranks: tuple[int, ...]) -> bool:
        return len({r // self.processes_per_host for r in ranks}) > 1

    def totals(self) -> dict:
        """{"intra_bytes", "inter_bytes", "by_kind": {kind: {"calls", "intra_bytes", "inter_bytes"}}}."""
        out = {"intra_bytes": 0, "inter_bytes": 0, "by_kind": {}}
        for (kind, ranks), (calls, nbytes) in self.records.items():
            where = "inter_bytes" if self.spans_hosts(ranks) else "intra_bytes"
            k = out["by_kind"].setdefault(kind, {"calls": 0, "intra_bytes": 0, "inter_bytes": 0})
            k["calls"] += calls
            k[where] += nbytes
            out[where] += nbytes
        return out

    @contextmanager
    def active(self):
        """Count collectives issued inside the block (the patch is undone on exit)."""
        saved = {name: getattr(dist, name) for name in _METERED}
        for name, spec in _METERED.items():
            setattr(dist, name, self._wrap(saved[name], *spec))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)

    def _wrap(self, fn, kind: str, keyword: str, factor: int):
        signature = inspect.signature(fn)

        def metered(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:  # a collective built on another one is counted once
                bound = signature.bind(*args, **kwargs).arguments
                tensor, group = bound[keyword], bound.get("group")
                ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
                self.record(kind, ranks, tensor.numel() * tensor.element_size(), factor)
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth
        return metered


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Storage bytes this rank holds for parameters, gradients and optimizer states (each storage once)."""
    seen: set[int] = set()

    def size(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        storage = _local(t).untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    params = sum(size(p) for p in model.parameters())
    grads = sum(size(p.grad) for p in model.parameters())
    optim = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            optim += sum(size(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"param_bytes": params, "grad_bytes": grads, "optim_bytes": optim,
            "model_state_bytes": params + grads + optim}
