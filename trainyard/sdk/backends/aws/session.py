"""The boto3 session of a command or a job, and what is missing from it, said before the first AWS call: the
EC2 and SageMaker backends and the CLI share these."""
from __future__ import annotations

import os

from trainyard.errors import ConfigError

NO_REGION = "no AWS region: set AWS_REGION (or AWS_DEFAULT_REGION) or"
NO_CREDENTIALS = ("no AWS credentials: set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or run "
                  "aws configure")


def new_session(region: str | None = None):
    """A boto3.Session in `region`, else AWS_REGION, else boto3's own lookup (AWS_DEFAULT_REGION, the
    profile's region). A profile named by AWS_PROFILE that does not exist is a ConfigError."""
    import boto3
    from botocore.exceptions import ProfileNotFound

    try:
        return boto3.Session(region_name=region or os.environ.get("AWS_REGION") or None)
    except ProfileNotFound as e:
        raise ConfigError("credentials", f"{e} (AWS_PROFILE={os.environ.get('AWS_PROFILE', '')}): set AWS_PROFILE "
                          "to a profile of ~/.aws/config, or unset it") from None


def check_session(session, *, how: str = "pass --region", need_region: bool = True) -> None:
    """A missing region or missing credentials, found before the first call, as a ConfigError that says what
    to set (`how`: the caller's own way to give a region)."""
    from botocore.exceptions import PartialCredentialsError

    if need_region and not session.region_name:
        raise ConfigError("region", f"{NO_REGION} {how}")
    try:
        credentials = session.get_credentials()
    except PartialCredentialsError as e:
        raise ConfigError("credentials", f"{NO_CREDENTIALS} ({e})") from None
    if credentials is None:
        raise ConfigError("credentials", NO_CREDENTIALS)


def aws_config_error(e: Exception, how: str = "pass --region") -> ConfigError | None:
    """botocore's NoRegionError, NoCredentialsError and PartialCredentialsError, raised past `check_session`
    (credentials that went away mid-command), as the same ConfigError; None for any other error."""
    from botocore.exceptions import NoCredentialsError, NoRegionError, PartialCredentialsError

    if isinstance(e, NoRegionError):
        return ConfigError("region", f"{NO_REGION} {how}")
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return ConfigError("credentials", NO_CREDENTIALS)
    return None
