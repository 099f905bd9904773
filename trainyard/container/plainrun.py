"""A job without a launcher: the entry point as one plain `python` process on each host, as SageMaker runs a
script whose estimator has no `distribution` (`JobSpec.launcher == "python"`).

Under torchrun every process gets `RANK`, `LOCAL_RANK` and `WORLD_SIZE`, even a job of one, and libraries take
them for a distributed launch: the Hugging Face Trainer then starts NCCL on a CPU host and fails. Here the
process gets none of them; like SageMaker's PyTorch container, `MASTER_ADDR` and `MASTER_PORT` name the first
host, for a script that forms its own group from `SM_HOSTS` and `SM_CURRENT_HOST`.

Everything around the process stays as torchrun's: its output goes to
`<log_dir>/plain/attempt_0/0/{stdout,stderr}.log` (where the first-step watch and the failure report read a
rank's files) and to the driver's own output, each line prefixed `[algo-2/1]` (the host's index is the
process's rank: what SageMaker scripts take for theirs); SIGTERM, SIGINT and SIGHUP sent to the driver are
passed on to it, and the driver then exits 128+N as torchrun does.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO, TextIO

from trainyard.container.failure import RankFailure, from_rank_logs

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
TEE_DRAIN_S = 5.0  # after the process ended, how long its output may still be read


def build_plain_command(entry_point: str, entry_kind: str, args: list[str], python: str = sys.executable) -> list[str]:
    return [python, *(["-m"] if entry_kind == "module" else []), entry_point, *args]


def write_prefixed(out: TextIO, prefix: str, lines: list[bytes]) -> None:
    """`lines` (a process's output, newlines stripped or not) onto `out`, each after `prefix`."""
    # a progress bar redraws with carriage returns: each redraw is a line of its own, prefixed
    text = "".join(f"{prefix}{p}\n" for line in lines
                   for p in ([q for q in line.decode(errors="replace").rstrip("\n").split("\r") if q.strip()] or [""]))
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):  # nobody reads the driver any more: the file keeps the line
        pass


def _tee(source: BinaryIO, path: str, out: TextIO, prefix: str) -> None:
    """Each line of `source` into the file at `path` as written, and onto `out` after `prefix`, until EOF."""
    with open(path, "ab", buffering=0) as fh:
        for line in iter(source.readline, b""):
            fh.write(line)
            write_prefixed(out, prefix, [line])


def run_plain(cmd: list[str], cwd: str, *, host: str, rank: int, log_dir: str, master_addr: str,
              master_port: int) -> tuple[int, RankFailure | None]:
    """Run `cmd` as the host's one process; returns (exit status, its failure or None), as `run_torchrun`."""
    folder = os.path.join(log_dir, "plain", "attempt_0", "0")
    os.makedirs(folder, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.setdefault("MASTER_ADDR", master_addr)
    env.setdefault("MASTER_PORT", str(master_port))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    received: list[int] = []

    def forward(signum, _frame) -> None:
        received.append(signum)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    prefix = f"[{host}/{rank}] "
    tees = [threading.Thread(target=_tee, args=(stream, os.path.join(folder, name), out, prefix), daemon=True)
            for stream, name, out in ((proc.stdout, "stdout.log", sys.stdout), (proc.stderr, "stderr.log", sys.stderr))]
    for t in tees:
        t.start()
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    ended = time.time()
    for t in tees:  # a process it left behind may hold the pipes: its output then stops here
        t.join(TEE_DRAIN_S)
    if received:
        return 128 + received[0], None
    if code == 0:
        return 0, None
    return 1, from_rank_logs(host=host, rank=rank, local_rank=0, exitcode=code, when=ended,
                             stderr=os.path.join(folder, "stderr.log"))
