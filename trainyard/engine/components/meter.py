"""Communication meter and memory accounting.

`CommMeter` counts, while active, the communication of every parallel dimension: the collectives that go
through `torch.distributed` (FSDP2's all-gathers, reduce-scatters and all-reduces, and the two hops of
the hierarchical ones), the functional collectives DTensor issues for tensor and sequence parallelism
(`torch.distributed._functional_collectives`), and the point-to-point sends of the pipeline schedules and of
context parallelism's ring.
It records calls and bytes per kind and per group, split intra-host / inter-host by where the group's
ranks live: a group whose ranks are all on one host is intra-host; a group that spans hosts is
inter-host. A point-to-point send (a pipeline stage's, a step of the context-parallel ring) is counted as "p2p"
with the bytes sent, between this rank and its peer.

Time is what this rank spends inside a collective's call, plus, for one started with `async_op=True`, inside
its `wait()`: the communication the step waited for, not what overlapped with compute. (DTensor's
functional collectives are waited on lazily, inside the next op that reads their result: their time shows
as compute.) `totals()` splits it like the bytes, so a step's time splits into compute, intra-host and
inter-host communication.

Bytes are what this rank sends under the ring algorithm, for a full (unsharded) tensor of M bytes over
n ranks: all-gather and reduce-scatter M (n-1)/n, all-reduce 2 M (n-1)/n. docs/engine.md derives the
per-step totals of ZeRO-3, MiCS and hierarchical MiCS from these.

`model_state_bytes(model, optimizer)` is what this rank actually holds: the storage bytes of its
parameter shards, gradient shards and optimizer states. `cpu_peak_bytes(fn)` is the most CPU memory torch
allocated while `fn` ran, above what it held before (the kernels' memory tests and bench/kernels.py).
"""
from __future__ import annotations

import inspect
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from trainyard.engine.distributed.work import DelegatingWork

# name in torch.distributed -> (kind, the argument holding the full tensor, ring factor)
_METERED = {
    "all_gather_into_tensor": ("all_gather", "output_tensor", 1),
    "all_gather_single": ("all_gather", "output_tensor", 1),
    "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
    "reduce_scatter_single": ("reduce_scatter", "input", 1),
    "all_reduce": ("all_reduce", "tensor", 2),
}
# name in the functional collectives -> (kind, full-tensor size from the input: times the group size
# for a gather, the input itself for a reduction, ring factor)
_FUNCOL = {
    "all_gather_tensor": ("all_gather", True, 1),
    "all_gather_single": ("all_gather", True, 1),
    "reduce_scatter_tensor": ("reduce_scatter", False, 1),
    "reduce_scatter_single": ("reduce_scatter", False, 1),
    "all_reduce": ("all_reduce", False, 2),
}


def _group_ranks(group) -> tuple[int, ...]:
    """Global ranks of a group given as torch.distributed and the functional collectives accept it."""
    from torch.distributed.device_mesh import DeviceMesh

    if group is None:
        group = dist.group.WORLD
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        group = group[0].get_group(group[1])
    elif isinstance(group, DeviceMesh):
        group = group.get_group()
    elif isinstance(group, (list, tuple)):
        return tuple(int(r) for r in group)
    elif isinstance(group, str):
        group = torch._C._distributed_c10d._resolve_process_group(group)
    return tuple(dist.get_process_group_ranks(group))


class CommMeter:
    def __init__(self, processes_per_host: int, dims=None):
        self.processes_per_host = processes_per_host
        self.dims = dims  # a ParallelDims: totals() then also splits the bytes by mesh dimension
        self._dimensions: dict[tuple[int, ...], str] = {}  # groups are few and fixed: name each once
        self._local = threading.local()
        self.reset()

    def reset(self) -> None:
        # (kind, group ranks) -> [calls, bytes, seconds]
        self.records: dict[tuple[str, tuple[int, ...]], list] = defaultdict(lambda: [0, 0, 0.0])

    def record(self, kind: str, ranks: tuple[int, ...], full_bytes: int, factor: int) -> None:
        n = len(ranks)
        self.record_sent(kind, ranks, factor * full_bytes * (n - 1) // n if n > 1 else 0)

    def record_sent(self, kind: str, ranks: tuple[int, ...], nbytes: int) -> None:
        rec = self.records[(kind, ranks)]
        rec[0] += 1
        rec[1] += nbytes

    def record_time(self, kind: str, ranks: tuple[int, ...], seconds: float) -> None:
        self.records[(kind, ranks)][2] += seconds

    def spans_hosts(self, ranks: tuple[int, ...]) -> bool:
        return len({r // self.processes_per_host for r in ranks}) > 1

    def dimension(self, ranks: tuple[int, ...]) -> str:
        """The mesh dimension(s) a group runs along: the ones its ranks' coordinates differ in (the two
        halves of a partition group count as `dp_shard`)."""
        if ranks not in self._dimensions:
            self._dimensions[ranks] = self._name_dimension(ranks)
        return self._dimensions[ranks]

    def _name_dimension(self, ranks: tuple[int, ...]) -> str:
        if self.dims.ep > 1 and list(ranks) in self.dims.ep_groups():
            return "ep"  # expert parallelism's groups are data-parallel ranks, not a mesh dimension of their own
        coords = [self.dims.coords(r) for r in ranks]
        varying = [d for d in ("pp", "dp_replicate", "dp_shard_inter", "dp_shard_intra", "cp", "tp")
                   if len({c[d] for c in coords}) > 1]
        named = {"dp_shard" if d.startswith("dp_shard") else d for d in varying}
        if len(named) == 1:
            return named.pop()
        if named == {"dp_shard", "cp"} and len(ranks) == self.dims.shard_size:
            return "dp_shard_cp"  # a partition group with its context-parallel ranks (what MiCS shards over)
        if len(ranks) == self.dims.world_size:
            return "world"  # e.g. the trainer's loss all-reduce
        return "+".join(varying) or "self"

    def totals(self) -> dict:
        """{"intra_bytes", "inter_bytes", "intra_s", "inter_s", "by_kind": {kind: {"calls", "intra_bytes",
        "inter_bytes", "intra_s", "inter_s"}}}, and with dims "by_dim": {mesh dimension: the same less "calls"}."""
        empty = {"intra_bytes": 0, "inter_bytes": 0, "intra_s": 0.0, "inter_s": 0.0}
        out = {**empty, "by_kind": {}}
        if self.dims is not None:
            out["by_dim"] = {}
        for (kind, ranks), (calls, nbytes, seconds) in self.records.items():
            where = "inter" if self.spans_hosts(ranks) else "intra"
            k = out["by_kind"].setdefault(kind, {"calls": 0, **empty})
            k["calls"] += calls
            entries = [out, k]
            if self.dims is not None:
                entries.append(out["by_dim"].setdefault(self.dimension(ranks), dict(empty)))
            for e in entries:
                e[f"{where}_bytes"] += nbytes
                e[f"{where}_s"] += seconds
        return out

    @contextmanager
    def active(self):
        """Count collectives issued inside the block (the patch is undone on exit)."""
        # a name this torch lacks (all_gather_single is not in torch 2.11, which images may carry) is not metered
        patches = [(dist, name, self._wrap(getattr(dist, name), *spec)) for name, spec in _METERED.items()
                   if hasattr(dist, name)]
        patches += [(funcol, name, self._wrap_funcol(getattr(funcol, name), *spec)) for name, spec in _FUNCOL.items()
                    if hasattr(funcol, name)]
        patches += [(funcol, name, self._wrap_all_to_all(getattr(funcol, name), backward))
                    for name, backward in (("all_to_all_single", False), ("all_to_all_single_autograd", True))]
        # a pipeline's sends, where one is built: its schedule module is imported by the build
        # (distributed/pipeline.py), before any step; importing it here would import torch._dynamo in every process
        if "torch.distributed.pipelining.schedules" in sys.modules:
            from torch.distributed.pipelining import schedules as pp_schedules

            patches.append((pp_schedules, "_batch_p2p", self._wrap_p2p(pp_schedules._batch_p2p)))
        # the other batched sends: context parallelism's ring (engine/distributed/context.py, GroupRing)
        patches.append((dist, "batch_isend_irecv", self._wrap_batch(dist.batch_isend_irecv)))
        saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
        for module, name, fn in patches:
            setattr(module, name, fn)
        try:
            yield self
        finally:
            for module, name, fn in saved:
                setattr(module, name, fn)

    def _wrap_funcol(self, fn, kind: str, gathers: bool, factor: int):
        """DTensor's collectives: (tensor, [op or dim,] ..., group) with the group as a keyword or last."""
        signature = inspect.signature(fn)

        def metered(*args, **kwargs):
            if getattr(self._local, "depth", 0) == 0:
                bound = signature.bind(*args, **kwargs).arguments
                tensor, ranks = bound["self"], _group_ranks(bound["group"])
                nbytes = tensor.numel() * tensor.element_size() * (len(ranks) if gathers else 1)
                self.record(kind, ranks, nbytes, factor)
            return fn(*args, **kwargs)
        return metered

    def _wrap_all_to_all(self, fn, backward: bool):
        """The functional all-to-all (a mixture of experts' dispatch and combine): what this rank sends to the
        others of the group (its input rows but those it keeps); with autograd, its backward's all-to-all too (the
        gradient rows go back the other way: the output's splits)."""
        meter = self

        def sent(rows: torch.Tensor, splits, ranks) -> int:
            per_row = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
            me = ranks.index(dist.get_rank())
            counts = list(splits) if splits is not None else [rows.shape[0] // len(ranks)] * len(ranks)
            return (sum(counts) - counts[me]) * per_row

        class _CountBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, out, splits, ranks):
                ctx.splits, ctx.ranks = splits, ranks
                return out.view_as(out)

            @staticmethod
            def backward(ctx, grad):
                meter.record_sent("all_to_all", ctx.ranks, sent(grad, ctx.splits, ctx.ranks))
                return grad, None, None

        def metered(tensor, output_split_sizes, input_split_sizes, group, *args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1  # the autograd one calls the plain one: counted once
            try:
                out = fn(tensor, output_split_sizes, input_split_sizes, group, *args, **kwargs)
            finally:
                self._local.depth = depth
            if depth == 0:
                ranks = _group_ranks(group)
                self.record_sent("all_to_all", ranks, sent(tensor, input_split_sizes, ranks))
                if backward and torch.is_grad_enabled() and out.requires_grad:
                    out = _CountBackward.apply(out, output_split_sizes, ranks)
            return out
        return metered

    def _sends(self, p2p_ops) -> None:
        """Count what this rank sends in a batch of point-to-point ops, per pair of ranks."""
        me = dist.get_rank()
        for op in p2p_ops:
            if getattr(op.op, "__name__", "") == "isend":
                peer = op.peer  # P2POp keeps the peer's global rank
                self.record_sent("p2p", (min(me, peer), max(me, peer)), op.tensor.numel() * op.tensor.element_size())

    def _wrap_p2p(self, fn):
        """The pipeline schedules' batched point-to-point ops: count what this rank sends (once: the
        batch_isend_irecv a mixed batch goes through is not counted again)."""
        def metered(p2p_ops, *args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self._sends(p2p_ops)
            self._local.depth = depth + 1
            try:
                return fn(p2p_ops, *args, **kwargs)
            finally:
                self._local.depth = depth
        return metered

    def _wrap_batch(self, fn):
        """`torch.distributed.batch_isend_irecv` called by anything but the pipeline schedules (the
        context-parallel ring): what this rank sends."""
        def metered(p2p_ops, *args, **kwargs):
            if getattr(self._local, "depth", 0) == 0:
                self._sends(p2p_ops)
            return fn(p2p_ops, *args, **kwargs)
        return metered

    def _wrap(self, fn, kind: str, keyword: str, factor: int):
        signature = inspect.signature(fn)

        def metered(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:  # a collective built on another one is counted once
                bound = signature.bind(*args, **kwargs).arguments
                tensor, group = bound[keyword], bound.get("group")
                ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
                self.record(kind, ranks, tensor.numel() * tensor.element_size(), factor)
                t0 = time.perf_counter()
            self._local.depth = depth + 1
            try:
                work = fn(*args, **kwargs)
            finally:
                self._local.depth = depth
            if depth == 0 and len(ranks) > 1:  # a group of one talks to nobody
                self.record_time(kind, ranks, time.perf_counter() - t0)
                if work is not None:
                    return _TimedWork(work, lambda s: self.record_time(kind, ranks, s))
            return work
        return metered


class _TimedWork(DelegatingWork):
    """An async collective's handle that adds the time its waiter blocks to the meter."""

    def __init__(self, work: dist.Work, add) -> None:
        super().__init__(work)
        self._add = add

    def wait(self, timeout=None) -> bool:
        t0 = time.perf_counter()
        try:
            return super().wait(timeout)
        finally:
            self._add(time.perf_counter() - t0)


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


def cpu_peak_bytes(fn) -> int:
    """Peak of the bytes torch allocates on the CPU while `fn` runs, above what was allocated when it started.
    tracemalloc does not see torch's allocations and RSS depends on glibc's arenas and on pages being touched,
    so this reads the profiler's allocator events (`profile_memory=True`: every allocation and free, with its
    size) and takes the running sum's maximum: exact and deterministic."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak
