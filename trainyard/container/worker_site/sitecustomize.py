"""Put first on the training processes' PYTHONPATH by the driver (trainyard/container/driver.py).

A script that initialises torch.distributed and returns without `destroy_process_group()` (SageMaker's
own examples do) leaves the process group to the interpreter's teardown, where gloo's threads can still be
running: the process then aborts ("terminate called without an active exception", SIGABRT) after its work
is done, and the job fails. This calls `destroy_process_group()` at exit when the script did not, then (whoever
destroyed the group) lets gloo's worker threads free what they still hold while the interpreter is alive: even
after the script's own barrier and destroy, that aborted about 1 run in 60 of a 2-process script. Then it runs
the sitecustomize that this one hides on sys.path.

It also makes every write to stdout and stderr a whole line. The driver sets PYTHONUNBUFFERED, under which
`print` writes its text and its newline in two system calls; torchrun's log tailer then reads half a line
and another rank's (or thread's) line lands in the middle of it. Line buffering keeps output as prompt (a
write reaches the file at each newline) and hands the file one line per write.

A rank that dies of an uncaught exception, once torch.distributed is up, exits with status 1 as soon as its
traceback is printed and the script's own exit handlers have run (this one, registered first, runs last),
without the interpreter's teardown. The
teardown (freeing torch, closing the process group) takes long enough on a loaded host that the peers, whose
collectives fail the moment this rank's connections close, exit first, and torchrun then ends the raising
rank with SIGTERM: the job's FailureReason would say "killed by SIGTERM", and a retry would take it for a
killed process, not the user error it is.

In a job with hang detection (`$TRAINYARD_HEARTBEAT_DIR`, set by the driver), SIGUSR2 makes the rank write
the Python stacks of all its threads to `<dir>/stack-rank-<R>.txt` (faulthandler, from a signal handler
in C: it works while the main thread is blocked in a collective); the hang detector sends it.
"""
import atexit
import sys

for _stream in (sys.stdout, sys.stderr):
    if _stream is not None and hasattr(_stream, "reconfigure"):
        _stream.reconfigure(line_buffering=True, write_through=False)


_UNCAUGHT: list = []  # the kind of the exception the interpreter is exiting on, if any


def _end_process_group():
    import os
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    if not dist.is_initialized():  # the script destroyed its group, or never made one
        _let_gloo_threads_let_go()
        return
    if _UNCAUGHT:  # the traceback is out and the script's own exit handlers ran (registered later, run first)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting regardless
                pass
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the script's own end decides the exit status, not this cleanup
        pass
    _let_gloo_threads_let_go()


# How long the exit waits, with the GIL released, for gloo's worker threads (below)
GLOO_LET_GO_S = 0.02


def _let_gloo_threads_let_go():
    """A gloo worker thread drops the last work it ran (the barrier before `destroy_process_group()`, which holds
    the earlier all-reduces' tensors) a moment after the script's wait for it returned; freeing those tensors takes
    the GIL. When that lands in the interpreter's finalization, the thread is ended inside a C++ destructor and the
    process aborts ("terminate called without an active exception", SIGABRT) after the script's work is done: 4
    times in 238 runs of a 2-process gloo script here (torch 2.13.0; core dumps: `~AsyncBarrierWork` in
    `ProcessGroupGloo::runLoop`, `take_gil` during `Py_FinalizeEx`). This runs before finalization and gives those
    threads the GIL for a moment."""
    import time

    time.sleep(GLOO_LET_GO_S)


def _note_uncaught_exceptions():
    import sys

    previous = sys.excepthook

    def hook(kind, value, traceback):
        if not issubclass(kind, KeyboardInterrupt):
            _UNCAUGHT.append(kind)
        previous(kind, value, traceback)

    sys.excepthook = hook


def _chain():
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _stacks_on_sigusr2():
    import faulthandler
    import os
    import signal

    folder = os.environ.get("TRAINYARD_HEARTBEAT_DIR")
    if not folder:
        return
    rank = os.environ.get("RANK") or "0"  # a plain process (no launcher) is rank 0, as its heartbeat says
    try:
        os.makedirs(folder, exist_ok=True)
        # kept open for the process's life: faulthandler writes to its descriptor
        out = open(os.path.join(folder, f"stack-rank-{rank}.txt"), "w")
        faulthandler.register(signal.SIGUSR2, file=out, all_threads=True)
    except OSError:
        pass


def in_each_process():
    """What depends on the process's own variables (its RANK): run again in each process that the preload server
    (trainyard/container/preload.py) forks, after it took on that process's environment."""
    _stacks_on_sigusr2()


atexit.register(_end_process_group)
_note_uncaught_exceptions()
in_each_process()
_chain()
