"""SageMaker's `Session` for what a training notebook does with it: the default bucket, uploads and
downloads of data, the region; `get_execution_role`; `LocalSession`.

For local jobs (and with no AWS configuration) the bucket lives in the embedded store (sdk/store.py), so
a notebook's first cells (`session.default_bucket()`, `session.upload_data("data", ...)`) work on a
laptop with no credentials. `Session(boto_session=...)` with a real boto3 session uses real S3, and the
default bucket is SageMaker's name for it: `sagemaker-<region>-<account>` (created when missing, as
SageMaker does). An Estimator given `sagemaker_session=Session(boto_session=...)` makes every AWS call of
its EC2 jobs through that boto3 session, as if given `boto_session=` (sdk/backends/ec2/backend.py).
"""
from __future__ import annotations

import os

from trainyard.job import storage
from trainyard.errors import ConfigError, known_keywords
from trainyard.job.uris import join
from trainyard.sdk.backends import open_job
from trainyard.sdk.backends.local.backend import storage_env
from trainyard.sdk import store
from trainyard.sdk.store import DEFAULT_BUCKET, ensure_store

LOCAL_ROLE = "arn:aws:iam::000000000000:role/trainyard-local"


class Session:
    """`trainyard.Session()`: the embedded store when no boto3 session is given and no AWS endpoint or
    credentials point elsewhere; `Session(boto_session=boto3.Session(...))` for real S3. SageMaker's
    arguments in SageMaker's order; the clients, `settings` and `sagemaker_config` are accepted and unused."""

    local = False

    @known_keywords
    def __init__(self, boto_session=None, sagemaker_client=None, sagemaker_runtime_client=None,
                 sagemaker_featurestore_runtime_client=None, default_bucket: str | None = None, settings=None,
                 sagemaker_metrics_client=None, sagemaker_config: dict | None = None,
                 default_bucket_prefix: str | None = None):
        self.boto_session = boto_session
        self._default_bucket = default_bucket
        self.default_bucket_prefix = default_bucket_prefix
        self.config = None
        self._sagemaker_client = sagemaker_client
        self._store_env_decided = False

    @property
    def sagemaker_client(self):
        """The client given to the constructor, else one that answers the SageMaker API calls a notebook makes about
        its training jobs (`describe_training_job`, `stop_training_job`) from Trainyard's own jobs."""
        return self._sagemaker_client or JobsClient()

    def describe_training_job(self, job_name: str) -> dict:
        """SageMaker's `describe()` of the job (`DescribeTrainingJob`'s fields)."""
        return open_job(job_name).describe()

    def logs_for_job(self, job_name: str, wait: bool = False, poll: float = 10, log_type: str = "All",
                     timeout: float | None = None) -> None:
        """Print the job's log; with `wait`, follow it to its end and raise (an UnexpectedStatusException) when it
        failed, as SageMaker's `logs_for_job` does."""
        job = open_job(job_name)
        if wait:
            job.wait(logs=log_type)
        else:
            job.logs(wait=False)

    def wait_for_job(self, job: str, poll: float = 5) -> dict:
        """Block until the job ends; its description. Raises when it failed, as SageMaker's does."""
        return open_job(job).wait(logs="None")

    def stop_training_job(self, job_name: str) -> None:
        open_job(job_name).stop()

    @property
    def embedded(self) -> bool:
        """True when this session's S3 is the one local jobs use: Trainyard's embedded store, or the
        endpoint AWS_ENDPOINT_URL names."""
        return self.boto_session is None

    @property
    def boto_region_name(self) -> str:
        if self.boto_session is not None:
            return self.boto_session.region_name
        return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"

    def _env(self) -> dict[str, str]:
        if not self.embedded:
            return {}
        # the session's first S3 call (default_bucket(), upload_data(), ...): from then on the notebook's own s3://
        # calls reach the same store, where no AWS is configured (decided once: it resolves AWS credentials)
        if not self._store_env_decided:
            export_store_env()
            self._store_env_decided = True
        return ensure_store().env()

    def _s3(self):
        if self.embedded:
            with storage_env(self._env()):
                return storage.s3_client()
        return storage.s3_client(self.boto_session)  # the session's credentials and region

    def default_bucket(self) -> str:
        """The bucket jobs write to by default, created if missing (as SageMaker does): locally the
        embedded store's (or AWS_ENDPOINT_URL's) `trainyard-default`; on AWS `sagemaker-<region>-<account>`."""
        if self._default_bucket:
            return self._default_bucket
        if self.embedded:
            name = DEFAULT_BUCKET
        else:
            account = self.boto_session.client("sts").get_caller_identity()["Account"]
            name = f"sagemaker-{self.boto_region_name}-{account}"
        s3 = self._s3()
        try:
            s3.head_bucket(Bucket=name)
        except Exception:  # noqa: BLE001 - botocore's ClientError (404): create it
            kw = {} if self.boto_region_name == "us-east-1" else {
                "CreateBucketConfiguration": {"LocationConstraint": self.boto_region_name}}
            s3.create_bucket(Bucket=name, **kw)
        self._default_bucket = name
        return name

    def upload_data(self, path: str, bucket: str | None = None, key_prefix: str = "data",
                    extra_args: dict | None = None, callback=None) -> str:
        """Upload a file or a folder (recursively) to `s3://bucket/key_prefix/`; returns the S3 URI: of the
        file for a file, of the prefix for a folder (SageMaker's return values)."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"upload_data: {path} does not exist")
        bucket = bucket or self.default_bucket()
        prefix = self._prefixed(key_prefix)
        s3 = self._s3()
        if os.path.isfile(path):
            key = f"{prefix}/{os.path.basename(path)}" if prefix else os.path.basename(path)
            s3.upload_file(path, bucket, key, ExtraArgs=extra_args)
            return f"s3://{bucket}/{key}"
        for dirpath, _dirs, files in os.walk(path):
            for f in sorted(files):
                full = os.path.join(dirpath, f)
                rel = os.path.relpath(full, path).replace(os.sep, "/")
                s3.upload_file(full, bucket, f"{prefix}/{rel}" if prefix else rel, ExtraArgs=extra_args)
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def download_data(self, path: str, bucket: str, key_prefix: str = "", extra_args: dict | None = None) -> list[str]:
        """Download every object under `s3://bucket/key_prefix` into the folder `path`; returns the files."""
        s3 = self._s3()
        os.makedirs(path, exist_ok=True)
        out = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                rel = key[len(key_prefix):].lstrip("/") if key_prefix and key != key_prefix else os.path.basename(key)
                if not rel or key.endswith("/"):
                    continue
                dest = os.path.join(path, rel)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                s3.download_file(bucket, key, dest, ExtraArgs=extra_args)
                out.append(dest)
        return out

    def upload_string_as_file_body(self, body: str, bucket: str, key: str, kms_key: str | None = None) -> str:
        self._s3().put_object(Bucket=bucket, Key=key, Body=body.encode())
        return f"s3://{bucket}/{key}"

    def read_s3_file(self, bucket: str, key_prefix: str) -> str:
        return self._s3().get_object(Bucket=bucket, Key=key_prefix)["Body"].read().decode()

    def list_s3_files(self, bucket: str, key_prefix: str) -> list[str]:
        keys = []
        for page in self._s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return keys

    def _prefixed(self, key_prefix: str) -> str:
        parts = [p.strip("/") for p in (self.default_bucket_prefix, key_prefix) if p and p.strip("/")]
        return "/".join(parts)

    def output_path(self) -> str:
        """Where jobs write when the Estimator has no output_path: the default bucket (and prefix)."""
        prefix = (self.default_bucket_prefix or "").strip("/")
        base = f"s3://{self.default_bucket()}"
        return join(base, prefix) if prefix else base


# every variable that points boto3 (or s3fs, datasets) at an account or an endpoint
_AWS_SET = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE")


def aws_configured() -> bool:
    """Whether this process would reach a real AWS account (or another endpoint) with its ordinary boto3 calls:
    an endpoint or credentials in the environment, a profile or credentials file, or the instance's role (IMDS,
    asked once with a short timeout: a notebook on SageMaker or EC2 has one)."""
    if any(os.environ.get(v) for v in _AWS_SET):
        return True
    import botocore.session

    session = botocore.session.get_session()
    # whole seconds: botocore makes 0.5 an int, 0, then refuses it, and the refusal read as "configured" here
    session.set_config_variable("metadata_service_timeout", 1)
    session.set_config_variable("metadata_service_num_attempts", 1)
    try:
        return session.get_credentials() is not None
    except Exception:  # noqa: BLE001 - a broken profile or file: someone configured AWS, so leave it alone
        return True


def export_store_env() -> bool:
    """Where no AWS account or endpoint is configured, point this process's own boto3, s3fs and `datasets` calls at
    the embedded store (its endpoint, region and this user's credentials into os.environ), so that a notebook's
    `s3://` reads and writes reach the same store its jobs use, as `trainyard store creds` would by hand. Never where
    real credentials are present: nobody's real S3 calls are redirected. Returns whether it exported (or had)."""
    if store.exported():
        return True
    if aws_configured():
        return False
    store.export_env()
    return True


class JobsClient:
    """The part of boto3's SageMaker client that a training notebook calls about its jobs, answered by Trainyard's
    jobs (of this machine, or followed from it): `describe_training_job(TrainingJobName=...)` and
    `stop_training_job(TrainingJobName=...)`. Other calls are refused by name."""

    def describe_training_job(self, TrainingJobName: str) -> dict:  # noqa: N803 - boto3's argument name
        return open_job(TrainingJobName).describe()

    def stop_training_job(self, TrainingJobName: str) -> dict:  # noqa: N803
        open_job(TrainingJobName).stop()
        return {}

    def __getattr__(self, name: str):
        raise AttributeError(f"Session().sagemaker_client.{name}: Trainyard answers describe_training_job and "
                             "stop_training_job about its jobs; for anything else of SageMaker's API pass "
                             "Session(sagemaker_client=boto3.client('sagemaker'))")


class LocalSession(Session):
    """SageMaker's `LocalSession` (local mode): jobs and data on this machine. `config` is accepted
    (`{"local": {"local_code": True}}`: code is always read from this machine here)."""

    local = True

    @known_keywords
    def __init__(self, boto_session=None, default_bucket: str | None = None, s3_endpoint_url: str | None = None,
                 disable_local_code: bool = False, sagemaker_config: dict | None = None,
                 default_bucket_prefix: str | None = None):
        super().__init__(boto_session=None, default_bucket=default_bucket, default_bucket_prefix=default_bucket_prefix)
        self.s3_endpoint_url = s3_endpoint_url


def get_execution_role(sagemaker_session=None, use_default: bool = False) -> str:
    """The IAM role jobs run with: `TRAINYARD_ROLE_ARN` if set; otherwise, given a session with a boto3
    session (`Session(boto_session=...)`), the caller's role (an assumed-role identity's role ARN);
    otherwise a local placeholder ARN, which local jobs record and EC2 preflight refuses."""
    role = os.environ.get("TRAINYARD_ROLE_ARN")
    if role:
        return role
    boto_session = getattr(sagemaker_session, "boto_session", None)
    if boto_session is None:
        return LOCAL_ROLE
    arn = boto_session.client("sts").get_caller_identity()["Arn"]
    if ":assumed-role/" in arn:  # arn:aws:sts::ACCOUNT:assumed-role/NAME/SESSION -> the role's ARN
        account = arn.split(":")[4]
        return f"arn:aws:iam::{account}:role/{arn.split('/')[1]}"
    if ":role/" in arn:
        return arn
    raise ValueError(f"the caller {arn} is not a role; pass role='arn:aws:iam::...:role/NAME' to the Estimator "
                     "or set TRAINYARD_ROLE_ARN")


def default_output_path(session: Session | None, *, local: bool) -> str:
    """output_path when the Estimator has none: the session's default bucket (and prefix); for local jobs
    without a session of the embedded store, the embedded store's default bucket."""
    if local:
        return session.output_path() if session is not None and session.embedded else f"s3://{DEFAULT_BUCKET}"
    if session is not None and not session.embedded:
        return session.output_path()
    raise ConfigError("output_path", "required for EC2 instance types: an s3:// prefix (or pass "
                                     "sagemaker_session=trainyard.Session(boto_session=...) for its default bucket)")


__all__ = ["JobsClient", "LocalSession", "Session", "aws_configured", "export_store_env", "default_output_path", "get_execution_role"]
