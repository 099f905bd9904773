"""The EC2 backend: `fit()` for a non-local instance type.

    preflight (spends nothing) -> [dry_run: print the plan, stop] -> checks of the buckets and channels
    -> code upload (content-addressed) -> job folder + spec in S3 -> provision and launch (all or
    nothing) -> detached controller (trainyard/sdk/backends/ec2/controller.py) -> `Ec2Job`

The job folder (`$TRAINYARD_HOME/jobs/<job>/`) is shaped as a local job's, so `describe()`, `wait()`,
`logs()`, `stop()` and `Estimator.attach()` are the same code; `runtime.json` says `"backend": "ec2"`.
"""
from __future__ import annotations

import os
import subprocess
import sys

from trainyard.job import storage
from trainyard.errors import ConfigError, JobFailedError
from trainyard.sdk.jobs.jobstate import Status, job_dir, pid_alive, read_json, write_json
from trainyard.sdk.jobs.job import TrainingJob
from trainyard.job.spec import JobSpec
from trainyard.job.uris import join, split_s3
from trainyard.sdk.backends.ec2 import billing
from trainyard.sdk.backends.aws.session import new_session
from trainyard.sdk.backends.aws.state import check_inputs, state_uri
from trainyard.sdk.backends.ec2.preflight import preflight
from trainyard.sdk.backends.ec2.network import release_unused
from trainyard.sdk.backends.ec2.provision import Cluster, Ledger, find_tagged
from trainyard.sdk.backends.aws.userdata import render_user_data

STOP_TIMEOUT_S = 900.0  # terminating GPU instances and releasing their interfaces takes minutes
# botocore's credential sources (`Credentials.method`) that the controller's own boto3 finds again from the
# profile's name; "env" it finds in the environment it inherits. Any other (keys given to boto3.Session,
# a custom provider) is handed to it as keys.
PROFILE_METHODS = frozenset({"shared-credentials-file", "config-file", "custom-process", "assume-role",
                             "assume-role-with-web-identity", "sso", "login", "iam-role", "container-role",
                             "ec2-credentials-file", "boto-config"})
# what must not reach a controller handed keys: another identity's token or expiry
STALE_CREDENTIAL_VARIABLES = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_CREDENTIAL_EXPIRATION")


class Ec2Job(TrainingJob):
    """A handle on an EC2 job: the local job's, with EC2's stop time, the region in the ARN, and the
    instances' billable time and estimated cost (trainyard/sdk/backends/ec2/billing.py)."""
    stop_timeout_s = STOP_TIMEOUT_S

    def _usage(self, s: dict, until) -> dict:
        region = read_json(f"{self.dir}/runtime.json")["region"]
        return billing.usage(self.spec, region, s.get(billing.KEY, []), until)

    def __repr__(self) -> str:
        return f"Ec2Job({self.name!r})"

    def describe(self) -> dict:
        out = super().describe()
        runtime = read_json(f"{self.dir}/runtime.json")
        out["TrainingJobArn"] = out["TrainingJobArn"].replace(":local:", f":{runtime['region']}:")
        out["ResourceConfig"]["InstanceType"] = f"ml.{self.spec.instance_type}"
        out["EnableManagedSpotTraining"] = self.spec.use_spot_instances
        if self.spec.image_uri:
            out["AlgorithmSpecification"]["TrainingImage"] = self.spec.image_uri
        return out


class Ec2Backend:
    """EC2 instances with EFA, provisioned by this process and followed by a detached controller."""
    name = "ec2"

    def __init__(self, session=None, say=print):
        # every AWS call of the job, the code upload and the controller's included: the user's session
        self.session = session or new_session()  # region and credentials: checked first thing by plan()
        self.say = say

    job_class = Ec2Job

    def check(self, spec: JobSpec) -> None:
        check_inputs(spec)

    def plan(self, spec: JobSpec):
        """Preflight: read-only calls (Describe/Get/List) that find everything a launch would fail on."""
        return preflight(spec, session=self.session)

    def launch(self, spec: JobSpec, plan, upload_code) -> "Ec2Job":
        """Checks the buckets and channels, uploads the code (after every check passed), provisions all
        hosts or none, and starts the controller."""
        _check_storage(spec, self.session)
        if os.path.exists(job_dir(spec.job_name)):
            raise ConfigError("job_name", f"a job named {spec.job_name!r} already exists; choose another name")
        spec = spec.evolve(code_uri=upload_code(spec, s3=storage.s3_client(self.session)))
        return _start(spec, plan, self.session, self.say)


def _check_storage(spec: JobSpec, session) -> None:
    """The buckets exist and the S3 channels are not empty (on the real service: never the embedded store)."""
    s3 = session.client("s3")
    for field in ("output_path", "checkpoint_s3_uri"):
        uri = getattr(spec, field)
        if uri:
            try:
                s3.head_bucket(Bucket=split_s3(uri)[0])
            except Exception:  # noqa: BLE001 - botocore's ClientError: 404 or 403
                raise ConfigError(field, f"bucket {split_s3(uri)[0]!r} of {uri} does not exist or is not "
                                         "accessible; create it first") from None
    for ch in spec.channels:
        if ch.uri.startswith("s3://"):
            bucket, prefix = split_s3(ch.uri)
            if not s3.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1).get("KeyCount"):
                raise ConfigError(f"inputs.{ch.name}", f"nothing found at {ch.uri}; upload the data first or fix the URI")


def _start(spec: JobSpec, plan, session, say) -> "Ec2Job":
    jobdir = job_dir(spec.job_name)
    os.makedirs(f"{jobdir}/logs")
    with open(f"{jobdir}/spec.json", "w") as fh:
        fh.write(spec.to_json())
    fsx = [{"file_system_id": f["file_system_id"], "dns_name": f["dns_name"], "mount_name": f["mount_name"]}
           for f in plan.fsx]
    profile, credentials = controller_session(session)
    runtime = {"backend": "ec2", "region": plan.region, "profile": profile, "state_uri": state_uri(spec),
               "fsx_mounts": fsx, "attempt": 1}
    write_json(f"{jobdir}/runtime.json", runtime)
    status = Status(f"{jobdir}/status.json")
    status.transition("Starting", "Preflight passed: " + plan.describe().splitlines()[0])
    bucket, key = split_s3(join(runtime["state_uri"], "spec.json"))
    session.client("s3").put_object(Bucket=bucket, Key=key, Body=spec.to_json().encode())
    status.transition("LaunchingMLInstances", f"Creating the network and launching {spec.instance_count} x "
                                              f"{plan.instance_type} in {plan.zone}")
    cluster = Cluster(session, spec.job_name, ledger=Ledger(path=f"{jobdir}/ledger.json"), say=say)
    try:
        instances = cluster.provision(plan, lambda attempt: render_user_data(
            spec, state_uri=runtime["state_uri"], region=plan.region, attempt=attempt, fsx_mounts=fsx))
    except KeyboardInterrupt:
        status.transition("Stopped", "Interrupted while provisioning; everything created was deleted", status="Stopped")
        raise
    except Exception as e:
        status.update(FailureReason=f"{type(e).__name__}: {e}"[:1024])
        status.transition("Failed", "Provisioning failed; everything created was deleted", status="Failed")
        raise JobFailedError(spec.job_name, "Failed", str(e)) from e
    billing.launched(status, instances, 1)  # their LaunchTime: the start of the job's instance-hours
    env = {k: v for k, v in os.environ.items() if not (credentials and k in STALE_CREDENTIAL_VARIABLES)}
    with open(f"{jobdir}/logs/supervisor.log", "ab") as log:
        subprocess.Popen([sys.executable, "-m", "trainyard.sdk.backends.ec2.controller", jobdir], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                         env={**env, "AWS_DEFAULT_REGION": plan.region, **credentials})
    return Ec2Job(spec.job_name)


def controller_session(session) -> tuple[str | None, dict[str, str]]:
    """What recreates the user's boto3 `session` in the detached controller, which cannot be handed a Python
    object (its region is runtime.json's): the profile it names (None: boto3's own lookup, as the user's
    session made) and the variables to add to its environment: the keys of a session built from keys,
    never written to disk. Temporary keys handed over this way expire while the controller runs."""
    credentials = session.get_credentials()
    method = getattr(credentials, "method", None)
    if credentials is None or method == "env":
        return None, {}  # preflight refuses a session without credentials; "env": the controller inherits them
    if method in PROFILE_METHODS:
        profile = session.profile_name  # "default" when none was named: named only when it exists
        return (profile if profile in session.available_profiles else None), {}
    frozen = credentials.get_frozen_credentials()
    keys = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
    if frozen.token:
        keys["AWS_SESSION_TOKEN"] = frozen.token
    return None, keys


def gc(session, *, say=print, include_running: bool = False) -> dict[str, list[str]]:
    """Delete what ended jobs left behind, found by their `trainyard:job` tag. A job whose controller still
    runs here is skipped; so is one with pending or running instances unless `include_running` (a job
    started from another machine looks like that). Returns {job: what could not be deleted}."""

    order = ("subnet", "route-table", "vpc-endpoint", "elastic-ip", "nat-gateway", "endpoint-use", "security-group",
             "placement-group", "instance-profile", "launch-template", "instance")
    by_job: dict[str, list[dict]] = {}
    found = find_tagged(session)
    for kind in order:  # creation order: teardown goes the other way
        items = found[kind]
        for item in items:
            if kind == "instance" and item["state"] == "terminated":
                continue
            by_job.setdefault(item["job"], []).append({"kind": kind, **item})
    left: dict[str, list[str]] = {}
    for job, items in sorted(by_job.items()):
        try:
            pid = read_json(f"{job_dir(job)}/supervisor.json")["pid"]
            status = read_json(f"{job_dir(job)}/status.json")["TrainingJobStatus"]
            if pid_alive(pid) and status == "InProgress":
                say(f"{job}: in progress (controller pid {pid}); skipped")
                continue
        except (OSError, ValueError, KeyError):
            pass
        running = [i["id"] for i in items if i["kind"] == "instance" and i["state"] in ("pending", "running")]
        if running and not include_running:
            say(f"{job}: instances {running} are running; skipped (--include-running to delete them too)")
            continue
        say(f"{job}: deleting {len(items)} resource(s)")
        left[job] = Cluster(session, job, ledger=Ledger(items=items), say=say).teardown()
    release_unused(session.client("ec2"), say)  # shared endpoints that a crash or a race left with no user
    return left
