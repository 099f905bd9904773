"""`Estimator`: SageMaker's Python SDK v2 surface, Trainyard's backends.

    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                    hyperparameters={"steps": 20}, checkpoint_s3_uri="s3://my-bucket/ckpt")
    est.fit()
    est.latest_training_job.metrics()

Every argument of SageMaker's `EstimatorBase`, `Framework` and `PyTorch` is accepted. Those that mean
something here are used (docs/sdk.md has the table, per backend); those that do not are accepted and
named once on stderr (and in `inert_arguments`), never silently changing what runs. Every argument is
checked when the Estimator is built; `fit()` checks the inputs, asks the backend for its plan (read-only
checks), then packages and uploads the code and starts the job: nothing is uploaded or started before
all checks pass.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import re
import sys
from datetime import datetime, timezone
from typing import Any

from trainyard.container.contract import user_args
from trainyard.engine.config import FP8_MIN_CAPABILITY, parse_hyperparameters, reconcile_distribution
from trainyard.job import catalog, lease, storage
from trainyard.errors import ConfigError, UnknownArgumentError, known_keywords
from trainyard.job.plan import Plan, auto as auto_plan, plan as plan_layouts
from trainyard.job.spec import (BUILTIN_TRAINER, DEFAULT_HANG_TIMEOUT_S, DEFAULT_MAX_RUN, JOB_NAME,
                                JobSpec, build_spec)
from trainyard.job.uris import check_storage_uri, join
from trainyard.sdk import arguments, packaging
from trainyard.sdk.backends.terraform import render as terraform
from trainyard.sdk.analytics import TrainingJobAnalytics
from trainyard.sdk.backends import backend_for, open_job
from trainyard.sdk.debugger import profiler_request, tensorboard_output
from trainyard.sdk.inputs import TrainingInput, to_channels
from trainyard.sdk.jobs.job import LOG_MODES
from trainyard.sdk.jobs.jobstate import TERMINAL, job_dir
from trainyard.sdk.backends.kubernetes import check as k8s_check
from trainyard.sdk.backends.kubernetes import manifests as k8s_manifests
from trainyard.sdk import model
from trainyard.sdk.session import LocalSession, Session, default_output_path
from trainyard.sdk.store import ensure_store
from trainyard.sdk.versions import check_framework



class Estimator:
    """A training job's configuration; `fit()` runs it. SageMaker's argument names and defaults."""

    _framework: dict[str, str] = {}
    """What the estimator class says of the image (the PyTorch and HuggingFace classes set it)."""

    def _versions(self) -> dict[str, tuple[str, str | None]]:
        """The version arguments to check against the environment: {argument: (package, version)}."""
        return {"framework_version": ("torch", self.framework_version)}

    def __init__(
        self,
        entry_point: str | None = None,
        source_dir: str | None = None,
        hyperparameters: dict[str, Any] | None = None,
        instance_type: str = "local",
        instance_count: int = 1,
        processes_per_host: int | None = None,
        distribution: dict | str | None = None,
        environment: dict[str, str] | None = None,
        checkpoint_s3_uri: str | None = None,
        checkpoint_local_path: str | None = None,
        output_path: str | None = None,
        code_location: str | None = None,
        base_job_name: str | None = None,
        max_run: int = DEFAULT_MAX_RUN,
        role: str | None = None,
        emulated_network: dict | None = None,
        image_uri: str | None = None,
        subnets: list[str] | None = None,
        use_spot_instances: bool = False,
        max_wait: int | None = None,
        max_retry_attempts: int | None = None,
        boto_session=None,
        *,
        hang_timeout_s: float | None = DEFAULT_HANG_TIMEOUT_S,
        health_check: bool | dict | None = None,
        elastic: dict | None = None,
        backend: str | None = None,
        kubernetes: dict | None = None,
        sagemaker_session=None,
        volume_size: int = 30,
        network: dict | None = None,
        input_mode: str = "File",
        tags=None,
        security_group_ids: list[str] | None = None,
        capacity_reservation_id: str | None = None,
        metric_definitions: list[dict[str, str]] | None = None,
        container_log_level: int = 20,
        dependencies: list[str] | None = None,
        git_config: dict[str, str] | None = None,
        model_uri: str | None = None,
        model_channel_name: str = "model",
        instance_groups=None,
        framework_version: str | None = None,
        py_version: str | None = None,
        training_recipe: str | None = None,
        recipe_overrides: dict | None = None,
        tensorboard_output_config=None,
        profiler_config=None,
        disable_profiler: bool = False,
        profiler: dict | None = None,
        **sagemaker_only,
    ):
        unknown = [k for k in sagemaker_only if k not in arguments.INERT_UNLESS]
        if unknown:  # a TypeError (as Python's own) naming the closest argument
            raise UnknownArgumentError(f"{type(self).__name__}()", unknown, _arguments(type(self)))
        arguments.refuse_unsupported(training_recipe=training_recipe, recipe_overrides=recipe_overrides,
                                     instance_groups=instance_groups, input_mode=input_mode)
        session = sagemaker_session
        if boto_session is None and session is not None:
            boto_session = getattr(session, "boto_session", None)
        itype = catalog.lookup(instance_type)
        local = itype.is_local
        tensorboard = tensorboard_output(tensorboard_output_config)
        profiling = profiler_request(profiler, profiler_config, disable_profiler)
        sorted_out = arguments.triage(
            instance_type=instance_type, backend=backend, sagemaker_only=sagemaker_only, profiler_inert=profiling.inert,
            ec2=dict(image_uri=image_uri, subnets=subnets, security_group_ids=security_group_ids,
                     use_spot_instances=use_spot_instances, max_wait=max_wait, volume_size=volume_size,
                     capacity_reservation_id=capacity_reservation_id, network=network))
        self.git_config = git_config
        source_dir, dependencies, self._repo = arguments.source(git_config, source_dir, dependencies,
                                                                s3=_s3_for(local, boto_session, source_dir))
        self.instance_type = instance_type
        self.source_dir = source_dir
        self.dependencies = arguments.check_dependencies(dependencies)
        self._entry_file, entry, kind = arguments.resolve_entry_point(entry_point, source_dir)
        if output_path is None:
            output_path = default_output_path(session, local=local)
        if code_location is not None:
            check_storage_uri("code_location", code_location)
        self.code_location = code_location
        self.base_job_name = base_job_name or _default_base_name(entry)
        _check_job_name("base_job_name", self.base_job_name)  # cut to fit beside the time in each job's name
        self.framework_version, self.py_version = framework_version, py_version
        notes = check_framework(self._versions(), py_version, local=local, source_dir=source_dir)
        auto = arguments.auto_options(distribution)
        processes = arguments.processes_per_host(
            itype, None if auto is not None else distribution, processes_per_host,
            plain=auto is None and arguments.launches_plain(entry, distribution if isinstance(distribution, dict) else None))
        planned = None
        self._plan_options = auto or {}
        if auto is not None:  # the plan's best fitting layout (docs/plan.md)
            distribution, hyperparameters, planned = _auto_distribution(entry, kind, hyperparameters, auto, model_uri,
                                                                        instance_type, instance_count, processes)
        fields: dict[str, Any] = dict(
            entry_point=entry, entry_kind=kind, hyperparameters=hyperparameters, instance_type=instance_type,
            instance_count=instance_count, processes_per_host=processes, distribution=distribution,
            environment=environment, checkpoint_s3_uri=checkpoint_s3_uri, output_path=output_path, max_run=max_run,
            role=role, max_retry_attempts=0 if max_retry_attempts is None else max_retry_attempts,
            hang_timeout_s=hang_timeout_s, health_check=health_check, elastic=elastic, backend=backend,
            kubernetes=kubernetes,
            keep_alive_period_in_seconds=sorted_out.keep_alive,
            input_mode=input_mode, tags=tags, metric_definitions=metric_definitions,
            enable_sagemaker_metrics=sagemaker_only.get("enable_sagemaker_metrics"),
            container_log_level=container_log_level, inert=sorted_out.inert,
            tensorboard_output_config=tensorboard, profiler=profiling.profiler,
            framework={**self._framework, **{k: v for k, (_, v) in self._versions().items() if v},
                       **({"py_version": py_version} if py_version else {})},
            **sorted_out.ec2,
        )
        if checkpoint_local_path is not None:
            fields["checkpoint_local_path"] = checkpoint_local_path
        if planned is not None:
            fields["plan"] = planned
        if emulated_network is not None:
            arguments.check_emulated_network(local)
            fields["emulated_network"] = emulated_network
        self._spec = build_spec(**fields)
        if kind == "module" and entry == BUILTIN_TRAINER:
            _check_builtin_hyperparameters(self._spec)
            if tensorboard is not None and local:
                _check_tensorboard_installed()
        self.tensorboard_output_config, self.profiler_config = tensorboard_output_config, profiler_config
        self.disable_profiler = disable_profiler
        self.model_uri, self.model_channel_name = model_uri, model_channel_name
        if model_uri is not None:
            to_channels({model_channel_name: model_uri})  # checked now, staged as a channel by fit()
        # SageMaker's estimators always have one: its job calls (describe_training_job, logs_for_job) work on it
        self.sagemaker_session = session if session is not None else (LocalSession() if local else Session())
        self.boto_session = boto_session  # EC2 jobs: the boto3 Session of every AWS call (default: boto3's)
        self.latest_training_job = None
        self.inert_arguments = sorted_out.inert
        for line in arguments.notes(self._spec, [*notes, *([profiling.note] if profiling.note else [])]):
            print(line, file=sys.stderr)

    # SageMaker-style read access to what was configured
    def __getattr__(self, name: str):
        spec = self.__dict__.get("_spec")
        if spec is not None and name in JobSpec.model_fields:
            return getattr(spec, name)
        raise AttributeError(name)

    @property
    def model_data(self) -> str | None:
        """Where the last job's `model.tar.gz` is."""
        if self.latest_training_job is None:
            return None
        return self.latest_training_job.describe().get("ModelArtifacts", {}).get("S3ModelArtifacts")

    @property
    def _current_job_name(self) -> str | None:
        return None if self.latest_training_job is None else self.latest_training_job.name

    def hyperparameters(self) -> dict[str, Any]:
        """The hyperparameters the job's script receives (as `--name value`)."""
        return dict(self._spec.hyperparameters)

    def set_hyperparameters(self, **kwargs) -> None:
        """Add or change hyperparameters (checked as the constructor checks them)."""
        spec = self._spec.evolve(hyperparameters={**self._spec.hyperparameters, **kwargs})
        if spec.entry_kind == "module" and spec.entry_point == BUILTIN_TRAINER:
            _check_builtin_hyperparameters(spec)
        self._spec = spec

    def logs(self) -> None:
        """Print the last job's logs, following them until it ends (SageMaker's `Estimator.logs`)."""
        self._require_job().logs(wait=True)

    @property
    def training_job_analytics(self) -> TrainingJobAnalytics:
        """The last job's metrics as a table (SageMaker's `TrainingJobAnalytics`)."""
        names = [d["Name"] for d in self._spec.metric_definitions] or None
        return TrainingJobAnalytics(self._require_job().name, metric_names=names)

    def latest_job_tensorboard_artifacts_path(self) -> str | None:
        """Where the last job's TensorBoard event files are synced: `<s3_output_path>/<job>/tensorboard-output`
        (None without tensorboard_output_config), as SageMaker's method says."""
        tb = self._spec.tensorboard_output_config
        return None if tb is None else tb.uri(self._require_job().name)

    def latest_job_profiler_artifacts_path(self) -> str | None:
        """Where the last job's profiler traces are synced: `<s3_output_path or output_path>/<job>/profiler-output`
        (None when no profiler ran)."""
        prof = self._spec.profiler
        return None if prof is None else prof.uri(self._spec.output_path, self._require_job().name)

    def _require_job(self):
        if self.latest_training_job is None:
            raise ValueError("this Estimator has no training job yet: call fit() (or Estimator.attach(name))")
        return self.latest_training_job

    def deploy(self, *args, **kwargs):
        raise NotImplementedError("Trainyard trains; it does not host endpoints. Load model_data "
                                  f"({self.model_data}) with your serving stack")

    _model_class = "Model"  # the framework estimators name theirs (sdk/model.py)

    def create_model(self, role: str | None = None, image_uri: str | None = None, entry_point: str | None = None,
                     source_dir: str | None = None, **kwargs):
        """SageMaker's `create_model()`: a `Model` whose `model_data` is the last job's `model.tar.gz` (the job must
        have run: `fit()` or `Estimator.attach`). Its `deploy()` is refused, as this Estimator's is."""
        self._require_job()
        cls = getattr(model, self._model_class)
        return cls(model_data=self.model_data, role=role or self._spec.role, image_uri=image_uri or self._spec.image_uri,
                   entry_point=entry_point, source_dir=source_dir or self.source_dir,
                   sagemaker_session=self.sagemaker_session, **{**self._model_versions(), **kwargs})

    def _model_versions(self) -> dict:
        return {}

    @known_keywords
    def fit(self, inputs=None, wait: bool = True, logs="All", job_name: str | None = None,
            experiment_config: dict | None = None, dry_run: bool = False):
        """Check the inputs, ask the backend for its plan, package and upload the code, start the job; with
        `wait`, follow it to the end (printing its logs unless `logs` is "None").

        With `dry_run`, print the plan (for EC2: the resources and the price) and return it, creating
        nothing. `experiment_config` (SageMaker Experiments) is accepted and has no effect."""
        if logs not in LOG_MODES:
            raise ConfigError("logs", f"{logs!r}: use 'All', 'None' or 'Rules' (or True/False)")
        if experiment_config:
            print("[trainyard] accepted with no effect: experiment_config (SageMaker Experiments)", file=sys.stderr)
        spec = self._job_spec(inputs, job_name)
        if spec.entry_kind == "module" and spec.entry_point == BUILTIN_TRAINER:
            _check_builtin_channels(spec)
        if spec.entry_kind == "script":
            arguments.check_entry_syntax(self._entry_file or os.path.join(self.source_dir or ".", spec.entry_point))
        backend = backend_for(spec, session=self.boto_session)
        backend.check(spec)
        plan = backend.plan(spec)
        if dry_run:
            print(plan.describe())
            return plan
        if spec.plan:
            print(f"[trainyard] {spec.plan['summary']}", file=sys.stderr)
        job = backend.launch(spec, plan, upload_code=self._upload_code)
        self.latest_training_job = job
        if wait:
            job.wait(logs=logs)
        return job

    def plan(self, *, train_tokens: float | None = None, model: object = None, seq_len: int | None = None,
             global_batch_size: int | None = None, compile: bool | None = None) -> Plan:
        """Every layout of the job's model on this Estimator's instances, best first: memory, step time, tokens/s,
        MFU and cost (trainyard/job/plan; docs/plan.md). The model, seq_len, global_batch_size and compile are the
        built-in trainer's hyperparameters, those of `distribution={"auto": {...}}`, or these arguments (a script
        of your own needs the first three; compile says it runs under torch.compile). `plan().best` is what
        distribution "auto" runs."""
        spec = self._spec
        given = {k: v for k, v in (("model", model), ("seq_len", seq_len), ("global_batch_size", global_batch_size),
                                   ("compile", compile)) if v is not None}
        inputs = _plan_inputs(spec.entry_point, spec.entry_kind, spec.hyperparameters,
                              {**self._plan_options, **given}, self.model_uri, spec.instance_type)
        return plan_layouts(inputs["model"], seq_len=inputs["seq_len"], global_batch_size=inputs["global_batch_size"],
                            instance_type=spec.instance_type, instance_count=spec.instance_count,
                            processes_per_host=spec.processes_per_host, precision=inputs["precision"],
                            micro_batch_size=inputs["micro_batch_size"], train_tokens=train_tokens,
                            compile=inputs["compile"])

    def _job_spec(self, inputs, job_name: str | None) -> JobSpec:
        """The spec of one job: the Estimator's, named (`job_name`, or base_job_name and the time), with
        the channels of `inputs` (and the model channel of `model_uri`)."""
        if self.model_uri is not None:
            if isinstance(inputs, (str, TrainingInput)):
                inputs = {"training": inputs}
            inputs = {**(inputs or {}), self.model_channel_name: self.model_uri}
        channels = to_channels(inputs, default_input_mode=self._spec.input_mode)
        stamp = datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S-%f')[:-3]
        # as SageMaker's name_from_base: the base cut so that the name fits 63 characters
        name = job_name or f"{self.base_job_name[:62 - len(stamp)].rstrip('-')}-{stamp}"
        _check_job_name("job_name", name)
        return self._spec.evolve(job_name=name, channels=channels)

    def to_terraform(self, path: str, inputs=None, *, job_name: str | None = None, region: str | None = None,
                     availability_zone_id: str | None = None, cluster: dict | None = None,
                     data_s3_uri: str | None = None, fsx_mounts: list[dict] | None = None) -> list[str]:
        """Render the job `fit(inputs)` would run as a Terraform root module in `path`, using
        infra/modules (see trainyard/sdk/backends/terraform/render.py for the folder and the arguments); returns the files written.

        Nothing is uploaded or created: the code (when there is code to ship) is packaged into
        `path/sourcedir.tar.gz` and its content-addressed `code_uri` goes into the spec; `terraform apply`
        uploads it. The region defaults to `boto_session`'s, then AWS_REGION / AWS_DEFAULT_REGION."""
        spec = self._job_spec(inputs, job_name)
        if catalog.lookup(spec.instance_type).is_local:
            raise ConfigError("instance_type", "Terraform renders EC2 jobs: give an EC2 instance type such as "
                                               "'ml.p5.48xlarge'")
        archive = None
        if not (spec.entry_kind == "module" and self.source_dir is None):
            pkg = self._package()
            spec = spec.evolve(code_uri=join(code_prefix(spec, self.code_location), pkg.key))
            archive = pkg.data
        if region is None and self.boto_session is not None:
            region = self.boto_session.region_name
        return terraform.render_root_module(spec, path, cluster=cluster, region=region,
                                            availability_zone_id=availability_zone_id, data_s3_uri=data_s3_uri,
                                            fsx_mounts=fsx_mounts, code_archive=archive)

    def to_kubernetes(self, path: str | None = None, inputs=None, *, job_name: str | None = None) -> list[dict]:
        """The job `fit(inputs)` would run, as Kubernetes objects (sdk/backends/kubernetes/manifests.py): the contract ConfigMap, the
        FSx PersistentVolumes and claims, the Kubeflow PyTorchJob; with `path`, also written to the folder `path`
        as `pytorchjob.yaml` (for `kubectl apply -f`), beside the code's `sourcedir.tar.gz`.

        Nothing is uploaded or created: the code (when there is code to ship) is packaged and its
        content-addressed `code_uri` goes into the spec; upload `sourcedir.tar.gz` there before applying (the
        YAML's first lines say the command). The `kubernetes` argument's namespace, service account, FSx
        volumes, node selector and tolerations shape the objects."""
        spec = self._job_spec(inputs, job_name)
        k8s_check.check(spec)  # before packaging: a refused job packages nothing
        archive = None
        if not (spec.entry_kind == "module" and self.source_dir is None and not self.dependencies):
            pkg = self._package()
            code_uri = join(code_prefix(spec, self.code_location), pkg.key)
            spec, archive = spec.evolve(code_uri=code_uri), pkg.data
            k8s_check.check(spec)  # the code's location too
        objects = k8s_manifests.render(spec)
        if path is not None:
            k8s_manifests.write(objects, path, code_uri=spec.code_uri, code_archive=archive)
        return objects

    def _package(self) -> packaging.Package:
        return packaging.package(self.source_dir, self._entry_file, dependencies=self.dependencies)

    def _upload_code(self, spec: JobSpec, s3=None) -> str | None:
        """The job's first writes, in every backend's launch: the lease on each checkpoint location (job/lease.py:
        another live job there refuses this one, before anything is uploaded), then the code, packaged and
        uploaded. `s3`: the backend's client (EC2: the user's session's). Returns the code's URI."""
        ship = not (spec.entry_kind == "module" and self.source_dir is None and not self.dependencies)
        prefix = code_prefix(spec, self.code_location) if ship else None  # refused before any write
        for location in lease.locations(spec):
            try:
                lease.take(location, spec.job_name, alive=_local_job_alive, s3=s3,
                           say=lambda m: print(f"[trainyard] {m}", file=sys.stderr))
            except lease.LeaseHeld as e:
                field = "checkpoint_s3_uri" if location == (spec.checkpoint_s3_uri or "").rstrip("/") else \
                    "hyperparameters.checkpoint_uri"
                raise ConfigError(field, str(e)) from None
        if not ship:
            return None  # an installed module: nothing to ship
        return packaging.upload(self._package(), prefix, s3=s3)

    @classmethod
    def attach(cls, training_job_name: str, sagemaker_session=None, model_channel_name: str = "model") -> "Estimator":
        """An Estimator bound to an existing job (any backend), found by name (from any process)."""
        job = open_job(training_job_name)
        est = cls.__new__(cls)
        est._spec = job.spec.model_copy(update={"job_name": None, "channels": ()})
        est.source_dir, est._entry_file, est.code_location = None, None, None
        est.boto_session = getattr(sagemaker_session, "boto_session", None)
        est.dependencies, est.git_config, est._repo = (), None, None
        est.model_uri, est.model_channel_name = None, model_channel_name
        est.sagemaker_session = sagemaker_session if sagemaker_session is not None else Session()
        est.framework_version = job.spec.framework.get("framework_version")
        est.py_version = job.spec.framework.get("py_version")
        est.inert_arguments = job.spec.inert
        est.tensorboard_output_config = job.spec.tensorboard_output_config
        est.profiler_config, est.disable_profiler = None, False
        est.instance_type = job.spec.instance_type
        est.base_job_name = training_job_name
        est.latest_training_job = job
        return est


@functools.cache
def _arguments(cls: type) -> frozenset[str]:
    """Every keyword `cls(...)` takes: the named parameters of its and its Estimator bases' `__init__`,
    and the SageMaker arguments accepted with no effect."""
    names = set(arguments.INERT_UNLESS)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and issubclass(klass, Estimator):
            names |= {p.name for p in inspect.signature(init).parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(names - {"self"})


def _plan_inputs(entry: str, kind: str, hyperparameters: dict | None, opts: dict, model_uri: str | None,
                 instance_type: str) -> dict:
    """What the planner reads: model, seq_len, global_batch_size, precision, micro_batch_size (None: the
    planner's choice) and compile. From `opts` (the {"auto": {...}} form, or plan()'s arguments) first, then the
    built-in trainer's hyperparameters, and for its model hf the config.json of a local `model_uri`."""
    gpus = catalog.lookup(instance_type).num_gpus
    if not (kind == "module" and entry == BUILTIN_TRAINER):
        missing = [k for k in ("model", "seq_len", "global_batch_size") if opts.get(k) is None]
        if missing:
            raise ConfigError("distribution", f"'auto' and plan() need the model's shapes before the job starts, and "
                                              f"{entry!r} is a script of your own: give {missing} as "
                                              '{"auto": {"model": PRESET|CONFIG.json|DIR, "seq_len": N, '
                                              '"global_batch_size": N}} (or to plan())')
        return {"precision": "bf16" if gpus else "fp32", "micro_batch_size": None, "compile": False, **opts}
    try:
        cfg = parse_hyperparameters(user_args(hyperparameters or {}))
    except ValueError as e:
        raise ConfigError("hyperparameters", f"{e} (for {BUILTIN_TRAINER})") from None
    model = opts.get("model") or cfg.model
    if model == "hf":
        local = (model_uri or "").removeprefix("file://")
        if not (local and os.path.isfile(os.path.join(local, "config.json"))):
            raise ConfigError("distribution", "'auto' with model hf reads the model's config.json before the job "
                                              "starts: give model_uri as file:// of a folder holding it, or "
                                              '{"auto": {"model": "PATH/config.json"}}')
        model = local
    precision = "bf16" if cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and gpus) else "fp32"
    given = "micro_batch_size" in (hyperparameters or {})
    return {"model": model, "seq_len": cfg.seq_len, "global_batch_size": cfg.global_batch_size,
            "precision": precision, "micro_batch_size": cfg.micro_batch_size if given else None,
            "compile": cfg.compile, **{k: v for k, v in opts.items() if k != "model"}}


def _auto_distribution(entry: str, kind: str, hyperparameters: dict | None, opts: dict, model_uri: str | None,
                       instance_type: str, instance_count: int, processes: int) -> tuple[dict, dict, dict]:
    """distribution "auto": (the best fitting layout's distribution, the hyperparameters (the built-in trainer's
    with the layout's micro-batch size), the record describe() shows). A micro_batch_size the user gave is kept;
    the planner chooses among its layouts."""
    inputs = _plan_inputs(entry, kind, hyperparameters, opts, model_uri, instance_type)
    chosen, result = auto_plan.choose(inputs["model"], seq_len=inputs["seq_len"],
                                      global_batch_size=inputs["global_batch_size"], instance_type=instance_type,
                                      instance_count=instance_count, processes_per_host=processes,
                                      precision=inputs["precision"], micro_batch_size=inputs["micro_batch_size"],
                                      compile=inputs["compile"])
    if kind == "module" and entry == BUILTIN_TRAINER:
        hyperparameters = {**(hyperparameters or {}), "micro_batch_size": chosen.layout.micro_batch_size}
    record = {**auto_plan.record(chosen, result), "summary": auto_plan.summary(chosen, result.compiled)}
    return chosen.layout.distribution(), hyperparameters, record


def _check_builtin_hyperparameters(spec: JobSpec) -> None:
    """The built-in trainer's hyperparameters are known: check them now, not minutes later in the job."""
    par = spec.parallelism
    try:
        cfg = parse_hyperparameters(user_args(spec.hyperparameters))
        cfg.accumulation(par.data_parallel_degree(spec.world_size))  # the batch splits over dp ranks
    except ValueError as e:
        raise ConfigError("hyperparameters", f"{e} (for {BUILTIN_TRAINER})") from None
    try:
        reconcile_distribution(cfg, par, spec.world_size)
    except ValueError as e:
        raise ConfigError("distribution", str(e)) from None
    if cfg.checkpoint_uri and not cfg.checkpoint_uri.startswith(("s3://", "file://", "/")):
        raise ConfigError("hyperparameters", f"checkpoint_uri {cfg.checkpoint_uri!r} is a relative path, which in a "
                                             "job lands in its code folder (and is gone with it): use "
                                             "s3://bucket/prefix, or checkpoint_s3_uri on the Estimator")
    if cfg.checkpoint_every and not (cfg.checkpoint_uri or spec.checkpoint_s3_uri):
        raise ConfigError("hyperparameters", f"checkpoint_every={cfg.checkpoint_every} but the job has no checkpoint "
                                             "location: set checkpoint_s3_uri on the Estimator (or the trainer's "
                                             "checkpoint_uri), or drop checkpoint_every")
    if cfg.kernels == "triton" and not catalog.lookup(spec.instance_type).num_gpus and \
            spec.environment.get("TRITON_INTERPRET") != "1":
        raise ConfigError("hyperparameters", f"kernels='triton' runs on GPUs, and {spec.instance_type} has none: use "
                                             "kernels='auto' (Triton where it runs, else the eager ops), 'eager', or "
                                             "environment={'TRITON_INTERPRET': '1'} to run Triton's interpreter on "
                                             "the CPU (slow)")
    if cfg.dtype == "float8":
        _check_float8(spec.instance_type)
    if cfg.straggler_remove and spec.elastic is None:
        raise ConfigError("hyperparameters", "straggler_remove=true goes on without a straggler's host, which only an "
                                             "elastic job does: set elastic={'min_instance_count': N} (with "
                                             "max_retry_attempts >= 1), or drop straggler_remove to have stragglers "
                                             "named only")
    late = [s for s in (spec.profiler.steps if spec.profiler else ()) if s > cfg.steps]
    if late:
        raise ConfigError("profiler", f"step(s) {late} come after the job's last step {cfg.steps} (hyperparameter "
                                      f"steps): nothing would be profiled; give steps from 1 to {cfg.steps}")


def _check_float8(instance_type: str) -> None:
    """dtype float8 runs on NVIDIA GPUs of compute capability 8.9 or newer (the engine checks the GPU again)."""
    it = catalog.lookup(instance_type)
    cap = catalog.compute_capability(it)
    need = ".".join(map(str, FP8_MIN_CAPABILITY))
    families = ", ".join(f"ml.{f}" for f in catalog.types_with_capability(FP8_MIN_CAPABILITY))
    fix = (f"set dtype to 'bfloat16' (or 'float16' on GPUs without bfloat16), or run on an instance type with FP8 "
           f"tensor cores ({families})")
    if not it.num_gpus:
        raise ConfigError("hyperparameters", f"dtype 'float8' needs NVIDIA GPUs with FP8 tensor cores (compute "
                                             f"capability {need} or newer), and {instance_type} has no GPU: {fix}")
    if cap is not None and cap < FP8_MIN_CAPABILITY:
        raise ConfigError("hyperparameters", f"dtype 'float8' needs FP8 tensor cores (compute capability {need} or "
                                             f"newer), and {instance_type}'s {it.accelerator} has compute capability "
                                             f"{cap[0]}.{cap[1]}: {fix}")


def _check_builtin_channels(spec: JobSpec) -> None:
    """The built-in trainer's `dataset` names an input channel of the job (fit()'s inputs), or is synthetic."""
    dataset = user_args_value(spec.hyperparameters, "dataset") or "synthetic"
    channels = [c.name for c in spec.channels]
    if dataset != "synthetic" and dataset not in channels:
        raise ConfigError("hyperparameters", f"dataset={dataset!r} names an input channel, and the job has "
                                             f"{channels or 'none'}: pass it to fit(inputs={{{dataset!r}: "
                                             "'s3://...'}), or use dataset='synthetic'")


def user_args_value(hyperparameters: dict, name: str) -> str | None:
    """A hyperparameter as the script receives it (a string), whether given as `name` or with dashes."""
    for key in (name, name.replace("_", "-")):
        if key in hyperparameters:
            value = hyperparameters[key]
            return value if isinstance(value, str) else str(value)
    return None


def _check_tensorboard_installed() -> None:
    """A local job runs in this Python environment: without tensorboard its engine could not write the event files
    (the training image has it; trainyard/engine/components/tensorboard.py checks again in the job)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("tensorboard_output_config", "the engine writes TensorBoard event files with the tensorboard "
                                                       "package, which is not installed: pip install "
                                                       "'trainyard[tensorboard]'")


def _s3_for(local: bool, boto_session, source_dir) -> Any:
    """The S3 client that reads an s3:// source_dir: the user's session's, else the local jobs' store (None when
    source_dir is not on S3)."""
    if not (isinstance(source_dir, str) and source_dir.startswith("s3://")):
        return None
    if boto_session is not None or not local:
        return storage.s3_client(boto_session)
    return ensure_store().client()


def code_prefix(spec: JobSpec, code_location: str | None) -> str:
    """Where the job's code goes, as SageMaker stages it: `<code_location>/<job>/source`, or without one
    `s3://<output_path's bucket>/<job>/source`: beside the job's other objects, never inside a data prefix. Refused
    when a channel's prefix would hold it all the same (a channel of the whole bucket, or of a key prefix of the
    job's name): the job would see its own code archive among its data."""
    bucket = spec.output_path[len("s3://"):].split("/", 1)[0]
    prefix = join(code_location or f"s3://{bucket}", spec.job_name, "source")
    for ch in spec.channels:
        if ch.uri.startswith("s3://") and f"{prefix}/".startswith(ch.uri):
            raise ConfigError("code_location", f"the code would be uploaded to {prefix}/, inside channel "
                                               f"{ch.name!r} ({ch.uri}), where the job would read it as data; "
                                               "give code_location=s3://... outside every channel")
    return prefix


def _default_base_name(entry: str) -> str:
    base = re.sub(r"[^A-Za-z0-9]+", "-", entry.removesuffix(".py").rsplit(".", 1)[-1]).strip("-")
    return (base or "trainyard")[:40]


def _check_job_name(field: str, name: object, max_len: int = 63) -> None:
    if not isinstance(name, str) or not JOB_NAME.match(name) or len(name) > max_len:
        raise ConfigError(field, f"{name!r} is not a valid name: up to {max_len} letters, digits and hyphens, "
                                 "starting and ending with a letter or digit")


def _local_job_alive(name: str) -> bool | None:
    """Whether the job `name` of this machine still runs (None: no such job here, its lease's age decides)."""
    if not os.path.isdir(job_dir(name)):
        return None
    try:
        return open_job(name).status() not in TERMINAL
    except Exception:  # noqa: BLE001 - a folder that cannot be read: let the heartbeat decide
        return None
