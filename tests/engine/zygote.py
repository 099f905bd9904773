"""The engine tests' warm interpreter (tests/engine/launch.py): one process per test session that imports torch, the
engine and the named modules once, then forks every process of every multi-process test from itself.

Each launch of a test used to start, per emulated host, a launcher and a preload server (the product's,
trainyard/container/launcher.py and preload.py) whose import of torch, the engine and transformers (about 5 s of
CPU) sat in the launch's critical path: 18 launches in the slow cases. The forked processes are the preload
server's (`preload._become`: the request's files, folder, environment and argv; its caveats hold: what the
modules read when imported is the zygote's environment, the same for every launch (launch.py starts it with the
variables the tests set for their workers), and none of them reads a per-process variable then,
tests/container/test_preload.py), and the zygote itself never runs a test's code.

Protocol, on a Unix socket (argv[1], which appears once the zygote listens): a client sends one JSON request per
process, then "go"; the zygote forks them (each in a session of its own, killed when the zygote ends), answers
`{"pids": [...]}`, and, once all have ended, `{"codes": [...]}` (Popen's returncodes). The first process that
fails gets its peers killed (they would wait for it in a collective), and so does a client that goes away. A
client gone before "go" gets nothing forked. One launch at a time.
"""
import ctypes
import json
import os
import select
import signal
import socket
import sys
import time

from trainyard.container.preload import _become, _preload

PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)


def _kill(pids) -> None:
    for pid in pids:
        for kill in (os.killpg, os.kill):  # its session's group; the process itself, if it has no session yet
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _fork(requests: list[dict], listener: socket.socket, conn: socket.socket) -> tuple[dict[int, int], dict | None]:
    """(pid -> index) of the forked processes in the zygote; in a forked process, its request."""
    zygote, pids = os.getpid(), {}
    try:
        for index, request in enumerate(requests):
            pid = os.fork()
            if pid == 0:
                LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # ends with the zygote (fork clears the setting)
                if os.getppid() != zygote:
                    os._exit(1)
                os.setsid()
                listener.close()
                conn.close()
                return {}, request
            pids[pid] = index
    except BaseException:
        _kill(pids)
        raise
    return pids, None


def _launch(conn: socket.socket, listener: socket.socket) -> dict | None:
    """One client's processes; returns a request in a forked process, None in the zygote once all have ended."""
    requests, go = [], False
    with conn.makefile("rb") as lines:
        for line in lines:
            if line.strip() == b"go":
                go = True
                break
            requests.append(json.loads(line))
    if not go:
        conn.close()
        return None
    pids, request = _fork(requests, listener, conn)
    if request is not None:
        return request
    codes: dict[int, int] = {}
    ended = False  # the peers of a failed process, or of a client gone, are killed
    try:
        conn.sendall(json.dumps({"pids": list(pids)}).encode() + b"\n")
        while len(codes) < len(pids):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid:
                codes[pids[pid]] = os.waitstatus_to_exitcode(status)
                if codes[pids[pid]] != 0 and not ended:
                    ended = True
                    _kill(p for p in pids if pids[p] not in codes)
                continue
            if ended:
                time.sleep(0.05)
            elif select.select([conn], [], [], 0.05)[0] and not conn.recv(1):  # the client is gone
                ended = True
                _kill(p for p in pids if pids[p] not in codes)
        conn.sendall(json.dumps({"codes": [codes[i] for i in range(len(requests))]}).encode() + b"\n")
    except OSError:  # the client went away while it was told: its processes go too
        _kill(p for p in pids if pids[p] not in codes)
        for p in pids:
            if pids[p] not in codes:
                os.waitpid(p, 0)
    finally:
        conn.close()
    return None


def main() -> None:
    path, modules = sys.argv[1], [m for m in sys.argv[2].split(",") if m]
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # ends with the test session, however it ends
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    _preload(modules)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(1)
    os.rename(path + ".new", path)  # it exists once it listens
    while True:
        conn, _ = listener.accept()
        request = _launch(conn, listener)
        if request is not None:
            break
    _become(request)  # only a forked process gets here: the rest of its life is its script's


if __name__ == "__main__":
    main()
