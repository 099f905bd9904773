"""SageMaker's container contract, rendered by ONE function shared by every backend.

`render_contract(spec, host_index, ...)` returns, for one host, the files under the `/opt/ml`-shaped
root and the environment a training script sees. Backends write the files with `write_contract`; the
driver in the container renders the same contract again from `trainyard.json` to get the environment,
the way SageMaker's training toolkit derives `SM_*` from the config files. `render_contract` is pure:
no I/O, no clock.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainyard.sdk.spec import JobSpec

GROUP_NAME = "homogeneousCluster"  # SageMaker's instance group name for single-group jobs
LOG_LEVEL = 20  # logging.INFO, what SageMaker passes as SM_LOG_LEVEL by default
CONFIG_DIR = "input/config"
JOB_FILE = f"{CONFIG_DIR}/trainyard.json"  # Trainyard's own file: the spec and launch facts
DIRS = (
    "input/config", "input/data", "model", "output/data", "output/intermediate", "code", "checkpoints",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class HostContract:
    files: dict[str, str]
    """Path relative to the root -> text content."""
    dirs: tuple[str, ...]
    """Directories (relative to the root) that must exist before the driver starts."""
    env: dict[str, str]
    """SM_* and friends, for the training processes."""


def hp_json(value: Any) -> str:
    """How SageMaker writes a hyperparameter in hyperparameters.json: every value JSON-encoded."""
    return json.dumps(value)


def hp_arg(value: Any) -> str:
    """How a hyperparameter reaches the script's argv and SM_HP_*: strings as they are, the rest as
    compact JSON (so False arrives as 'false', never the truthy string 'False' alone)."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def user_args(hyperparameters: dict[str, Any]) -> list[str]:
    """`--name value` pairs, names sorted, as SageMaker passes them."""
    args: list[str] = []
    for name in sorted(hyperparameters):
        args += [f"--{name}", hp_arg(hyperparameters[name])]
    return args


def render_contract(
    spec: "JobSpec",
    host_index: int,
    *,
    root: str = "/opt/ml",
    master_addr: str = "algo-1",
    master_port: int = 7777,
    network_interface: str = "eth0",
    num_cpus: int | None = None,
) -> HostContract:
    """The contract of host `algo-<host_index+1>` of `spec`, with the `/opt/ml` tree at `root`."""
    from trainyard.sdk import catalog
    from trainyard.sdk.distribution import normalize

    if not 0 <= host_index < spec.instance_count:
        raise ValueError(f"host_index {host_index} outside 0..{spec.instance_count - 1}")
    if spec.job_name is None:
        raise ValueError("the spec has no job_name yet")
    root = root.rstrip("/") or "/"
    itype = catalog.lookup(spec.instance_type)
    instance_type = "local" if itype.name == catalog.LOCAL else f"ml.{itype.name}"
    hosts = spec.hosts
    current = hosts[host_index]
    config_dir = f"{root}/{CONFIG_DIR}"
    channels = sorted(c.name for c in spec.channels)

    resource_config = {
        "current_host": current,
        "current_instance_type": instance_type,
        "current_group_name": GROUP_NAME,
        "hosts": hosts,
        "instance_groups": [{"instance_group_name": GROUP_NAME, "instance_type": instance_type, "hosts": hosts}],
        "network_interface_name": network_interface,
    }
    input_data_config = {
        c.name: {"TrainingInputMode": c.input_mode, "S3DistributionType": c.distribution, "RecordWrapperType": "None"}
        for c in sorted(spec.channels, key=lambda c: c.name)
    }
    files = {
        f"{CONFIG_DIR}/hyperparameters.json": json.dumps({k: hp_json(v) for k, v in spec.hyperparameters.items()}),
        f"{CONFIG_DIR}/resourceconfig.json": json.dumps(resource_config),
        f"{CONFIG_DIR}/inputdataconfig.json": json.dumps(input_data_config),
        JOB_FILE: json.dumps(
            {
                "spec": spec.model_dump(mode="json"),
                "host_index": host_index,
                "master_addr": master_addr,
                "master_port": master_port,
                "network_interface": network_interface,
                "num_cpus": num_cpus,
            },
            indent=1,
        ),
    }
    if spec.checkpoint_s3_uri:
        files[f"{CONFIG_DIR}/checkpointconfig.json"] = json.dumps(
            {"LocalPath": _under_root(spec.checkpoint_local_path, root), "S3Uri": spec.checkpoint_s3_uri}
        )

    args = user_args(spec.hyperparameters)
    module_name = spec.entry_point.removesuffix(".py") if spec.entry_kind == "script" else spec.entry_point
    training_env: dict[str, Any] = {
        "additional_framework_parameters": {},
        "channel_input_dirs": {c: f"{root}/input/data/{c}" for c in channels},
        "current_host": current,
        "current_host_rank": host_index,
        "current_instance_type": instance_type,
        "current_instance_group": GROUP_NAME,
        "distribution_hosts": hosts,
        "host_count": len(hosts),
        "hosts": hosts,
        "hyperparameters": spec.hyperparameters,
        "input_config_dir": config_dir,
        "input_data_config": input_data_config,
        "input_dir": f"{root}/input",
        "is_master": host_index == 0,
        "job_name": spec.job_name,
        "log_level": LOG_LEVEL,
        "master_addr": master_addr,
        "master_hostname": hosts[0],
        "master_port": master_port,
        "model_dir": f"{root}/model",
        "module_dir": spec.code_uri or "",
        "module_name": module_name,
        "network_interface_name": network_interface,
        "num_cpus": num_cpus if num_cpus is not None else itype.vcpus,
        "num_gpus": itype.num_gpus,
        "num_neurons": itype.accelerator_count if itype.accelerator_kind == "neuron" else 0,
        "output_data_dir": f"{root}/output/data",
        "output_dir": f"{root}/output",
        "output_intermediate_dir": f"{root}/output/intermediate",
        "resource_config": resource_config,
        "user_entry_point": spec.entry_point,
    }
    env = {f"SM_{k.upper()}": v if isinstance(v, str) else json.dumps(v) for k, v in training_env.items()}
    env.update(
        {
            "SM_CHANNELS": json.dumps(channels),
            "SM_HPS": json.dumps(spec.hyperparameters),
            "SM_USER_ARGS": json.dumps(args),
            "SM_TRAINING_ENV": json.dumps(training_env),
            "TRAINING_JOB_NAME": spec.job_name,
            # the typed distribution, read by trainyard.engine (ignored by other scripts)
            "TRAINYARD_DISTRIBUTION": json.dumps(normalize(spec.distribution, world_size=spec.world_size,
                                                           processes_per_host=spec.processes_per_host)),
        }
    )
    env.update({f"SM_CHANNEL_{c.upper()}": f"{root}/input/data/{c}" for c in channels})
    env.update({f"SM_HP_{k.upper()}": hp_arg(v) for k, v in spec.hyperparameters.items()})
    if spec.checkpoint_s3_uri:
        env["SM_CHECKPOINT_DIR"] = _under_root(spec.checkpoint_local_path, root)
    env.update(spec.environment)  # the user's own variables win
    dirs = DIRS + tuple(f"input/data/{c}" for c in channels)
    return HostContract(files=files, dirs=dirs, env=env)


def _under_root(path: str, root: str) -> str:
    """Map a path given for the container (`/opt/ml/checkpoints`) onto this host's root."""
    if root != "/opt/ml" and (path == "/opt/ml" or path.startswith("/opt/ml/")):
        return root + path[len("/opt/ml") :]
    return path


def write_contract(contract: HostContract, dest_root: str) -> None:
    """Create a HostContract's folders and files under `dest_root` (the host's /opt/ml as seen here)."""
    for d in contract.dirs:
        os.makedirs(f"{dest_root}/{d}", exist_ok=True)
    for rel, text in contract.files.items():
        with open(f"{dest_root}/{rel}", "w") as fh:
            fh.write(text)
