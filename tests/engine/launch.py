"""Launching a multi-process test worker as emulated hosts: every process of `hosts` x `processes_per_host`, with
the variables torchrun (and the product's launcher, trainyard/container/launcher.py `worker_env`) gives it, forked
from the session's warm interpreter (tests/engine/zygote.py), which imported torch, the engine and `preload` once."""
import atexit
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from trainyard.container.launcher import worker_env

# what every worker imports first (torch and the engine, and torch's pipelining, which the pipeline cases of most
# workers import at their first schedule: with torch._dynamo, 0.9 s of CPU a process, so the workers run with the
# real package, as a pipelined job does; the deferred stand-in of engine/components/lazy_dynamo.py is checked by
# test_lazy_dynamo and runs in every job of the slow cases); a worker's own imports come after, in each process
PRELOAD = ("trainyard.engine.api", "torch.distributed.pipelining")
# and a worker of Hugging Face models: transformers' model code (2.5 s of CPU a process; it reads no variable that
# differs between a host's processes when it is imported) and peft's
HF = PRELOAD + ("transformers.modeling_utils", "peft")
ZYGOTE = os.path.join(os.path.dirname(__file__), "zygote.py")
_ZYGOTES: dict[tuple[str, ...], tuple[subprocess.Popen, str]] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _zygote(preload: tuple[str, ...]) -> str:
    """The socket of this session's zygote that preloaded `preload` (started on first use, ended at exit)."""
    found = _ZYGOTES.get(preload)
    if found is not None and found[0].poll() is None:
        return found[1]
    folder = tempfile.mkdtemp(prefix="trainyard-zygote-")
    path = os.path.join(folder, "socket")
    # what the modules read when imported is this environment, the same for every launch: the workers' threads, and
    # no model hub (there is none here; test_weights sets it for its workers, and huggingface_hub reads it on import)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = os.path.join(folder, "zygote.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-u", ZYGOTE, path, ",".join(preload)], env=env, cwd=os.getcwd(),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    atexit.register(shutil.rmtree, folder, True)
    atexit.register(proc.kill)  # (the last registered runs first) its processes end with it
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the test zygote did not start: {_tail(log)}")
        time.sleep(0.05)
    _ZYGOTES[preload] = (proc, path)
    return path


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - n))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def run_on_two_hosts(worker: str, cases: list[dict], tmp_path, processes_per_host: int = 2, *,
                     hosts: int = 2, env: dict | None = None, preload: tuple[str, ...] = PRELOAD) -> dict:
    """`worker CASES OUT` as `hosts` emulated hosts (node ranks 0..) of `processes_per_host` processes each, static
    rendezvous on loopback, forked from a zygote that imported `preload`; the JSON the worker wrote to OUT."""
    out, port = tmp_path / "errors.json", _free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    requests, logs = [], []
    for node in range(hosts):
        for local in range(processes_per_host):
            folder = tmp_path / f"agent{node}-logs" / str(local)
            folder.mkdir(parents=True, exist_ok=True)
            penv = worker_env(local_rank=local, nproc=processes_per_host, node_rank=node, nnodes=hosts,
                              master_addr="127.0.0.1", master_port=port, run_id="none", environ=base)
            penv["TORCHELASTIC_ERROR_FILE"] = str(folder / "error.json")
            logs.append((penv["RANK"], str(folder / "stderr.log")))
            requests.append({"argv": [worker, json.dumps(cases), str(out)], "cwd": os.getcwd(), "env": penv,
                             "stdout": str(folder / "stdout.log"), "stderr": str(folder / "stderr.log")})
    timeout = int(os.environ.get("LAUNCH_TIMEOUT", 500))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(_zygote(preload))
        conn.sendall(b"".join(json.dumps(r).encode() + b"\n" for r in requests) + b"go\n")
        answers, buffer, deadline = [], b"", time.monotonic() + timeout
        while len(answers) < 2 and time.monotonic() < deadline:
            if select.select([conn], [], [], 1.0)[0]:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                answers += [json.loads(line) for line in lines if line]
    # the zygote kills the processes of a client that closed its end before they ended (a timeout here)
    codes = answers[1]["codes"] if len(answers) == 2 else None
    if codes is None:  # past the timeout, or the zygote itself ended
        proc, path = _ZYGOTES[preload]
        failed = f"no exit statuses after {timeout} s" if proc.poll() is None else \
            f"the test zygote ended ({proc.returncode}): {_tail(os.path.join(os.path.dirname(path), 'zygote.log'))}"
    else:
        failed = [f"rank {r}: {c}" for (r, _), c in zip(logs, codes) if c != 0]
    first = sorted(range(len(logs)), key=lambda i: codes is None or codes[i] in (0, -9))  # who failed, then who was
    assert codes is not None and not failed, f"{failed}\n" + "\n".join(               # killed for it
        f"--- rank {logs[i][0]} stderr ---\n{_tail(logs[i][1])}" for i in first)
    return json.loads(out.read_text())
