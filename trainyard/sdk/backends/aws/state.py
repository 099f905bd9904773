"""What an EC2-style job (the EC2 backend, or Terraform's rendering of one) keeps on S3, and what it needs of
its inputs."""
from __future__ import annotations

from trainyard.errors import ConfigError
from trainyard.job.spec import JobSpec
from trainyard.job.uris import join


def state_uri(spec: JobSpec) -> str:
    """Where the job's spec and the nodes' status objects live."""
    return join(spec.output_path, spec.job_name, "trainyard")


def check_inputs(spec: JobSpec) -> None:
    """Channels on S3 (or FSx), not on this machine, and artifacts to an s3:// prefix: what EC2 instances reach."""
    for ch in spec.channels:
        if ch.uri.startswith("file://"):
            raise ConfigError(f"inputs.{ch.name}", f"{ch.uri} is on this machine, which EC2 instances cannot read; "
                                                   "upload it to s3:// (or use an FSx file system) and pass that URI")
    if not spec.output_path.startswith("s3://"):
        raise ConfigError("output_path", f"{spec.output_path!r}: EC2 jobs write their artifacts to an s3:// prefix")
