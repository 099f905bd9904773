"""Launching a multi-process test worker as two emulated hosts: one launcher per host (the product's,
trainyard/container/launcher.py, as a job's driver runs it), its processes forked from a server that imported
torch and the engine once (container/preload.py). Run as a script, this file is one host's launcher."""
import argparse
import json
import os
import socket
import subprocess
import sys

# what every worker imports first (torch and the engine); a worker's own imports come after, in each process
PRELOAD = ("trainyard.engine.api",)
# and a worker of Hugging Face models: transformers' model code (2.5 s of CPU a process; it reads no variable that
# differs between a host's processes when it is imported) and peft's
HF = PRELOAD + ("transformers.modeling_utils", "peft")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_two_hosts(worker: str, cases: list[dict], tmp_path, processes_per_host: int = 2, *,
                     hosts: int = 2, env: dict | None = None, preload: tuple[str, ...] = PRELOAD) -> dict:
    """`worker CASES OUT` under `hosts` launchers (node ranks 0.., emulating hosts of `processes_per_host`
    processes, forked from a server that imported `preload`), static rendezvous on loopback; the JSON the worker
    wrote to OUT."""
    out, port = tmp_path / "errors.json", _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # logs go to files: a pipe that nobody drains while the other agent is awaited can fill and block
    logs = [open(tmp_path / f"agent{node}.log", "w+") for node in range(hosts)]
    agents = [subprocess.Popen(
        [sys.executable, __file__, "--nnodes", str(hosts), "--node-rank", str(node), "--nproc-per-node",
         str(processes_per_host), "--master-port", str(port), "--log-dir", str(tmp_path / f"agent{node}-logs"),
         "--preload", ",".join(preload), worker, json.dumps(cases), str(out)],
        env=env, stdout=logs[node], stderr=subprocess.STDOUT, text=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description="one emulated host's launcher of a test worker")
    for flag in ("--nnodes", "--node-rank", "--nproc-per-node", "--master-port"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--preload", default=",".join(PRELOAD))
    parser.add_argument("worker")
    parser.add_argument("args", nargs="*")
    a = parser.parse_args()
    from trainyard.container.launcher import run_processes

    code, failure = run_processes([sys.executable, "-u", a.worker, *a.args], os.getcwd(),
                                  host=f"algo-{a.node_rank + 1}", node_rank=a.node_rank, nnodes=a.nnodes, nproc=a.nproc_per_node,
                                  master_addr="127.0.0.1", master_port=a.master_port, log_dir=a.log_dir,
                                  preload=tuple(a.preload.split(",")))
    if failure is not None:
        print(failure.reason(), file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
