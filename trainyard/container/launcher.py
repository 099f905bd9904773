"""The host's processes of a distributed job, started as torchrun starts them with a static rendezvous, without
importing torch.

torchrun's agent (`torch.distributed.run`, which the driver ran in its own process) imports torch before it
starts anything: 1.3-1.7 s of CPU on every host of every job, for an agent whose work here is fixed (a static
rendezvous: `--nnodes N --node-rank R --master-addr A --master-port P --max-restarts 0`). `run_processes` does
that work itself. Each process gets torchrun's variables:

    RANK            R * nproc + LOCAL_RANK          LOCAL_RANK, LOCAL_WORLD_SIZE   0..nproc-1, nproc
    WORLD_SIZE      N * nproc                       GROUP_RANK, GROUP_WORLD_SIZE   R, N
    ROLE_NAME       default                         ROLE_RANK, ROLE_WORLD_SIZE     RANK, WORLD_SIZE
    MASTER_ADDR     A                               MASTER_PORT                    P
    TORCHELASTIC_RUN_ID (none), TORCHELASTIC_RESTART_COUNT (0), TORCHELASTIC_MAX_RESTARTS (0),
    TORCHELASTIC_ERROR_FILE (where torchrun's `@record` writes a rank's error: it is read into the report),
    TORCH_NCCL_ASYNC_ERROR_HANDLING (1 unless set), OMP_NUM_THREADS (1 with several processes, unless set)

One difference: no agent serves the rendezvous store, so `TORCHELASTIC_USE_AGENT_STORE` is `False` and global
rank 0 serves it at MASTER_PORT, as `init_process_group("env://")` does without torchrun (srun, mp.spawn); a
script's own `tcp://` store then works as written, too. The store ends with rank 0: a rank that uses it after rank
0 has exited (a late `store.add`) fails, where torchrun's agent kept it until every host was done.

Around the processes, as torchrun's: each one writes its output to `<log_dir>/none_<random>/attempt_0/<local
rank>/{stdout,stderr}.log` (where the first-step watch and the failure report read a rank's files), which are
followed onto the driver's stdout and stderr after `[algo-2/3] ` (a slow reader of the driver never blocks a
rank); each runs in a session of its own; every `MONITOR_S` the processes are polled, and once one has failed the
others get SIGTERM, then SIGKILL after `STOP_GRACE_S`, and the launch returns 1 with the failures seen by then
(`root_cause` picks the cause). SIGTERM, SIGINT, SIGHUP and
SIGQUIT sent to the driver go on to every process (SIGKILL after `STOP_GRACE_S`), and the launch returns 128+N.

With `preload=` (the driver names trainyard's own entry modules: the built-in trainer, the pre-flight checks; and
s3fs for a trainer with checkpoints in S3) a host
of several processes forks them from one server that imported those modules once (preload.py): one import of
torch and the engine per host instead of one per process. Their files, variables, sessions, signals and statuses
are as above; the server's own output goes to `<log_dir>/<run id>_<random>/preload.log`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import TextIO

from trainyard.container.failure import RankFailure, from_rank_logs, root_cause
from trainyard.container.plainrun import TEE_DRAIN_S, write_prefixed
from trainyard.container.preload import PER_PROCESS

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
MONITOR_S = 0.2  # how often the processes are polled (torchrun's --monitor-interval here): a failure is seen by then
STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL for the processes left when one failed or the driver was stopped (torchrun's)
FOLLOW_S = 0.05  # how often a rank's output files are read for new lines
REAP_S = 10.0  # after SIGKILL, how long a process stuck in the kernel (a hung device) is waited for
RUN_ID = "none"  # TORCHELASTIC_RUN_ID: torchrun's default rendezvous id, the same on every host


def worker_env(*, local_rank: int, nproc: int, node_rank: int, nnodes: int, master_addr: str, master_port: int,
               run_id: str, environ=None) -> dict[str, str]:
    """The environment of one process: the driver's, with torchrun's variables for `local_rank`."""
    environ = os.environ if environ is None else environ
    rank, world = node_rank * nproc + local_rank, nnodes * nproc
    env = dict(environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(world),
               GROUP_RANK=str(node_rank), GROUP_WORLD_SIZE=str(nnodes), ROLE_NAME="default", ROLE_RANK=str(rank),
               ROLE_WORLD_SIZE=str(world), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
               TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
               TORCHELASTIC_USE_AGENT_STORE="False",
               TORCH_NCCL_ASYNC_ERROR_HANDLING=environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
    if nproc > 1 and "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: several processes' thread pools would fight for the cores
    return env


def follow(path: str, out: TextIO, prefix: str, done: threading.Event) -> None:
    """Each line written to the file at `path` onto `out` after `prefix`, until `done` is set and the file read to
    its end (a last line without its newline included). The rank writes to the file, as under torchrun: a slow
    reader of the driver's output never blocks it."""
    while not os.path.exists(path) and not done.is_set():
        time.sleep(FOLLOW_S)
    try:
        fh = open(path, "rb")
    except OSError:
        return
    with fh:
        pending = b""
        while True:
            ended = done.is_set()  # read once more after the end: what was written before it
            chunk = fh.read()
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                write_prefixed(out, prefix, lines)
            elif ended:
                break
            else:
                time.sleep(FOLLOW_S)
        if pending:
            write_prefixed(out, prefix, [pending])


class _Server:
    """The preload server of one launch (preload.py): started at once, importing, while the launcher goes on;
    the processes it forked, by index, and their statuses, read from its events as they come."""

    def __init__(self, cmd: tuple[list[str], list[str]], modules: list[str], cwd: str, env: dict, log: str):
        interpreter, self.argv = cmd  # `split_python`'s: the server runs the first, each process the second
        requests_r, self._requests = os.pipe()
        events_r, events_w = os.pipe()
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [*interpreter, "-m", "trainyard.container.preload", "--requests", str(requests_r),
                 "--events", str(events_w), *modules], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, pass_fds=(requests_r, events_w), start_new_session=True)
        os.close(requests_r)
        os.close(events_w)
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.read = threading.Event()  # its events read to the end: it has exited, or closed them
        threading.Thread(target=self._follow, args=(events_r,), daemon=True).start()

    def fork(self, index: int, cwd: str, env: dict, stdout: str, stderr: str) -> None:
        line = json.dumps({"index": index, "argv": self.argv, "cwd": cwd, "env": env, "stdout": stdout,
                           "stderr": stderr})
        try:
            os.write(self._requests, line.encode() + b"\n")  # a request is far below the pipe's 64 KB
        except OSError:  # it is gone already: the process's status is the server's
            pass

    def started(self) -> None:
        os.close(self._requests)  # every request is in: it reaps what it forked, then exits

    def _follow(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as events:
            for line in events:
                kind, first, second = line.split()
                if kind == b"pid":
                    self.pids[int(first)] = int(second)
                else:
                    self.codes[int(first)] = int(second)
        self.read.set()

    def status(self, index: int) -> int | None:
        pid = self.pids.get(index)
        if pid is not None and pid in self.codes:
            return self.codes[pid]
        if not self.read.is_set() or self.proc.poll() is None:
            return None
        # the server ended without this process's status: killed before it forked it, or with it (then it is
        # ended here, not left as an orphan): the process shares the server's end
        if pid is not None:
            _signal_group(pid, signal.SIGKILL)
        return self.proc.returncode or 1

    def pid(self, index: int) -> int:
        """The process's pid, or the server's until it has forked it (a signal then ends the server first)."""
        return self.pids.get(index, self.proc.pid)


def split_python(cmd: list[str]) -> tuple[list[str], list[str]] | None:
    """A python command as (the interpreter and its options, `-m MODULE ARGS` or `SCRIPT ARGS`); None for
    another program or `-c CODE`, which the preload server does not run."""
    if not cmd or not os.path.basename(cmd[0]).startswith("python"):
        return None
    i = 1
    while i < len(cmd) and cmd[i].startswith("-") and cmd[i] != "-m":
        if cmd[i].startswith("-c"):
            return None
        i += 2 if cmd[i] in ("-X", "-W") else 1
    return (cmd[:i], cmd[i:]) if i < len(cmd) else None


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)  # its session's whole group: what it started goes too
    except (ProcessLookupError, PermissionError):
        pass


class _Process:
    def __init__(self, cmd: list[str], cwd: str, env: dict, folder: str, prefix: str, *,
                 server: _Server | None = None, index: int = 0):
        os.makedirs(folder, exist_ok=True)
        self.stderr = os.path.join(folder, "stderr.log")
        self.error_file = env["TORCHELASTIC_ERROR_FILE"] = os.path.join(folder, "error.json")
        self.done = threading.Event()
        self.server, self.index, self.proc = server, index, None
        if server is not None:
            server.fork(index, cwd, env, os.path.join(folder, "stdout.log"), self.stderr)
        else:
            with open(os.path.join(folder, "stdout.log"), "wb") as stdout, open(self.stderr, "wb") as stderr:
                self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                             stderr=stderr, start_new_session=True)
        self.ended: float | None = None
        self.tails = [threading.Thread(target=follow, args=(os.path.join(folder, name), out, prefix, self.done),
                                       daemon=True)
                      for name, out in (("stdout.log", sys.stdout), ("stderr.log", sys.stderr))]
        for t in self.tails:
            t.start()

    def poll(self) -> int | None:
        code = self.proc.poll() if self.server is None else self.server.status(self.index)
        if code is not None and self.ended is None:
            self.ended = time.time()
            self.done.set()
        return code

    def wait(self, timeout: float) -> None:
        if self.server is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:  # stuck in the kernel (a hung device): the launch goes on without it
                pass
            return
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def signal(self, signum: int) -> None:
        _signal_group(self.proc.pid if self.server is None else self.server.pid(self.index), signum)

    def message(self) -> str:
        """What torchrun's `@record` wrote into its error file, if the rank used it."""
        try:
            with open(self.error_file) as fh:
                found = json.load(fh).get("message", "")
        except (OSError, ValueError, AttributeError):
            return ""
        return str(found.get("message", "")) if isinstance(found, dict) else str(found)


def _drain(processes: list[_Process]) -> None:
    """Their output read to the end into the driver's (at most TEE_DRAIN_S in all)."""
    deadline = time.monotonic() + TEE_DRAIN_S
    for p in processes:
        p.done.set()
        for t in p.tails:
            t.join(max(0.0, deadline - time.monotonic()))


def _stop(processes: list[_Process], signum: int, grace: float) -> None:
    """`signum` to every process still running, SIGKILL to those still running `grace` seconds later."""
    running = [p for p in processes if p.poll() is None]
    for p in running:
        p.signal(signum)
    deadline = time.monotonic() + grace
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = [p for p in running if p.poll() is None]
    for p in running:
        p.signal(signal.SIGKILL)
    for p in processes:
        p.wait(REAP_S)
        p.poll()


def run_processes(cmd: list[str], cwd: str, *, host: str, node_rank: int, nnodes: int, nproc: int,
                  master_addr: str, master_port: int, log_dir: str, run_id: str = RUN_ID,
                  grace: float = STOP_GRACE_S, timeout: float | None = None,
                  preload: tuple[str, ...] = ()) -> tuple[int | None, RankFailure | None]:
    """Run `cmd` as this host's `nproc` processes; returns (exit status, the root-cause failure or None), as the
    driver's torchrun launch did. Past `timeout` seconds (the pre-flight checks') the processes are stopped as on
    a failure and the status is None. With `preload` (modules; `cmd` a python command: `split_python`) and several
    processes, they are forked from one process that imported those modules once (preload.py)."""
    end = None if timeout is None else time.monotonic() + timeout
    folder = f"{run_id}_{uuid.uuid4().hex[:8]}"  # torchrun's layout: <log_dir>/<run id>_<random>/...
    if os.environ.get("PYTHON_EXEC") and cmd[0] == sys.executable:  # torchrun's way to name the interpreter
        cmd = [os.environ["PYTHON_EXEC"], *cmd[1:]]
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: received.append(signum)) for s in FORWARDED}
    processes: list[_Process] = []
    envs = [worker_env(local_rank=local, nproc=nproc, node_rank=node_rank, nnodes=nnodes, master_addr=master_addr,
                       master_port=master_port, run_id=run_id) for local in range(nproc)]
    python = split_python(cmd) if preload and nproc > 1 else None
    server = None
    try:
        if python is not None:
            common = {k: v for k, v in envs[0].items() if k not in PER_PROCESS}
            server = _Server(python, list(preload), cwd, common, os.path.join(log_dir, folder, "preload.log"))
        for local, env in enumerate(envs):
            processes.append(_Process(cmd, cwd, env, os.path.join(log_dir, folder, "attempt_0", str(local)),
                                      f"[{host}/{env['RANK']}] ", server=server, index=local))
        if server is not None:
            server.started()
        while not received:
            codes = [p.poll() for p in processes]
            if any(c not in (None, 0) for c in codes):
                failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                _stop(processes, signal.SIGTERM, grace)
                return 1, root_cause([from_rank_logs(host=host, rank=node_rank * nproc + i, local_rank=i, exitcode=c,
                                                     when=processes[i].ended or time.time(),
                                                     stderr=processes[i].stderr, message=processes[i].message())
                                      for i, c in failed])
            if all(c == 0 for c in codes):
                return 0, None
            if end is not None and time.monotonic() > end:
                _stop(processes, signal.SIGTERM, grace)
                return None, None
            time.sleep(MONITOR_S)
        _stop(processes, received[0], grace)
        return 128 + received[0], None
    finally:
        if processes:
            _stop(processes, signal.SIGKILL, 0.0)  # never leaves one behind (an exception above, a second signal)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if server is not None:  # it exits once its processes have: reaped here
            try:
                server.proc.wait(REAP_S)
            except subprocess.TimeoutExpired:
                server.proc.kill()
        _drain(processes)
