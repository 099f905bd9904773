"""Heartbeats: what each rank is doing, for the job's hang detection (trainyard/container/hang.py).

In a job (the driver sets `$TRAINYARD_HEARTBEAT_DIR`), `start()` makes every rank keep one small JSON file,
`<dir>/rank-<R>.json`, rewritten every `INTERVAL_S` by a thread of its own:

    {"rank": 3, "host": "algo-2", "pid": 4242, "time": 1764000000.1, "step": 41, "phase": "backward",
     "collective": "all_gather_into_tensor", "seq": 5123, "waiting": true}

- `step` and `phase` are set by the engine: the built-in trainer's step, `forward`/`backward` around each
  micro-batch (engine/distributed/parallelize.py), `optimizer`, `checkpoint`, `data`; a user loop on the
  engine API gets `forward`/`backward`/`checkpoint` from the API calls and can say its step with
  `trainyard.engine.mark_step(k)`.
- `collective` and `seq` are the last collective this rank issued through `torch.distributed` and its
  number (this process's count of collectives); `waiting` is true while the rank is inside the call, or
  inside `wait()` of one started asynchronously, or inside `wait_tensor` of DTensor's functional collectives
  (a sharded gradient's norm, a tensor-parallel layer): where a rank blocks when a peer does not come.
- `time` is when the thread last wrote: it stops when the process stops (SIGSTOP, a debugger, a C call that
  holds the GIL), which is how the detector tells the rank at fault from the ranks waiting for it.

It costs a few attribute writes per collective and one file write a second. Outside a job it does nothing.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time

ENV = "TRAINYARD_HEARTBEAT_DIR"
INTERVAL_S = 1.0
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

_state: dict = {"step": None, "phase": "starting", "collective": None, "seq": 0, "waiting": False}
_started = False


def set_step(step: int) -> None:
    _state["step"] = int(step)


def set_phase(phase: str) -> None:
    _state["phase"] = phase


def state() -> dict:
    return dict(_state)


def _waited_class():
    from trainyard.engine.distributed.work import DelegatingWork

    class Waited(DelegatingWork):
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

    return Waited


_Waited = None  # the class, made by start() (it needs torch)


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


def _write(path: str, rank: int, host: str) -> None:
    doc = {"rank": rank, "host": host, "pid": os.getpid(), "time": time.time(), **_state}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)


def _try_write(path: str, rank: int, host: str) -> None:
    try:
        _write(path, rank, host)
    except OSError:
        pass  # the folder went away (the job is ending), or its disk is full: nothing to report to


def _beat(path: str, rank: int, host: str) -> None:
    while True:
        _try_write(path, rank, host)
        time.sleep(INTERVAL_S)


def _exited(path: str, rank: int, host: str) -> None:
    set_phase("exited")
    _try_write(path, rank, host)


def start(env: dict | None = None) -> bool:
    """Start this rank's heartbeat when the job asks for one; True if it runs (once per process)."""
    global _started, _Waited
    env = os.environ if env is None else env
    folder = env.get(ENV)
    if _started or not folder:
        return _started
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _Waited = _waited_class()
    for name in COLLECTIVES:  # both names: torch's own code calls some through distributed_c10d
        fn = getattr(c10d, name, None) or getattr(dist, name, None)
        if fn is None or getattr(fn, "__trainyard_heartbeat__", False):
            continue
        tracked = _tracked(name, fn)
        for module in (dist, c10d):
            if getattr(module, name, None) is fn:
                setattr(module, name, tracked)
    import torch.distributed._functional_collectives as funcol

    for name in FUNCTIONAL:
        fn = getattr(funcol, name, None)
        if fn is not None and not getattr(fn, "__trainyard_heartbeat__", False):
            setattr(funcol, name, _issued(name, fn))
    if not getattr(funcol.wait_tensor, "__trainyard_heartbeat__", False):
        funcol.wait_tensor = _waits(funcol.wait_tensor)
    rank = int(env.get("RANK") or 0)
    host = env.get("SM_CURRENT_HOST") or "algo-1"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank-{rank}.json")
    atexit.register(_exited, path, rank, host)
    threading.Thread(target=_beat, args=(path, rank, host), name="trainyard-heartbeat", daemon=True).start()
    _started = True
    return True
