"""The local backend: every host is a group of processes on this machine, supervised per job.

`LocalBackend` is the backend protocol's (sdk/backends.py) local implementation: `plan` checks the channels
and buckets on the job's endpoint, `launch` uploads the code, creates the job folder (see `jobstate.py`) and
starts the detached supervisor (`supervisor.py`); `LocalJob` reads the folder.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass

from trainyard.job import storage
from trainyard.job.errors import ConfigError
from trainyard.job.spec import JobSpec, build_spec
from trainyard.job.uris import split_s3
from trainyard.sdk.job import TrainingJob
from trainyard.sdk.jobstate import Status, job_dir, write_json
from trainyard.sdk.store import Endpoint, ensure_store, trainyard_home


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
        return (f"local job: {s.instance_count} host(s) x {s.processes_per_host} process(es) on this machine "
                f"({os.cpu_count()} cores), code {s.entry_point}, output {s.output_path}; price $0")


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

    def plan(self, spec: JobSpec) -> LocalPlan:
        """Checks the channels and buckets on the job's endpoint (starting the embedded store if needed)."""
        self.endpoint = ensure_store()
        with storage_env(self.endpoint.env()):
            for ch in spec.channels:
                if ch.uri.startswith("s3://") and not storage.list_files(ch.uri):
                    raise ConfigError(f"inputs.{ch.name}", f"nothing found at {ch.uri}; upload the data first "
                                                           "or fix the URI")
            if not self.endpoint.embedded:
                for field in ("output_path", "checkpoint_s3_uri"):
                    check_bucket(field, getattr(spec, field))
        return LocalPlan(spec)

    def launch(self, spec: JobSpec, plan: LocalPlan, upload_code) -> LocalJob:
        with storage_env(self.endpoint.env()):
            spec = build_spec(**{**spec.model_dump(), "code_uri": upload_code(spec)})
        return launch(spec, self.endpoint)


def launch(spec: JobSpec, endpoint: Endpoint) -> LocalJob:
    jobdir = job_dir(spec.job_name)
    if os.path.exists(jobdir):
        raise ConfigError("job_name", f"a job named {spec.job_name!r} already exists ({jobdir}); choose another name")
    for sub in ("hosts", "logs", "torchrun"):
        os.makedirs(f"{jobdir}/{sub}")
    with open(f"{jobdir}/spec.json", "w") as fh:
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
        subprocess.Popen([sys.executable, "-m", "trainyard.sdk.supervisor", jobdir], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    return LocalJob(spec.job_name)


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
