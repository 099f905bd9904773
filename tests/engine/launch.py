"""Launching a multi-process test worker as two emulated hosts."""
import json
import os
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_two_hosts(worker: str, cases: list[dict], tmp_path, processes_per_host: int = 2, *,
                     hosts: int = 2, env: dict | None = None) -> dict:
    """`worker CASES OUT` under `hosts` torchrun agents (node ranks 0.., emulating hosts of
    `processes_per_host` processes), static rendezvous on loopback; the JSON the worker wrote to OUT."""
    out, port = tmp_path / "errors.json", _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # logs go to files: a pipe that nobody drains while the other agent is awaited can fill and block
    logs = [open(tmp_path / f"agent{node}.log", "w+") for node in range(hosts)]
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts), "--node-rank", str(node),
         "--nproc-per-node", str(processes_per_host), "--master-addr", "127.0.0.1", "--master-port", str(port),
         worker, json.dumps(cases), str(out)], env=env, stdout=logs[node], stderr=subprocess.STDOUT, text=True)
        for node in range(hosts)]
    try:
        for a in agents:
            a.wait(timeout=int(os.environ.get("LAUNCH_TIMEOUT", 500)))
    finally:
        for a in agents:
            a.kill()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    assert all(a.returncode == 0 for a in agents), "\n".join(t[-4000:] for t in texts)
    return json.loads(out.read_text())
