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
from typing import Any

from trainyard.engine.components.contract import CHECKPOINT_CONFIG, PROFILER_CONFIG, TENSORBOARD_CONFIG
from trainyard.job import catalog
from trainyard.job.spec import JobSpec

GROUP_NAME = "homogeneousCluster"  # SageMaker's instance group name for single-group jobs
# SM_FRAMEWORK_MODULE: what starts the script in SageMaker's PyTorch image; here, the driver
FRAMEWORK_MODULE = "trainyard.container.driver:main"
CONFIG_DIR = "input/config"
JOB_FILE = f"{CONFIG_DIR}/trainyard.json"  # Trainyard's own file: the spec and launch facts
# "sagemaker" when SageMaker runs the container (container/sagemaker.py): it stages, syncs and uploads itself
PLATFORM_ENV = "TRAINYARD_PLATFORM"
# on SageMaker: where the SageMaker backend put the job's spec (sdk/backends/sagemaker/backend.py, container/sagemaker.py)
SPEC_URI_ENV = "TRAINYARD_SPEC_URI"
DISTRIBUTION_ENV = "TRAINYARD_DISTRIBUTION"  # the engine's layout (engine/api.py reads it)
# on Kubernetes: where the job's ConfigMap (its spec and the contract's job-wide files) is mounted in the pods
# (sdk/backends/kubernetes/manifests.py renders it, container/kubernetes.py reads it)
KUBERNETES_CONFIG_DIR = "/etc/trainyard"
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


def hp_env(value: Any) -> str:
    """A hyperparameter in `SM_HP_<NAME>` (the toolkit's `to_env_vars`): strings as they are, the rest as
    JSON (`false`, `[64, 32]`, `{"a": 1}`)."""
    return value if isinstance(value, str) else json.dumps(value)


def _cmd_value(value: Any) -> str:
    """A value on the command line as the toolkit's `mapping.to_cmd_args` writes it: `str(value)` (so
    False -> `False`, [64, 32] -> `[64, 32]`), a dict as `k1=v1,k2=v2` with sorted keys, None as ``."""
    if value is None:
        return ""
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    return str(value)


def user_args(hyperparameters: dict[str, Any]) -> list[str]:
    """The script's arguments, exactly as SageMaker's training toolkit builds them (`mapping.to_cmd_args`):
    names sorted, `--name` (`-n` for a one-letter name), then the value."""
    args: list[str] = []
    for name in sorted(hyperparameters):
        args += [f"--{name}" if len(name) > 1 else f"-{name}", _cmd_value(hyperparameters[name])]
    return args


def framework_params(spec: "JobSpec") -> dict[str, Any]:
    """`additional_framework_parameters` (SM_FRAMEWORK_PARAMS): the `sagemaker_*` hyperparameters the
    SageMaker SDK adds for the launcher, derived from the spec. The toolkit keeps out the ones it reads
    itself (program, submit directory, log level, job name, region), and so does this."""
    params: dict[str, Any] = {}
    d = spec.distribution
    if (d.get("torch_distributed") or {}).get("enabled"):
        params["sagemaker_torch_distributed_enabled"] = True
    if (d.get("pytorchddp") or {}).get("enabled"):
        params["sagemaker_pytorch_ddp_enabled"] = True
    mpi = d.get("mpi") or {}
    if mpi.get("enabled"):
        params["sagemaker_mpi_enabled"] = True
        params["sagemaker_mpi_num_of_processes_per_host"] = spec.processes_per_host
        if mpi.get("custom_mpi_options"):
            params["sagemaker_mpi_custom_mpi_options"] = mpi["custom_mpi_options"]
    if ((d.get("smdistributed") or {}).get("dataparallel") or {}).get("enabled"):
        params["sagemaker_distributed_dataparallel_enabled"] = True
    if ((d.get("smdistributed") or {}).get("modelparallel") or {}).get("enabled"):
        params["sagemaker_modelparallel_enabled"] = True
    return params


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
    if not 0 <= host_index < spec.instance_count:
        raise ValueError(f"host_index {host_index} outside 0..{spec.instance_count - 1}")
    if spec.job_name is None:
        raise ValueError("the spec has no job_name yet")
    root = root.rstrip("/") or "/"
    itype = catalog.lookup(spec.instance_type)
    instance_type = itype.name if itype.is_local else f"ml.{itype.name}"
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
    input_data_config = {c.name: _channel_config(c) for c in sorted(spec.channels, key=lambda c: c.name)}
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
        files[f"{CONFIG_DIR}/{CHECKPOINT_CONFIG}"] = json.dumps(
            {"LocalPath": under_root(spec.checkpoint_local_path, root), "S3Uri": spec.checkpoint_s3_uri}
        )
    tb = spec.tensorboard_output_config
    if tb is not None:
        files[f"{CONFIG_DIR}/{TENSORBOARD_CONFIG}"] = json.dumps(
            {"LocalPath": under_root(tb.container_local_output_path, root), "S3OutputPath": tb.s3_output_path}
        )
    if spec.profiler is not None:
        files[f"{CONFIG_DIR}/{PROFILER_CONFIG}"] = json.dumps(profiler_config(spec, root))

    args = user_args(spec.hyperparameters)
    module_name = spec.entry_point.removesuffix(".py") if spec.entry_kind == "script" else spec.entry_point
    group = {"instance_group_name": GROUP_NAME, "instance_type": instance_type, "hosts": hosts}
    training_env: dict[str, Any] = {
        "additional_framework_parameters": framework_params(spec),
        "channel_input_dirs": {c: f"{root}/input/data/{c}" for c in channels},
        "current_host": current,
        "current_host_rank": host_index,
        "current_instance_type": instance_type,
        "current_instance_group": GROUP_NAME,
        "current_instance_group_hosts": hosts,
        "distribution_hosts": hosts,
        "distribution_instance_groups": [GROUP_NAME] if spec.distribution else [],
        "framework_module": FRAMEWORK_MODULE,
        "host_count": len(hosts),
        "hosts": hosts,
        "hyperparameters": spec.hyperparameters,
        "input_config_dir": config_dir,
        "input_data_config": input_data_config,
        "input_dir": f"{root}/input",
        "instance_groups": [GROUP_NAME],
        "instance_groups_dict": {GROUP_NAME: group},
        "is_hetero": False,
        "is_master": host_index == 0,
        "is_modelparallel_enabled": bool(((spec.distribution.get("smdistributed") or {}).get("modelparallel")
                                          or {}).get("enabled")),
        "job_name": spec.job_name,
        "log_level": spec.container_log_level,
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
            "SM_FRAMEWORK_PARAMS": json.dumps(training_env["additional_framework_parameters"]),
            "SM_HPS": json.dumps(spec.hyperparameters),
            "SM_USER_ARGS": json.dumps(args),
            "SM_TRAINING_ENV": json.dumps(training_env),
            "TRAINING_JOB_NAME": spec.job_name,
            # the typed distribution, read by trainyard.engine (ignored by other scripts)
            DISTRIBUTION_ENV: spec.parallelism.to_env(),
        }
    )
    env.update({f"SM_CHANNEL_{c.upper()}": f"{root}/input/data/{c}" for c in channels})
    env.update({f"SM_HP_{k.upper()}": hp_env(v) for k, v in spec.hyperparameters.items()})
    if spec.checkpoint_s3_uri:
        env["SM_CHECKPOINT_DIR"] = under_root(spec.checkpoint_local_path, root)
    env.update(spec.environment)  # the user's own variables win
    dirs = DIRS + tuple(f"input/data/{c}" for c in channels)
    return HostContract(files=files, dirs=dirs, env=env)


def profiler_config(spec: "JobSpec", root: str) -> dict[str, Any]:
    """profilerconfig.json: SageMaker's shape (`ProfilingParameters` with `LocalPath` and, for one run of consecutive
    steps, `DetailedProfilingConfig`; `S3OutputPath`) and the steps and ranks the engine profiles (Trainyard's
    `Steps`, `Ranks`: every profiled step, which a start and a count cannot say for steps that are not consecutive)."""
    prof = spec.profiler
    params: dict[str, Any] = {"ProfilerEnabled": "true", "LocalPath": under_root(prof.local_path, root)}
    runs = prof.runs()
    if len(runs) == 1:  # SageMaker's values are JSON strings in the JSON
        params["DetailedProfilingConfig"] = json.dumps({"StartStep": runs[0][0], "NumSteps": len(prof.steps)})
    return {"ProfilingParameters": params, "S3OutputPath": prof.s3_output_path or spec.output_path,
            "Steps": list(prof.steps), "Ranks": list(prof.ranks)}


def _channel_config(c) -> dict[str, Any]:
    """One channel's entry in inputdataconfig.json, with SageMaker's keys."""
    out: dict[str, Any] = {"TrainingInputMode": c.input_mode, "S3DistributionType": c.distribution,
                           "RecordWrapperType": c.record_wrapping or "None"}
    if c.content_type:
        out["ContentType"] = c.content_type
    if c.compression:
        out["CompressionType"] = c.compression
    if c.attribute_names:
        out["AttributeNames"] = list(c.attribute_names)
    return out


def under_root(path: str, root: str) -> str:
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
