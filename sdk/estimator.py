"""`Estimator`: SageMaker's argument names, Trainyard's backends.

    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                    hyperparameters={"steps": 20}, checkpoint_s3_uri="s3://my-bucket/ckpt")
    est.fit()
    est.latest_training_job.metrics()

Every argument is checked when the Estimator is built; `fit()` checks the inputs, then packages and
uploads the code, then starts the job: nothing is uploaded or started before all checks pass.
"""
from __future__ import annotations

import importlib.util
import os
import re
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from trainyard.sdk import catalog
from trainyard.sdk.errors import ConfigError
from trainyard.sdk.spec import BUILTIN_TRAINER, DEFAULT_MAX_RUN, JOB_NAME, MODULE_NAME, JobSpec, build_spec
from trainyard.sdk.uris import check_storage_uri, split_s3



class Estimator:
    def __init__(
        self,
        entry_point: str,
        source_dir: str | None = None,
        hyperparameters: dict[str, Any] | None = None,
        instance_type: str = "local",
        instance_count: int = 1,
        processes_per_host: int | None = None,
        distribution: dict | None = None,
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
        max_retry_attempts: int = 0,
        boto_session=None,
    ):
        itype = catalog.lookup(instance_type)
        self.instance_type = instance_type
        self.source_dir = source_dir
        self._entry_file, entry, kind = _resolve_entry_point(entry_point, source_dir)
        if output_path is None:
            if itype.name != catalog.LOCAL:
                raise ConfigError("output_path", f"required for instance_type {instance_type!r}: an s3:// prefix")
            from trainyard.sdk.store import DEFAULT_BUCKET

            output_path = f"s3://{DEFAULT_BUCKET}"
        if code_location is not None:
            check_storage_uri("code_location", code_location)
        self.code_location = code_location
        self.base_job_name = base_job_name or _default_base_name(entry)
        _check_job_name("base_job_name", self.base_job_name, max_len=63 - len("-YYYYMMDD-HHMMSS-fff"))
        fields: dict[str, Any] = dict(
            entry_point=entry, entry_kind=kind, hyperparameters=hyperparameters, instance_type=instance_type,
            instance_count=instance_count,
            processes_per_host=itype.processes_per_host if processes_per_host is None else processes_per_host,
            distribution=distribution, environment=environment, checkpoint_s3_uri=checkpoint_s3_uri,
            output_path=output_path, max_run=max_run, role=role, image_uri=image_uri, subnets=subnets,
            use_spot_instances=use_spot_instances, max_wait=max_wait, max_retry_attempts=max_retry_attempts,
        )
        if checkpoint_local_path is not None:
            fields["checkpoint_local_path"] = checkpoint_local_path
        if emulated_network is not None:
            from trainyard.sdk.netem import unavailable_reason

            if itype.name != catalog.LOCAL:
                raise ConfigError("emulated_network", "only for instance_type='local'")
            why = unavailable_reason()
            if why:
                raise ConfigError("emulated_network", why)
            fields["emulated_network"] = emulated_network
        self._spec = build_spec(**fields)
        from trainyard.sdk.distribution import normalize

        typed = normalize(self._spec.distribution, world_size=self._spec.world_size,
                          processes_per_host=self._spec.processes_per_host)
        if kind == "module" and entry == BUILTIN_TRAINER:
            _check_builtin_hyperparameters(self._spec, typed)
        self.boto_session = boto_session  # EC2 jobs: the boto3 Session to use (default: boto3.Session())
        self.latest_training_job = None

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

    def fit(self, inputs=None, wait: bool = True, logs: bool = True, job_name: str | None = None,
            dry_run: bool = False):
        """Check the inputs, package and upload the code, start the job; with `wait`, follow it to the end.

        With `dry_run` (EC2 jobs), run the preflight checks, print the plan with its price and return it,
        creating nothing."""
        spec = self._job_spec(inputs, job_name)
        channels = list(spec.channels)
        name = spec.job_name
        if catalog.lookup(spec.instance_type).name != catalog.LOCAL:
            from trainyard.sdk.aws import backend

            job = backend.launch(spec, upload_code=self._upload_code, session=self.boto_session, dry_run=dry_run)
            if dry_run:
                return job
            self.latest_training_job = job
            if wait:
                job.wait(logs=logs)
            return job
        if dry_run:
            raise ConfigError("dry_run", "a plan is for EC2 jobs; a local job creates nothing that costs money")
        from trainyard.sdk import local, storage
        from trainyard.sdk.jobstate import job_dir
        from trainyard.sdk.store import ensure_store

        if os.path.exists(job_dir(name)):
            raise ConfigError("job_name", f"a job named {name!r} already exists; choose another name")
        endpoint = ensure_store()
        with _storage_env(endpoint.env()):
            for ch in channels:
                if ch.uri.startswith("s3://") and not storage.list_files(ch.uri):
                    raise ConfigError(f"inputs.{ch.name}", f"nothing found at {ch.uri}; upload the data first "
                                                           "or fix the URI")
            if not endpoint.embedded:
                for field in ("output_path", "checkpoint_s3_uri"):
                    _check_bucket(field, getattr(spec, field))
            code_uri = self._upload_code(spec)
        spec = build_spec(**{**spec.model_dump(), "code_uri": code_uri})
        job = local.launch(spec, endpoint)
        self.latest_training_job = job
        if wait:
            job.wait(logs=logs)
        return job

    def _job_spec(self, inputs, job_name: str | None) -> JobSpec:
        """The spec of one job: the Estimator's, named (`job_name`, or base_job_name and the time), with
        the channels of `inputs`."""
        from trainyard.sdk.inputs import to_channels

        channels = to_channels(inputs)
        name = job_name or f"{self.base_job_name}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S-%f')[:-3]}"
        _check_job_name("job_name", name)
        return build_spec(**{**self._spec.model_dump(), "job_name": name, "channels": channels})

    def to_terraform(self, path: str, inputs=None, *, job_name: str | None = None, region: str | None = None,
                     availability_zone_id: str | None = None, cluster: dict | None = None,
                     data_s3_uri: str | None = None, fsx_mounts: list[dict] | None = None) -> list[str]:
        """Render the job `fit(inputs)` would run as a Terraform root module in `path`, using
        infra/modules (see sdk/terraform.py for the folder and the arguments); returns the files written.

        Nothing is uploaded or created: the code (when there is code to ship) is packaged into
        `path/sourcedir.tar.gz` and its content-addressed `code_uri` goes into the spec; `terraform apply`
        uploads it. The region defaults to `boto_session`'s, then AWS_REGION / AWS_DEFAULT_REGION."""
        from trainyard.sdk import packaging, terraform
        from trainyard.sdk.uris import join

        spec = self._job_spec(inputs, job_name)
        if catalog.lookup(spec.instance_type).name == catalog.LOCAL:
            raise ConfigError("instance_type", "Terraform renders EC2 jobs: give an EC2 instance type such as "
                                               "'ml.p5.48xlarge'")
        archive = None
        if not (spec.entry_kind == "module" and self.source_dir is None):
            pkg = packaging.package(self.source_dir, self._entry_file)
            spec = build_spec(**{**spec.model_dump(), "code_uri": join(self.code_location or spec.output_path, pkg.key)})
            archive = pkg.data
        if region is None and self.boto_session is not None:
            region = self.boto_session.region_name
        return terraform.render_root_module(spec, path, cluster=cluster, region=region,
                                            availability_zone_id=availability_zone_id, data_s3_uri=data_s3_uri,
                                            fsx_mounts=fsx_mounts, code_archive=archive)

    def _upload_code(self, spec: JobSpec) -> str | None:
        from trainyard.sdk import packaging

        if spec.entry_kind == "module" and self.source_dir is None:
            return None  # an installed module: nothing to ship
        pkg = packaging.package(self.source_dir, self._entry_file)
        return packaging.upload(pkg, self.code_location or spec.output_path)

    @classmethod
    def attach(cls, job_name: str) -> "Estimator":
        """An Estimator bound to an existing job (local or EC2), found by name (from any process)."""
        from trainyard.sdk.local import open_job

        job = open_job(job_name)
        est = cls.__new__(cls)
        est._spec = job.spec.model_copy(update={"job_name": None, "channels": ()})
        est.source_dir, est._entry_file, est.code_location, est.boto_session = None, None, None, None
        est.instance_type = job.spec.instance_type
        est.base_job_name = job_name
        est.latest_training_job = job
        return est


def _resolve_entry_point(entry_point: object, source_dir: str | None) -> tuple[str | None, str, str]:
    """-> (file to package when there is no source_dir, entry point as the job sees it, 'script'|'module')."""
    if not isinstance(entry_point, str) or not entry_point.strip():
        raise ConfigError("entry_point", "missing: give a script ('train.py', inside source_dir) or an installed "
                                         "module ('trainyard.engine.train')")
    if source_dir is not None:
        if not isinstance(source_dir, str) or not os.path.isdir(source_dir):
            raise ConfigError("source_dir", f"{source_dir!r} is not a directory; give the folder holding {entry_point!r}")
        if os.path.isfile(os.path.join(source_dir, entry_point)):
            return None, entry_point, "script"
        if MODULE_NAME.match(entry_point) and not entry_point.endswith(".py"):
            return None, entry_point, "module"
        raise ConfigError("entry_point", f"{entry_point!r} is not a file in source_dir {source_dir!r}")
    if os.path.isfile(entry_point):
        return entry_point, os.path.basename(entry_point), "script"
    if MODULE_NAME.match(entry_point) and not entry_point.endswith(".py"):
        try:
            found = importlib.util.find_spec(entry_point) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return None, entry_point, "module"
    raise ConfigError("entry_point", f"{entry_point!r} is neither a file nor an installed module; pass source_dir "
                                     "with the script in it, or a module name such as 'trainyard.engine.train'")


def _check_builtin_hyperparameters(spec: JobSpec, distribution: dict) -> None:
    """The built-in trainer's hyperparameters are known: check them now, not minutes later in the job."""
    from trainyard.container.contract import user_args
    from trainyard.engine.config import parse_hyperparameters, reconcile_distribution
    from trainyard.engine.distributed.parallelism import Parallelism

    par = Parallelism.parse(distribution)
    try:
        cfg = parse_hyperparameters(user_args(spec.hyperparameters))
        cfg.accumulation(par.data_parallel_degree(spec.world_size))  # the batch splits over dp ranks
    except ValueError as e:
        raise ConfigError("hyperparameters", f"{e} (for {BUILTIN_TRAINER})") from None
    try:
        reconcile_distribution(cfg, par, spec.world_size)
    except ValueError as e:
        raise ConfigError("distribution", str(e)) from None


def _default_base_name(entry: str) -> str:
    base = re.sub(r"[^A-Za-z0-9]+", "-", entry.removesuffix(".py").rsplit(".", 1)[-1]).strip("-")
    return (base or "trainyard")[:40]


def _check_job_name(field: str, name: object, max_len: int = 63) -> None:
    if not isinstance(name, str) or not JOB_NAME.match(name) or len(name) > max_len:
        raise ConfigError(field, f"{name!r} is not a valid name: up to {max_len} letters, digits and hyphens, "
                                 "starting and ending with a letter or digit")


def _check_bucket(field: str, uri: str | None) -> None:
    if not uri or not uri.startswith("s3://"):
        return
    from botocore.exceptions import ClientError

    from trainyard.sdk.storage import s3_client

    bucket = split_s3(uri)[0]
    try:
        s3_client().head_bucket(Bucket=bucket)
    except ClientError:
        raise ConfigError(field, f"bucket {bucket!r} of {uri} does not exist or is not accessible; create it "
                                 "first (Trainyard creates buckets only in its embedded store)") from None


@contextmanager
def _storage_env(env: dict[str, str]):
    """Point this process's S3 calls at the job's endpoint while `fit()` prepares the job."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
