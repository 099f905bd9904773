"""The local backend: every host is a group of processes on this machine, supervised per job.

`LocalBackend` is the backend protocol's (sdk/backends/__init__.py) local implementation: `plan` checks the channels
and buckets on the job's endpoint (reads only), `launch` creates the buckets the job writes to (on the
embedded store only), uploads the code, creates the job folder (see `jobstate.py`) and starts the detached
supervisor (`supervisor.py`); `LocalJob` reads the folder.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import trainyard
from trainyard.job import storage
from trainyard.errors import ConfigError
from trainyard.job.spec import BUILTIN_TRAINER, JobSpec
from trainyard.job.uris import check_s3_uri, split_s3
from trainyard.sdk.backends.local import containers
from trainyard.sdk.jobs.job import TrainingJob
from trainyard.sdk.jobs.jobstate import Status, job_dir, write_json
from trainyard.sdk.store import Endpoint, ensure_store, trainyard_home
from trainyard.sdk.store_auth import private_folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalJob(TrainingJob):
    """A job whose hosts are process groups on this machine."""


@dataclass(frozen=True, slots=True)
class LocalPlan:
    """What a local job would run: nothing is created that costs money."""

    spec: JobSpec

    def describe(self) -> str:
        s = self.spec
        where = f", each host in a container of {s.image_uri}" if s.image_uri else ""
        return (f"local job: {s.instance_count} host(s) x {s.processes_per_host} process(es) on this machine "
                f"({os.cpu_count()} cores){where}, code {s.entry_point}, output {s.output_path}; price $0")


class LocalBackend:
    """Every host is a group of processes on this machine; `s3://` is the embedded store (or
    AWS_ENDPOINT_URL)."""

    name = "local"
    job_class = LocalJob

    def __init__(self, session=None):
        self.endpoint: Endpoint | None = None

    def check(self, spec: JobSpec) -> None:
        if os.path.exists(job_dir(spec.job_name)):
            raise ConfigError("job_name", f"a job named {spec.job_name!r} already exists; choose another name")
        cap = max_local_processes()
        if spec.world_size > cap:
            raise ConfigError("instance_count", f"{spec.instance_count} host(s) x {spec.processes_per_host} process(es) "
                                                f"= {spec.world_size} processes on this machine ({os.cpu_count()} "
                                                f"cores); local jobs run at most {cap} ({CAP_ENV} raises it)")
        if spec.image_uri:  # the hosts in containers: the engine and the image, before anything is made
            stale = containers.check_image(containers.find_engine(), spec.image_uri, trainyard.__version__)
            if stale:
                print(f"[trainyard] warning: {stale}", file=sys.stderr, flush=True)
        path = spec.checkpoint_local_path
        if spec.checkpoint_s3_uri and not (path == "/opt/ml" or path.startswith("/opt/ml/")):
            raise ConfigError("checkpoint_local_path", f"{path!r}: a local job's hosts share this machine's files, so a "
                                                       "path outside /opt/ml would be one folder of this machine for "
                                                       "every host; give a path under /opt/ml "
                                                       "(default /opt/ml/checkpoints)")

    def plan(self, spec: JobSpec) -> LocalPlan:
        """Checks the channels and buckets on the job's endpoint (starting the embedded store if needed)."""
        self.endpoint = ensure_store()
        with storage_env(self.endpoint.env()):
            for ch in spec.channels:
                if ch.uri.startswith("s3://"):
                    check_channel(f"inputs.{ch.name}", ch.uri)
            if not self.endpoint.embedded:
                for field in ("output_path", "checkpoint_s3_uri"):
                    check_bucket(field, getattr(spec, field))
        return LocalPlan(spec)

    def launch(self, spec: JobSpec, plan: LocalPlan, upload_code) -> LocalJob:
        with storage_env(self.endpoint.env()):
            if self.endpoint.embedded:  # every check has passed: now the job's buckets may be created
                create_buckets(written_buckets(spec))
            spec = spec.evolve(code_uri=upload_code(spec))
        return launch(spec, self.endpoint)


CAP_ENV = "TRAINYARD_LOCAL_MAX_PROCESSES"


def max_local_processes() -> int:
    """The most processes a local job may start: 8 per core (at least 16), or `TRAINYARD_LOCAL_MAX_PROCESSES`.
    Each process imports torch (a few hundred MB); a thousand of them take the machine down."""
    return int(os.environ.get(CAP_ENV) or max(16, 8 * (os.cpu_count() or 1)))


def launch(spec: JobSpec, endpoint: Endpoint) -> LocalJob:
    jobdir = job_dir(spec.job_name)
    if os.path.exists(jobdir):
        raise ConfigError("job_name", f"a job named {spec.job_name!r} already exists ({jobdir}); choose another name")
    # the owner's alone: the spec and runtime.json hold environment values and the store's key
    for folder in (trainyard_home(), os.path.dirname(jobdir), jobdir):
        private_folder(folder)
    for sub in ("hosts", "logs", "torchrun"):
        os.makedirs(f"{jobdir}/{sub}")
    with open(os.open(f"{jobdir}/spec.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
        fh.write(spec.to_json())
    env = dict(endpoint.env())
    # requirements.txt overlays are shared by every job of this machine (container/requirements.py)
    env["TRAINYARD_REQUIREMENTS_CACHE"] = os.path.join(trainyard_home(), "cache", "requirements")
    if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in spec.environment:
        # all hosts share this machine's cores: one thread per process unless there are cores to spare
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.world_size))
    write_json(f"{jobdir}/runtime.json", {
        "master_port": free_port(), "env": env, "embedded_store": endpoint.embedded, "private_opt_ml": True,
    })
    Status(f"{jobdir}/status.json").transition("Starting", "Launching the supervisor")
    with open(f"{jobdir}/logs/supervisor.log", "ab") as log:
        subprocess.Popen([sys.executable, "-m", "trainyard.sdk.backends.local.supervisor", jobdir], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    return LocalJob(spec.job_name)


def check_channel(field: str, uri: str) -> None:
    """An `s3://` channel holds objects on the job's endpoint (a read: nothing is created)."""
    from botocore.exceptions import ClientError

    try:
        found = storage.list_files(uri)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("NoSuchBucket", "404", "NotFound"):
            raise
        raise ConfigError(field, f"bucket {split_s3(uri)[0]!r} of {uri} does not exist; upload the data first "
                                 "(e.g. Session().upload_data) or fix the URI") from None
    if not found:
        raise ConfigError(field, f"nothing found at {uri}; upload the data first or fix the URI")


def written_buckets(spec: JobSpec) -> list[str]:
    """The buckets a job writes to: output_path's, checkpoint_s3_uri's, and the built-in trainer's
    `checkpoint_uri` hyperparameter's (a malformed one is left to the trainer to report). The code
    upload's bucket (code_location, default output_path) is created by the write itself."""
    uris = [spec.output_path, spec.checkpoint_s3_uri]
    if spec.entry_kind == "module" and spec.entry_point == BUILTIN_TRAINER:
        uris.append(spec.hyperparameters.get("checkpoint_uri"))
    buckets = []
    for uri in uris:
        try:
            check_s3_uri("uri", uri)
        except ConfigError:
            continue  # not s3:// (file://, none), or malformed
        if split_s3(uri)[0] not in buckets:
            buckets.append(split_s3(uri)[0])
    return buckets


def create_buckets(buckets: list[str]) -> None:
    """Create the missing ones of `buckets` on this process's endpoint. Only for the embedded store:
    Trainyard never creates buckets on an endpoint the user configured or on real S3."""
    from botocore.exceptions import ClientError

    s3 = storage.s3_client()
    for bucket in buckets:
        try:
            s3.head_bucket(Bucket=bucket)
            continue
        except ClientError:
            pass
        try:
            s3.create_bucket(Bucket=bucket)
        except ClientError as e:  # another job made it meanwhile
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise


def check_bucket(field: str, uri: str | None) -> None:
    """A bucket of an endpoint the user configured exists (Trainyard creates buckets only in its own store)."""
    if not uri or not uri.startswith("s3://"):
        return
    bucket = split_s3(uri)[0]
    try:
        storage.s3_client().head_bucket(Bucket=bucket)
    except Exception:  # noqa: BLE001 - botocore's ClientError: 404 or 403
        raise ConfigError(field, f"bucket {bucket!r} of {uri} does not exist or is not accessible; create it "
                                 "first (Trainyard creates buckets only in its embedded store)") from None


@contextmanager
def storage_env(env: dict[str, str]):
    """Point this process's S3 calls at the job's endpoint while the job is prepared."""
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
