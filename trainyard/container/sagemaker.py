"""The Trainyard image on SageMaker: `train` (SageMaker's command) -> this -> the driver.

SageMaker runs the image as `docker run <image> train` after writing its own contract under /opt/ml
(resourceconfig.json: this host's name, every host's, the network interface; hyperparameters.json,
inputdataconfig.json, checkpointconfig.json, the channels already downloaded). This reads the job's spec
from `$TRAINYARD_SPEC_URI` (the SageMaker backend uploaded it, sdk/backends/sagemaker/backend.py), writes the driver's
launch facts (`trainyard.json`: spec, host index, rendezvous on algo-1) and runs the same driver as every
other backend. SageMaker itself stages the channels, syncs the checkpoint and TensorBoard folders and uploads
/opt/ml/model and /opt/ml/output/data at the end; `$TRAINYARD_PLATFORM=sagemaker` tells the driver so, and it
leaves those to SageMaker.

The driver tells SageMaker from EC2 by what the contract holds: on EC2 the node agent writes trainyard.json
before the driver runs; here SageMaker's resourceconfig.json is there and trainyard.json is not.
"""
from __future__ import annotations

import json
import os
import sys

from trainyard.container import driver
from trainyard.container.contract import CONFIG_DIR, JOB_FILE, PLATFORM_ENV, SPEC_URI_ENV
from trainyard.container.hang import HANG_WATCH_ENV
from trainyard.job import storage
from trainyard.job.jsonio import write_json
from trainyard.job.spec import JobSpec

MASTER_PORT = 7777  # SageMaker's containers talk freely inside the job's network


def on_sagemaker(root: str) -> bool:
    """SageMaker wrote its resource config and nobody wrote Trainyard's launch facts."""
    return os.path.exists(f"{root}/{CONFIG_DIR}/resourceconfig.json") and not os.path.exists(f"{root}/{JOB_FILE}")


def prepare(root: str, env: dict | None = None) -> dict:
    """Write `trainyard.json` for this host from SageMaker's contract and the spec; returns its content."""
    env = os.environ if env is None else env
    uri = env.get(SPEC_URI_ENV)
    if not uri:
        raise RuntimeError(f"{SPEC_URI_ENV} is not set: this image runs on SageMaker when Trainyard's SageMaker "
                           "backend created the job (Estimator(..., backend='sagemaker'))")
    with open(f"{root}/{CONFIG_DIR}/resourceconfig.json") as fh:
        resources = json.load(fh)
    spec = JobSpec.from_json(storage.get_bytes(uri).decode())
    hosts = sorted(resources["hosts"], key=lambda h: int(h.rsplit("-", 1)[-1]))
    if len(hosts) != spec.instance_count:
        raise RuntimeError(f"SageMaker started {len(hosts)} host(s), the spec at {uri} asks for {spec.instance_count}")
    job = {"spec": json.loads(spec.to_json()), "host_index": hosts.index(resources["current_host"]),
           "master_addr": hosts[0], "master_port": MASTER_PORT,
           "network_interface": resources.get("network_interface_name", "eth0"), "num_cpus": os.cpu_count()}
    write_json(f"{root}/{JOB_FILE}", job)
    return job


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = os.environ.get("TRAINYARD_ML_ROOT", "/opt/ml")
    if argv[:1] == ["train"]:
        argv = argv[1:]
    if not on_sagemaker(root):
        print(f"trainyard: no SageMaker contract at {root}/{CONFIG_DIR}/resourceconfig.json (or {JOB_FILE} is there "
              "already): on EC2 the node agent runs the driver", file=sys.stderr)
        return 2
    prepare(root)
    os.environ[PLATFORM_ENV] = "sagemaker"
    os.environ[HANG_WATCH_ENV] = "driver"  # no process sees every host: each driver watches its own ranks
    return driver.main(["--root", root, *argv])


if __name__ == "__main__":
    sys.exit(main())
