"""The Trainyard image on Kubernetes: a Kubeflow PyTorchJob's `pytorch` container -> this -> the driver.

    python -m trainyard.container.kubernetes        (the container's command: sdk/backends/kubernetes/manifests.py)

The Kubernetes backend mounts the job's ConfigMap at `/etc/trainyard` (`spec.json`, the whole JobSpec, and the
contract's job-wide files), and the training operator gives every pod of the job

    MASTER_ADDR   the master pod's Service (`<job>-master-0`; `localhost` on the master itself in some versions)
    MASTER_PORT   the master container's port named `pytorchjob-port`
    RANK          the pod's rank among the pods: 0 the master, 1.. the workers (`PET_NODE_RANK` where set wins)
    WORLD_SIZE    the pods (older operators) or the pods x nprocPerNode (newer ones): either is accepted

From these and the spec this writes the driver's launch facts and the SageMaker contract for host
`algo-<RANK+1>` (`launch_facts`, pure), stages the S3 channels into `/opt/ml/input/data/<channel>` (ShardedByS3Key
as every backend shards; FSx channels are already mounted there by the pod's claim) and runs the same driver
as every other backend in this process, with `TRAINYARD_PLATFORM=kubernetes`. Nobody else uploads on
Kubernetes: the driver syncs the checkpoint, TensorBoard and profiler folders and uploads algo-1's model and
output data itself, as on EC2. A failure's reason (the driver's `/opt/ml/output/failure`) is also written to the
container's termination message (`/dev/termination-log`), where `describe()` reads it.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

from trainyard.container import driver
from trainyard.container.contract import KUBERNETES_CONFIG_DIR, PLATFORM_ENV, render_contract, write_contract
from trainyard.container.hang import HANG_WATCH_ENV
from trainyard.container.node import default_interface
from trainyard.container.staging import stage_channel
from trainyard.job.spec import JobSpec

CONFIG_ENV = "TRAINYARD_KUBERNETES_CONFIG"  # where the ConfigMap is (default /etc/trainyard)
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
TERMINATION_MAX_BYTES = 4096  # the kubelet keeps at most 4 KiB of a termination message
PLATFORM = "kubernetes"


def launch_facts(spec: JobSpec, env: dict) -> dict:
    """trainyard.json's content for this pod, from the operator's variables `env` (see the module)."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK") if not env.get(k)]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: this image runs on Kubernetes as a Kubeflow PyTorchJob "
                           "that Trainyard rendered (Estimator(..., backend='kubernetes') or to_kubernetes())")
    rank = int(env.get("PET_NODE_RANK") or env["RANK"])
    nodes = spec.instance_count
    if not 0 <= rank < nodes:
        raise RuntimeError(f"this pod has rank {rank}, the spec asks for {nodes} host(s) (ranks 0..{nodes - 1})")
    world = env.get("WORLD_SIZE")
    if world and int(world) not in (nodes, nodes * spec.processes_per_host):
        raise RuntimeError(f"WORLD_SIZE={world}, but the spec has {nodes} host(s) x {spec.processes_per_host} "
                           "process(es): the PyTorchJob's replicas or nprocPerNode were changed after rendering")
    if env.get("PET_NNODES") and env["PET_NNODES"] not in (str(nodes), f"{nodes}:{nodes}"):
        raise RuntimeError(f"PET_NNODES={env['PET_NNODES']}, the spec has {nodes} host(s)")
    return {"spec": json.loads(spec.to_json()), "host_index": rank, "master_addr": env["MASTER_ADDR"],
            "master_port": int(env["MASTER_PORT"]), "network_interface": env.get("NETWORK_INTERFACE", "eth0"),
            "num_cpus": os.cpu_count()}


def read_spec(config_dir: str) -> JobSpec:
    with open(os.path.join(config_dir, "spec.json")) as fh:
        return JobSpec.from_json(fh.read())


def stage_channels(spec: JobSpec, root: str, host_index: int, say=print) -> None:
    """S3 channels into `<root>/input/data/<channel>` (this host's share); FSx ones must be mounted there."""
    for ch in spec.channels:
        dest = f"{root}/input/data/{ch.name}"
        if ch.uri.startswith("fsx://"):
            if not os.path.isdir(dest):
                raise FileNotFoundError(f"channel {ch.name}: {ch.uri} is not mounted at {dest} (the pod's "
                                        "PersistentVolumeClaim)")
            say(f"channel {ch.name}: {ch.uri} mounted at {dest}")
            continue
        stage_channel(ch.name, ch.uri, dest, distribution=ch.distribution, host_index=host_index,
                      host_count=spec.instance_count, say=say)


def prepare(root: str, config_dir: str, env: dict, say=None) -> dict:
    """Stage this pod's channels and write its contract (trainyard.json included); returns the launch facts.
    `say` (default: print as `[algo-N] kubernetes: ...`) tells what was staged."""
    spec = read_spec(config_dir)
    job = launch_facts(spec, {"NETWORK_INTERFACE": default_interface(), **env})
    host = spec.hosts[job["host_index"]]
    say = say or (lambda m: print(f"[{host}] kubernetes: {m}", flush=True))
    say(f"pod rank {job['host_index']} of {spec.instance_count}: host {host}, master "
        f"{job['master_addr']}:{job['master_port']}")
    stage_channels(spec, root, job["host_index"], say)
    contract = render_contract(spec, job["host_index"], root=root, master_addr=job["master_addr"],
                               master_port=job["master_port"], network_interface=job["network_interface"],
                               num_cpus=job["num_cpus"])
    write_contract(contract, root)
    return job


def report_failure(root: str, path: str | None = None) -> None:
    """The driver's failure file as the container's termination message (`path`, default TERMINATION_LOG;
    best effort)."""
    try:
        with open(f"{root}/output/failure", "rb") as src, open(path or TERMINATION_LOG, "wb") as dst:
            shutil.copyfileobj(src, dst, TERMINATION_MAX_BYTES)
            dst.truncate(min(dst.tell(), TERMINATION_MAX_BYTES))
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = os.environ.get("TRAINYARD_ML_ROOT", "/opt/ml")
    config_dir = os.environ.get(CONFIG_ENV, KUBERNETES_CONFIG_DIR)
    if not os.path.exists(os.path.join(config_dir, "spec.json")):
        print(f"trainyard: no job spec at {config_dir}/spec.json: on Kubernetes the job's ConfigMap is mounted there "
              "(Estimator(..., backend='kubernetes') or to_kubernetes() renders it)", file=sys.stderr)
        return 2
    job = prepare(root, config_dir, dict(os.environ))
    os.environ[PLATFORM_ENV] = PLATFORM
    os.environ[HANG_WATCH_ENV] = "driver"  # no process sees every pod: each driver watches its own ranks
    code = driver.main(["--root", root, *argv])
    if code != 0:
        report_failure(root)
    print(f"[algo-{job['host_index'] + 1}] kubernetes: the driver exited with status {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
