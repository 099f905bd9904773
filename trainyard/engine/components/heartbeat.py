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

The collectives are wrapped by `engine/distributed/watch.py` (it needs torch; this module does not). It costs
a few attribute writes per collective and one file write a second. Outside a job it does nothing.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time

ENV = "TRAINYARD_HEARTBEAT_DIR"
INTERVAL_S = 1.0
_state: dict = {"step": None, "phase": "starting", "collective": None, "seq": 0, "waiting": False}
_started = False


def set_step(step: int) -> None:
    _state["step"] = int(step)


def set_phase(phase: str) -> None:
    _state["phase"] = phase


def state() -> dict:
    return dict(_state)


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
    global _started
    env = os.environ if env is None else env
    folder = env.get(ENV)
    if _started or not folder:
        return _started
    from trainyard.engine.distributed import watch  # torch: only where a job asked for heartbeats

    watch.install(_state)
    rank = int(env.get("RANK") or 0)
    host = env.get("SM_CURRENT_HOST") or "algo-1"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank-{rank}.json")
    atexit.register(_exited, path, rank, host)
    threading.Thread(target=_beat, args=(path, rank, host), name="trainyard-heartbeat", daemon=True).start()
    _started = True
    return True
