"""JobSpec: the one serialisable description of a training job, identical for every backend.

Everything the user passes to `Estimator(...)` and `fit(...)` is validated into a JobSpec; backends
see nothing else. It round-trips through JSON (`to_json` / `from_json`).
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator, model_validator

from trainyard.parallel.parallelism import Parallelism, asks_for_launcher
from trainyard.job import catalog
from trainyard.job.distribution import typed
from trainyard.errors import ConfigError
from trainyard.job.kubernetes import KubernetesOptions
from trainyard.job.metricdefs import check_metric_definitions
from trainyard.job.observability import Profiler, TensorBoardOutput
from trainyard.job.uris import check_s3_uri, check_storage_uri

# SageMaker's rules: channel names are [A-Za-z0-9.-_] up to 64 characters; job names are
# alphanumerics and hyphens up to 63 characters, starting with a letter or digit.
_CHANNEL = re.compile(r"^[A-Za-z0-9.\-_]{1,64}$")
JOB_NAME = re.compile(r"^[A-Za-z0-9](-*[A-Za-z0-9])*$")
# EC2 capacity reservation ids: "cr-" and 17 hex digits (8 for the oldest ones); a Capacity Block has one too
CAPACITY_RESERVATION_ID = re.compile(r"^cr-(?:[0-9a-f]{8}|[0-9a-f]{17})$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HP_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
# Linux's MAX_ARG_STRLEN: the longest single argument or environment string (with its NUL) a process can get
MAX_ARG_BYTES = 131072
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# the entry point of the built-in trainer (python -m trainyard.engine.train)
BUILTIN_TRAINER = "trainyard.engine.train"
DEFAULT_MAX_RUN = 24 * 3600  # SageMaker's default MaxRuntimeInSeconds
# no rank's heartbeat changed for this long: the job hangs (container/hang.py); NCCL's own watchdog waits 600 s
DEFAULT_HANG_TIMEOUT_S = 300.0


def launches_plain(entry_point: str, distribution: dict | None) -> bool:
    """Whether a job's entry point runs as plain `python` (SageMaker's way without a distribution): a script or
    module of the user's (not the built-in trainer) whose `distribution` asks for no launcher. It then runs once
    per host unless `processes_per_host` asks for more (torchrun then starts them)."""
    return entry_point != BUILTIN_TRAINER and not asks_for_launcher(distribution)


class Channel(BaseModel):
    """One input channel: `/opt/ml/input/data/<name>` inside the job."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    uri: str
    distribution: Literal["FullyReplicated", "ShardedByS3Key"] = "FullyReplicated"
    input_mode: Literal["File", "FastFile"] = "File"
    """FastFile is staged as File: the script sees the same files at the same path."""
    content_type: str | None = None
    compression: Literal["None", "Gzip"] | None = None
    """Written to inputdataconfig.json; SageMaker uses it in Pipe mode only, so it changes no staged file."""
    record_wrapping: Literal["RecordIO"] | None = None
    s3_data_type: Literal["S3Prefix", "ManifestFile", "AugmentedManifestFile"] = "S3Prefix"
    attribute_names: tuple[str, ...] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _CHANNEL.match(v) or v in (".", ".."):
            raise ValueError(f"invalid channel name {v!r}: use 1-64 letters, digits, '.', '-' or '_' (not '.' or "
                             "'..': the channel is a folder under /opt/ml/input/data)")
        return v

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        return check_storage_uri("uri", v, ("s3", "file", "fsx"))


class Network(BaseModel):
    """EC2: what a subnet Trainyard creates may reach besides S3, ECR, CloudWatch Logs and EC2 (which it always
    reaches through VPC endpoints: trainyard/sdk/backends/ec2/network.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    internet: bool = False
    """A NAT gateway for the job (pip, model hubs, any public address); it costs per hour and per GB."""


class Elastic(BaseModel):
    """Go on with fewer hosts when one is lost for good (`max_retry_attempts` restarts it; see docs/sdk.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    min_instance_count: int

    @field_validator("min_instance_count", mode="before")
    @classmethod
    def _min(cls, v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"must be an integer >= 1, got {v!r}")
        return v


class HealthCheck(BaseModel):
    """The pre-flight health check (container/health.py): each host's matmul throughput and all-reduce bandwidth
    within and across hosts, measured before the first step. `True` gives the defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    on_failure: Literal["fail", "continue"] = "fail"
    """A host far below its peers: fail the job before training (`fail`), or say so and train (`continue`)."""
    min_ratio: float = 0.7
    """A host whose compute is under this share of the other hosts' median is far below its peers."""

    @field_validator("min_ratio", mode="before")
    @classmethod
    def _ratio(cls, v: object) -> object:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            raise ValueError(f"must be a number strictly between 0 and 1 (a share of the peers' compute), got {v!r}")
        return v


class EmulatedNetwork(BaseModel):
    """Local jobs only: each host in its own network namespace behind a shaped link (see trainyard/sdk/backends/local/netem.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    bandwidth_mbit: float = 1000.0
    delay_ms: float = 0.2

    @field_validator("bandwidth_mbit")
    @classmethod
    def _bw(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"bandwidth_mbit must be > 0, got {v}")
        return v

    @field_validator("delay_ms")
    @classmethod
    def _delay(cls, v: float) -> float:
        if not v >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {v}")
        return v


class JobSpec(BaseModel):
    """A fully validated job. `job_name` is None until `fit()` names the job."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    _typed: Parallelism = PrivateAttr()
    job_name: str | None = None
    entry_point: str
    """Script path relative to the code root (`train.py`), or an installed module (`trainyard.engine.train`)."""
    entry_kind: Literal["script", "module"]
    code_uri: str | None = None
    """`sourcedir.tar.gz` in object storage; None for a module entry point with no source_dir."""
    hyperparameters: dict[str, Any] = {}
    instance_type: str
    instance_count: int = 1
    processes_per_host: int
    distribution: dict[str, Any] = {}
    """As the user gave it, and so in spec.json (SageMaker's forms kept for the launcher's parameters, a partition
    group left unset left to the world: an elastic shrink lays it out again on fewer hosts); `parallelism` is its
    typed form on this world, which the contract and the SageMaker request carry."""
    environment: dict[str, str] = {}
    channels: tuple[Channel, ...] = ()
    checkpoint_s3_uri: str | None = None
    checkpoint_local_path: str = "/opt/ml/checkpoints"
    output_path: str
    max_run: int = DEFAULT_MAX_RUN
    role: str | None = None
    emulated_network: EmulatedNetwork | None = None
    plan: dict[str, Any] | None = None
    """With distribution "auto": the planner's choice (trainyard/job/plan/auto.py `record`), shown by describe()."""
    # EC2 jobs
    image_uri: str | None = None
    """The training image (ECR) that EC2 hosts run; for instance_type "local", an image of this machine's
    engine each local host runs in (the CPU variant)."""
    subnets: tuple[str, ...] = ()
    """Subnets to launch in, tried in order on a capacity error; empty: a one-zone subnet is created."""
    network: Network | None = None
    """EC2, created subnet only: {"internet": True} adds a NAT gateway."""
    use_spot_instances: bool = False
    max_wait: int | None = None
    """Spot: seconds to wait for capacity and training together (>= max_run)."""
    max_retry_attempts: int = 0
    """Spot: how many times an interrupted job comes back on new capacity."""
    backend: Literal["local", "ec2", "sagemaker", "kubernetes"] | None = None
    """Where the job runs; None: by the instance type (`local`/`local_gpu` here, the others on EC2)."""
    keep_alive_period_in_seconds: int | None = None
    """backend="sagemaker": keep the instances in a SageMaker warm pool this long after the job (0-21600 s,
    SageMaker's range), for the next job of the same configuration."""
    kubernetes: KubernetesOptions | None = None
    """backend="kubernetes" and `Estimator.to_kubernetes()`: namespace, service account, FSx volumes, ...
    (job/kubernetes.py). Given with no backend, they choose backend="kubernetes"."""
    elastic: Elastic | None = None
    """With retries: a job that loses a host for good goes on with fewer (down to min_instance_count)."""
    hang_timeout_s: float | None = DEFAULT_HANG_TIMEOUT_S
    """Seconds without progress on any rank (engine heartbeats) before the job is failed as hung; None: never."""
    health_check: HealthCheck | None = None
    """The pre-flight health check of every host (None: none; `Estimator(health_check=True)`)."""
    capacity_reservation_id: str | None = None
    """EC2: the On-Demand Capacity Reservation or Capacity Block (`cr-...`) the instances launch into."""
    tensorboard_output_config: TensorBoardOutput | None = None
    """SageMaker's TensorBoard output: a folder synced to S3 while the job runs (job/observability.py)."""
    profiler: Profiler | None = None
    """torch.profiler traces of some steps of some ranks (the `profiler` or `profiler_config` argument)."""
    # SageMaker arguments with an effect (see docs/sdk.md for each backend)
    input_mode: Literal["File", "FastFile"] = "File"
    """The channels' default TrainingInputMode."""
    volume_size: int = 30
    """EC2: the root volume of each instance, GB (SageMaker's default 30)."""
    tags: dict[str, str] = {}
    """Put on every resource a job creates (EC2) and in describe()'s Tags."""
    security_group_ids: tuple[str, ...] = ()
    """EC2: security groups added to the job's own (which lets the hosts talk to each other)."""
    metric_definitions: tuple[dict[str, str], ...] = ()
    """{"Name", "Regex"}: metrics scraped from the job's log lines (sdk/jobs/metrics.py)."""
    enable_sagemaker_metrics: bool | None = None
    container_log_level: int = 20
    """SM_LOG_LEVEL (logging.INFO by default)."""
    framework: dict[str, str] = {}
    """What the estimator class says of the image: {"name": "pytorch", "framework_version": ..., "py_version": ...}."""
    inert: tuple[str, ...] = ()
    """Arguments accepted that have no effect on this backend (named once on stderr when the Estimator is
    built; `Estimator.inert_arguments`)."""

    @field_validator("job_name")
    @classmethod
    def _job_name(cls, v: str | None) -> str | None:
        if v is not None and (not JOB_NAME.match(v) or len(v) > 63):
            raise ValueError(f"invalid job name {v!r}: 1-63 letters, digits and hyphens, starting with a letter or digit")
        return v

    @field_validator("entry_point", mode="before")
    @classmethod
    def _entry_point(cls, v: object) -> str:
        if not isinstance(v, str) or not v.strip():
            raise ValueError("missing: give a script in source_dir ('train.py') or a module ('trainyard.engine.train')")
        return v

    @field_validator("instance_type", mode="before")
    @classmethod
    def _instance_type(cls, v: object) -> str:
        return catalog.lookup(v).name

    @field_validator("instance_count", "processes_per_host", "max_run", mode="before")
    @classmethod
    def _positive_int(cls, v: object, info) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"must be an integer >= 1, got {v!r} ({type(v).__name__})")
        if v < 1:
            unit = " seconds" if info.field_name == "max_run" else ""
            raise ValueError(f"must be an integer >= 1{unit}, got {v}")
        return v

    @field_validator("hyperparameters", mode="before")
    @classmethod
    def _hyperparameters(cls, v: object) -> dict:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError(f"expected a dict of name to value, got {type(v).__name__}")
        for name, value in v.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"hyperparameter names must be non-empty strings, got {name!r}")
            if not _HP_NAME.match(name):
                raise ValueError(
                    f"hyperparameter name {name!r} cannot be passed as '--{name}': use letters, digits, '_', '-' or '.'"
                )
            try:
                text = value if isinstance(value, str) else json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"hyperparameter {name!r} = {value!r} is not JSON-serialisable ({e}); "
                    "use str, int, float, bool, None, or lists/dicts of those"
                ) from None
            if "\x00" in text:
                raise ValueError(f"hyperparameter {name!r} holds a NUL character, which no command line can carry")
            if len(text.encode()) >= MAX_ARG_BYTES:
                raise ValueError(f"hyperparameter {name!r} is {len(text.encode())} bytes: a command-line argument "
                                 f"must be under {MAX_ARG_BYTES} (Linux's limit); pass large values as an input "
                                 "channel or a file in source_dir")
        return dict(v)

    @field_validator("distribution", mode="before")
    @classmethod
    def _distribution(cls, v: object) -> dict:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError(f"expected a dict such as {{'torch_distributed': {{'enabled': True}}}}, got {v!r}")
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"not JSON-serialisable: {e}") from None
        return dict(v)

    @field_validator("environment", mode="before")
    @classmethod
    def _environment(cls, v: object) -> dict:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError(f"expected a dict of variable name to string, got {type(v).__name__}")
        for name, value in v.items():
            if not isinstance(name, str) or not _ENV_NAME.match(name):
                raise ValueError(f"invalid variable name {name!r}: letters, digits and '_', not starting with a digit")
            if not isinstance(value, str):
                raise ValueError(f"{name}={value!r}: values must be strings (use str({value!r}))")
            if "\x00" in value:
                raise ValueError(f"{name}: the value holds a NUL character, which no environment can carry")
            if len(value.encode()) >= MAX_ARG_BYTES:
                raise ValueError(f"{name}: the value is {len(value.encode())} bytes: a variable must be under "
                                 f"{MAX_ARG_BYTES} (Linux's limit); pass large values as a file")
        return dict(v)

    @field_validator("checkpoint_s3_uri")
    @classmethod
    def _checkpoint(cls, v: str | None) -> str | None:
        return None if v is None else check_s3_uri("checkpoint_s3_uri", v)

    @field_validator("checkpoint_local_path")
    @classmethod
    def _checkpoint_local(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"must be an absolute path inside the container, got {v!r}")
        if any(part in (".", "..") for part in v.split("/")) or "\x00" in v:
            raise ValueError(f"{v!r} has '.' or '..' parts, which would lead out of the folder it names; give the "
                             "path itself, such as '/opt/ml/checkpoints'")
        return v

    @field_validator("output_path")
    @classmethod
    def _output(cls, v: str) -> str:
        return check_storage_uri("output_path", v)

    @field_validator("code_uri")
    @classmethod
    def _code(cls, v: str | None) -> str | None:
        return None if v is None else check_storage_uri("code_uri", v)

    @field_validator("subnets", mode="before")
    @classmethod
    def _subnets(cls, v: object) -> tuple:
        if v is None:
            return ()
        if isinstance(v, str) or not all(isinstance(s, str) and re.match(r"^subnet-[0-9a-f]+$", s) for s in v):
            raise ValueError(f"expected a list of subnet ids such as ['subnet-0abc...'], got {v!r}")
        return tuple(v)

    @field_validator("capacity_reservation_id", mode="before")
    @classmethod
    def _capacity_reservation(cls, v: object) -> str | None:
        if v is not None and not (isinstance(v, str) and CAPACITY_RESERVATION_ID.match(v)):
            raise ValueError(f"expected a capacity reservation id such as 'cr-0123456789abcdef0' ('cr-' and 8 or 17 "
                             f"hex digits; a Capacity Block's id has the same form), got {v!r}")
        return v

    @field_validator("tags", mode="before")
    @classmethod
    def _tags(cls, v: object) -> dict:
        """SageMaker's list of {"Key", "Value"} or a dict."""
        if v is None:
            return {}
        if isinstance(v, (list, tuple)):
            if not all(isinstance(t, dict) and set(t) == {"Key", "Value"} for t in v):
                raise ValueError(f"expected [{{'Key': ..., 'Value': ...}}, ...] or a dict, got {v!r}")
            v = {t["Key"]: t["Value"] for t in v}
        if not isinstance(v, dict):
            raise ValueError(f"expected [{{'Key': ..., 'Value': ...}}, ...] or a dict, got {type(v).__name__}")
        for k, val in v.items():
            if not isinstance(k, str) or not 1 <= len(k) <= 128 or k.lower().startswith("aws:"):
                raise ValueError(f"tag key {k!r}: 1-128 characters, not starting with 'aws:'")
            if not isinstance(val, str) or len(val) > 256:
                raise ValueError(f"tag {k!r}: the value must be a string of up to 256 characters, got {val!r}")
        return dict(v)

    @field_validator("security_group_ids", mode="before")
    @classmethod
    def _security_groups(cls, v: object) -> tuple:
        if v is None:
            return ()
        if isinstance(v, str) or not all(isinstance(s, str) and re.match(r"^sg-[0-9a-f]+$", s) for s in v):
            raise ValueError(f"expected a list of security group ids such as ['sg-0abc...'], got {v!r}")
        return tuple(v)

    @field_validator("metric_definitions", mode="before")
    @classmethod
    def _metric_definitions(cls, v: object) -> tuple:
        return tuple(check_metric_definitions(v))

    @field_validator("volume_size", mode="before")
    @classmethod
    def _volume(cls, v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 16384:
            raise ValueError(f"must be a whole number of GB between 1 and 16384, got {v!r}")
        return v

    @field_validator("health_check", mode="before")
    @classmethod
    def _health_check(cls, v: object) -> object:
        if v is True:
            return HealthCheck()
        if v is False:
            return None
        if v is not None and not isinstance(v, (dict, HealthCheck)):
            raise ValueError(f"must be True, False or a dict of on_failure ('fail' or 'continue') and min_ratio, "
                             f"got {v!r}")
        return v

    @field_validator("hang_timeout_s", mode="before")
    @classmethod
    def _hang_timeout(cls, v: object) -> object:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ValueError(f"must be a number of seconds > 0 (or None to turn hang detection off), got {v!r}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _kubernetes_backend(cls, data: object) -> object:
        """Kubernetes options choose the Kubernetes backend (a job given them never goes to EC2 by mistake)."""
        if isinstance(data, dict) and data.get("kubernetes") is not None and data.get("backend") is None:
            return {**data, "backend": "kubernetes"}
        return data

    @model_validator(mode="after")
    def _backend(self) -> "JobSpec":
        local = catalog.lookup(self.instance_type).is_local
        if self.backend is not None and (self.backend == "local") != local:
            want = "'local' or 'local_gpu'" if self.backend == "local" else "an ml.* type such as 'ml.p4d.24xlarge'"
            raise ValueError(f"backend: {self.backend!r} runs {want}, not instance_type {self.instance_type!r}")
        if self.keep_alive_period_in_seconds and self.backend != "sagemaker":
            raise ValueError("keep_alive_period_in_seconds: warm pools are SageMaker's; set backend='sagemaker' or "
                             "drop it")
        if self.keep_alive_period_in_seconds is not None and not 0 <= self.keep_alive_period_in_seconds <= 21600:
            raise ValueError(f"keep_alive_period_in_seconds: SageMaker keeps a warm pool 0 to 21600 s, got "
                             f"{self.keep_alive_period_in_seconds}")
        if self.kubernetes is not None and self.backend != "kubernetes":
            raise ValueError(f"kubernetes: the options of backend='kubernetes' (they choose it); this job's backend "
                             f"is {self.backend!r}: drop kubernetes or the backend")
        return self

    @model_validator(mode="after")
    def _elastic(self) -> "JobSpec":
        e = self.elastic
        if e is not None:
            if not catalog.lookup(self.instance_type).is_local:
                raise ValueError("elastic: only local jobs go on with fewer hosts so far; EC2 jobs retry on new "
                                 "instances of the same count (drop elastic)")
            if e.min_instance_count > self.instance_count:
                raise ValueError(f"elastic: min_instance_count ({e.min_instance_count}) is more than instance_count "
                                 f"({self.instance_count}); give at most {self.instance_count}")
            if self.max_retry_attempts < 1:
                raise ValueError("elastic: a job goes on with fewer hosts by restarting; set max_retry_attempts >= 1")
        return self

    @field_validator("max_retry_attempts")
    @classmethod
    def _retries(cls, v: int) -> int:
        if not 0 <= v <= 30:
            raise ValueError(f"must be between 0 and 30, got {v}")
        return v

    @model_validator(mode="after")
    def _ec2(self) -> "JobSpec":
        local = catalog.lookup(self.instance_type).is_local
        # image_uri on instance_type "local": its hosts run in containers of the image (sdk/backends/local/containers.py)
        given = [f for f in ("image_uri", "subnets", "use_spot_instances", "max_wait", "security_group_ids",
                             "capacity_reservation_id", "kubernetes") if getattr(self, f)
                 and not (f == "image_uri" and self.instance_type == "local")]
        if local and given:
            raise ValueError(f"{given[0]}: only for EC2 instance types; local jobs run in this Python environment")
        fsx = [c.name for c in self.channels if c.uri.startswith("fsx://")]
        if self.network is not None and self.network.internet and self.subnets:
            raise ValueError("network: internet access is for the subnet Trainyard creates; your subnets reach what "
                             "their route tables give them (omit network, or omit subnets)")
        if local and fsx:
            raise ValueError(f"inputs.{fsx[0]}: FSx channels need an EC2 instance type; give an s3:// or file:// URI")
        if self.capacity_reservation_id and self.use_spot_instances:
            raise ValueError(f"capacity_reservation_id: {self.capacity_reservation_id} is reserved On-Demand capacity "
                             "(or a Capacity Block), and spot instances never launch into it: drop "
                             "use_spot_instances=True (and max_wait), or drop the reservation")
        if self.max_wait is not None and not self.use_spot_instances:
            raise ValueError("max_wait: only with use_spot_instances=True")
        if self.use_spot_instances and (self.max_wait is None or self.max_wait < self.max_run):
            raise ValueError(f"max_wait: spot jobs need max_wait >= max_run ({self.max_run} s), got {self.max_wait}")
        return self

    @model_validator(mode="after")
    def _parallelism(self) -> "JobSpec":
        """The one parse of `distribution` on the SDK's side: typed and laid out on this job's world."""
        # a job without a launcher runs one process per host, each a world of its own (container/plainrun.py)
        world = 1 if self.launcher == "python" else self.world_size
        try:
            self._typed = typed(self.distribution, world_size=world, processes_per_host=self.processes_per_host)
        except ValueError as e:
            raise ValueError(f"distribution: {str(e).removeprefix('distribution: ')}") from None
        if self._typed.cpu_offload and catalog.lookup(self.instance_type).num_gpus == 0:
            raise ValueError(f"distribution: mics.cpu_offload moves GPU memory to the host, and {self.instance_type!r} "
                             "has no GPU (its model states are in host memory already); set cpu_offload to false, or "
                             "use a GPU instance type")
        return self

    @model_validator(mode="after")
    def _profiled_ranks(self) -> "JobSpec":
        outside = [r for r in (self.profiler.ranks if self.profiler else ()) if r >= self.world_size]
        if outside:
            raise ValueError(f"profiler: rank {outside[0]} is not in the job: it has {self.world_size} process(es), "
                             f"ranks 0..{self.world_size - 1}")
        return self

    @model_validator(mode="after")
    def _entry(self) -> "JobSpec":
        if self.entry_kind == "module" and not MODULE_NAME.match(self.entry_point):
            raise ValueError(f"entry_point: {self.entry_point!r} is not a module name")
        names = [c.name for c in self.channels]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"channels: duplicate channel name(s) {dup}")
        return self

    @property
    def hosts(self) -> list[str]:
        """`algo-1..N`, ordered by index (not as strings: algo-2 before algo-10)."""
        return [f"algo-{i + 1}" for i in range(self.instance_count)]

    @property
    def world_size(self) -> int:
        return self.instance_count * self.processes_per_host

    @property
    def launcher(self) -> str:
        """How each host starts the entry point: "python", one plain process (`launches_plain`, one process per
        host: SageMaker's way without a distribution), or "torchrun"."""
        plain = launches_plain(self.entry_point, self.distribution) and self.processes_per_host == 1
        return "python" if plain else "torchrun"

    @property
    def parallelism(self) -> Parallelism:
        """`distribution`, typed and laid out on this job's world (its partition group filled in): what the
        contract's `TRAINYARD_DISTRIBUTION` and the SageMaker request carry to the engine (`.to_env()`)."""
        return dataclasses.replace(self._typed)

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    def evolve(self, **changes: Any) -> "JobSpec":
        """This spec with `changes`, validated again as a whole (a ConfigError naming the field, as `build_spec`)."""
        return build_spec(**{**self.model_dump(), **changes})

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        return cls.model_validate_json(text)


def build_spec(**fields: Any) -> JobSpec:
    """Validate `fields` into a JobSpec, turning pydantic's errors into one ConfigError naming the field."""
    try:
        return JobSpec.model_validate(fields)
    except ValidationError as e:
        raise _config_error(e) from None


def _config_error(e: ValidationError) -> ConfigError:
    messages = []
    first_field = None
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "job"
        msg = err["msg"].removeprefix("Value error, ")
        ctx_err = err.get("ctx", {}).get("error")
        if isinstance(ctx_err, ConfigError):  # raised by a shared checker: keep its own field name
            field, msg = ctx_err.field, str(ctx_err).split(": ", 1)[1]
        if field.startswith("channels."):  # channels.0.uri -> inputs.<name>
            field = "inputs" + field[len("channels") :]
        if err["type"] == "missing":
            msg = "required"
        named = re.match(r"^([A-Za-z_][\w.]*): (.*)$", msg, re.S) if field == "job" else None
        if named:  # a check across fields that names the one at fault
            field, msg = named.groups()
        first_field = first_field or field
        messages.append(msg if field == first_field and not messages else f"{field}: {msg}")
    return ConfigError(first_field or "job", "; ".join(messages))

