"""A host's processes forked from one process that imported their modules once: the preload server.

Every process of a job imports torch and the engine before its first step: 2-3.5 s of CPU each on the CI
machine, paid once per process, so twice per host of two processes and at every attempt. The launcher
(launcher.py, `preload=`) can instead start this server, which imports the named modules once and then forks
each process from itself, as multiprocessing's `forkserver` does with `set_forkserver_preload`: the forked
processes share the imported code and start at their own `main`.

A forked process is what a fresh `python -u -m MODULE ARGS` (or `python -u SCRIPT ARGS`) would be, except:

- the preloaded modules were imported under the server's environment: the host's, with the variables that are
  the same for every process (WORLD_SIZE, MASTER_ADDR, OMP_NUM_THREADS, ...), without those that differ
  (RANK, LOCAL_RANK, ROLE_RANK, TORCHELASTIC_ERROR_FILE). A module that reads a per-process variable when it is
  imported must not be preloaded (tests/container/test_preload.py checks that the built-in trainer reads none);
- the interpreter's hash seed is the server's, the same in every process (Python's `random` is reseeded at
  fork).

So the driver preloads only trainyard's own entry points (the built-in trainer, the pre-flight checks; with
checkpoints in S3, s3fs too, which the trainer imports to resume): a user's script runs in a fresh interpreter, as
under torchrun (it may set OMP_NUM_THREADS or TORCH_LOGS before it imports torch, which a preloaded torch would
ignore).

The protocol, on two pipes the launcher hands over (`--requests FD --events FD`): the launcher writes one JSON
request per process (argv, cwd, env, the stdout and stderr files) and closes its end. The server forks one process
per request, which says `pid <index> <pid>` once it is in a session of its own (so the launcher can signal it even
if the server is gone), then reaps them, answering `exit <pid> <status>` (Popen's returncode: -N for a signal), and
exits once all have ended (at once: without the interpreter's teardown of what it imported). The server writes only
to its own log (the launcher's `preload.log`): an import that fails there is printed and the processes are forked
regardless, to fail at the same import with the traceback in their own stderr, as they would have without the
server.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import runpy
import signal
import sys
import traceback

PER_PROCESS = ("RANK", "LOCAL_RANK", "ROLE_RANK", "TORCHELASTIC_ERROR_FILE")  # what differs between a host's processes


def _preload(modules: list[str]) -> None:
    """Import `modules`, with the garbage collector off meanwhile, then frozen: torch and the engine make some 280k
    objects that all live on, so the collections during their import find nothing (0.6-0.9 s of CPU of the 3-4 s
    an import takes on the CI machine), and with the objects frozen the processes forked from here never traverse
    them again (a full collection took 0.16 s; the trainer runs one at its end) nor copy their pages to do so. What
    must find objects through `gc.get_objects()` does so during the imports (the engine's lazy_dynamo.defer)."""
    gc.disable()
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - each process imports it again, and fails there with its own traceback
                traceback.print_exc()
    finally:
        gc.freeze()
        gc.enable()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def _serve(requests_fd: int, events_fd: int) -> dict:
    """Fork one process per request; in a forked process returns its request, in the server never returns."""
    requests = os.fdopen(requests_fd, "rb")
    events = os.fdopen(events_fd, "wb", buffering=0)
    children: set[int] = set()
    for index, line in enumerate(requests):
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # it says its own pid, once in its own session: were the server killed meanwhile, the
            os.setsid()  # launcher still knows whom to end
            events.write(f"pid {index} {os.getpid()}\n".encode())
            requests.close()
            events.close()
            return request
        children.add(pid)
    requests.close()
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        children.discard(pid)
        try:
            events.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:  # the launcher is gone: nobody reads the status any more
            pass
    # without the interpreter's teardown of the preloaded modules (torch: 0.5-1 s of CPU), which the launcher
    # would wait for after the last process ended: the server holds nothing that needs closing
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _become(request: dict) -> None:
    """This forked process becomes the request's: its files, directory, environment and argv."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignored it: a process's own default
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    hook = getattr(sys.modules.get("sitecustomize"), "in_each_process", None)  # worker_site's, run at the server's
    if hook is not None:                                                        # start under no RANK: again here
        hook()
    argv = request["argv"]  # ["-m", module, *args] or [script, *args]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file, as `python -m` does
        # the entry module runs afresh as __main__ (its imports stay loaded: that is the saving); left in
        # sys.modules, runpy would warn that it was imported before it ran
        sys.modules.pop(argv[1], None)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT`: the script's folder first
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("modules", nargs="*")
    args = parser.parse_args()
    for signum in (signal.SIGINT, signal.SIGHUP):  # the launcher ends the processes; the server ends after them
        signal.signal(signum, signal.SIG_IGN)
    _preload(args.modules)
    request = _serve(args.requests, args.events)
    _become(request)  # only a forked process gets here: the rest of its life is its module's


if __name__ == "__main__":
    main()
