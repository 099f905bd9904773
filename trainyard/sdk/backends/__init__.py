"""The one backend protocol: `fit()` has a single path for every place a job can run.

    backend = backend_for(spec, session)   # spec.backend, else by instance type: local (and local_gpu), EC2
    backend.check(spec)                    # cheap checks that need no service: raise ConfigError
    plan = backend.plan(spec)              # read-only checks against the services; what would be created
    job = backend.launch(spec, plan, upload_code)   # uploads the code, creates, starts -> TrainingJob

`session` is the user's boto3 Session (`boto_session`, or `sagemaker_session`'s): the EC2 and SageMaker backends
make every AWS call through it, and they and the Kubernetes backend call `upload_code(spec, s3=client)` with its
S3 client; the local backend ignores it and calls `upload_code(spec)` (boto3's default client, pointed at the
job's endpoint). The Kubernetes backend (sdk/backends/kubernetes/) talks to the cluster of the job's kubeconfig.

`fit(dry_run=True)` stops after `plan` and prints `plan.describe()`. Each backend's job handle is a
`TrainingJob` (sdk/jobs/job.py) over the same job folder; `runtime.json` names the backend, so `open_job`
finds the right handle from any process.
"""
from __future__ import annotations

import os
from typing import Callable, Protocol

from trainyard.job import catalog
from trainyard.job.spec import JobSpec
from trainyard.sdk.backends.ec2.backend import Ec2Backend
from trainyard.sdk.backends.sagemaker.backend import SageMakerBackend
from trainyard.sdk.jobs.job import TrainingJob
from trainyard.sdk.jobs.jobstate import job_dir, read_json
from trainyard.sdk.backends.kubernetes.backend import KubernetesBackend
from trainyard.sdk.backends.local.backend import LocalBackend


class Plan(Protocol):
    def describe(self) -> str: ...


class Backend(Protocol):
    name: str
    job_class: type[TrainingJob]

    def check(self, spec: JobSpec) -> None: ...

    def plan(self, spec: JobSpec) -> Plan: ...

    def launch(self, spec: JobSpec, plan: Plan, upload_code: Callable[..., str | None]) -> TrainingJob: ...


BACKENDS: dict[str, type] = {"local": LocalBackend, "ec2": Ec2Backend, "sagemaker": SageMakerBackend,
                             "kubernetes": KubernetesBackend}


def backend_for(spec: JobSpec, session=None) -> Backend:
    """The spec's `backend`, else by its instance type: `local`/`local_gpu` run here, the rest on EC2."""
    name = spec.backend or ("local" if catalog.lookup(spec.instance_type).is_local else "ec2")
    return BACKENDS[name](session=session)


def open_job(job_name: str) -> TrainingJob:
    """The handle of an existing job, whichever backend ran it, by name (from any process)."""
    runtime = f"{job_dir(job_name)}/runtime.json"
    name = read_json(runtime).get("backend", "local") if os.path.exists(runtime) else "local"
    return BACKENDS[name].job_class(job_name)
