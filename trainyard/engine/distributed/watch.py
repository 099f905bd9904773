"""torch.distributed's collectives wrapped so that a rank says where it blocks: the heartbeat's `collective`,
`seq` and `waiting` (engine/components/heartbeat.py keeps them and writes the file; this module needs torch).

`install(state)` replaces, in `torch.distributed` and `distributed_c10d` (torch's own code calls some through
the latter), each collective and point-to-point call by one that counts it and marks the rank as inside it,
and an async call's work by one whose `wait()` does; DTensor's functional collectives are counted when issued
and their `wait_tensor` marks the wait. Once per process.
"""
from __future__ import annotations

import functools

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from trainyard.engine.distributed.work import DelegatingWork

# the collectives and point-to-point calls of torch.distributed that a rank can block in
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
               "reduce_scatter_single", "all_gather", "all_gather_object",
               "broadcast", "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "all_to_all",
               "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "monitored_barrier")
# DTensor's collectives (torch.distributed._functional_collectives): issued at once, waited for in
# `wait_tensor` when the result is first used (a sharded gradient's norm, a tensor-parallel layer's output)
FUNCTIONAL = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
              "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced",
              "all_gather_into_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
              "permute_tensor")

_state: dict = {"collective": None, "seq": 0, "waiting": False}  # install() puts the heartbeat's here


class _Waited(DelegatingWork):
    """An async collective's work: its `wait()` counts as being inside the collective."""

    def __init__(self, work, name: str, seq: int):
        super().__init__(work)
        self._name, self._seq = name, seq

    def wait(self, timeout=None) -> bool:
        _state.update(collective=self._name, seq=self._seq, waiting=True)
        try:
            return super().wait(timeout)
        finally:
            _state["waiting"] = False


def _tracked(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        seq = _state["seq"] + 1
        _state.update(collective=name, seq=seq, waiting=True)
        try:
            out = fn(*args, **kwargs)
        finally:
            _state["waiting"] = False
        if out is not None and hasattr(out, "wait") and not isinstance(out, (list, tuple)):
            return _Waited(out, name, seq)
        if isinstance(out, list) and out and all(hasattr(w, "wait") for w in out):  # batch_isend_irecv
            return [_Waited(w, name, seq) for w in out]
        return out
    call.__trainyard_heartbeat__ = True
    return call


def _issued(name: str, fn):
    """A functional collective: counted and named when issued; the rank waits in `wait_tensor` (_waits)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _state.update(collective=name, seq=_state["seq"] + 1)
        return fn(*args, **kwargs)
    call.__trainyard_heartbeat__ = True
    return call


def _waits(fn):
    """`wait_tensor`: inside the last functional collective issued until its result is there."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _state["waiting"] = True
        try:
            return fn(*args, **kwargs)
        finally:
            _state["waiting"] = False
    call.__trainyard_heartbeat__ = True
    return call


def install(state: dict) -> None:
    """Wrap the collectives to keep `state`'s collective, seq and waiting (the heartbeat's dict)."""
    global _state
    _state = state
    for name in COLLECTIVES:  # both names: torch's own code calls some through distributed_c10d
        fn = getattr(c10d, name, None) or getattr(dist, name, None)
        if fn is None or getattr(fn, "__trainyard_heartbeat__", False):
            continue
        tracked = _tracked(name, fn)
        for module in (dist, c10d):
            if getattr(module, name, None) is fn:
                setattr(module, name, tracked)
    for name in FUNCTIONAL:
        fn = getattr(funcol, name, None)
        if fn is not None and not getattr(fn, "__trainyard_heartbeat__", False):
            setattr(funcol, name, _issued(name, fn))
    if not getattr(funcol.wait_tensor, "__trainyard_heartbeat__", False):
        funcol.wait_tensor = _waits(funcol.wait_tensor)
