"""Training inputs: SageMaker's `TrainingInput`, and the normalisation of `fit(inputs=...)`."""
from __future__ import annotations

import os
from dataclasses import dataclass

from pydantic import ValidationError

from trainyard.sdk.errors import ConfigError
from trainyard.sdk.spec import Channel
from trainyard.sdk.uris import check_storage_uri

DEFAULT_CHANNEL = "training"  # SageMaker's channel name when `inputs` is a single URI
DISTRIBUTIONS = ("FullyReplicated", "ShardedByS3Key")


@dataclass(frozen=True, slots=True)
class TrainingInput:
    """One channel's data: `s3_data` is an `s3://` prefix or a `file://` path.

    `distribution="ShardedByS3Key"` gives each host a disjoint share of the objects (in key order,
    host i takes every N-th); `FullyReplicated` gives every host all of them.
    """

    s3_data: str
    distribution: str = "FullyReplicated"
    input_mode: str = "File"


@dataclass(frozen=True, slots=True)
class FileSystemInput:
    """A channel read from FSx for Lustre (EC2 jobs): the file system is mounted on every host and the
    channel's folder is `directory_path` in it. SageMaker's argument names."""

    file_system_id: str
    directory_path: str = "/"
    file_system_type: str = "FSxLustre"
    file_system_access_mode: str = "ro"

    def uri(self, field: str) -> str:
        if self.file_system_type != "FSxLustre":
            raise ConfigError(field, f"file_system_type {self.file_system_type!r} is not supported; use 'FSxLustre'")
        if self.file_system_access_mode not in ("ro", "rw"):
            raise ConfigError(field, f"file_system_access_mode must be 'ro' or 'rw', got {self.file_system_access_mode!r}")
        return f"fsx://{self.file_system_id}/{self.directory_path.strip('/')}".rstrip("/")


def to_channels(inputs: object) -> list[Channel]:
    """`fit(inputs=...)` -> channels; each error names `inputs` or `inputs.<channel>`."""
    if inputs is None:
        return []
    if isinstance(inputs, (str, TrainingInput, FileSystemInput)):
        inputs = {DEFAULT_CHANNEL: inputs}
    if not isinstance(inputs, dict):
        raise ConfigError("inputs", f"expected an s3:// or file:// URI, a TrainingInput, or a dict of channel name "
                                    f"to those; got {type(inputs).__name__}")
    channels = []
    for name, value in inputs.items():
        field = f"inputs.{name}"
        if not isinstance(name, str):
            raise ConfigError("inputs", f"channel names must be strings, got {name!r}")
        if isinstance(value, FileSystemInput):
            value = TrainingInput(value.uri(field))
        if isinstance(value, str):
            value = TrainingInput(value)
        if not isinstance(value, TrainingInput):
            raise ConfigError(field, f"expected a URI string or TrainingInput, got {type(value).__name__}")
        if value.distribution not in DISTRIBUTIONS:
            raise ConfigError(field, f"distribution {value.distribution!r} is not one of {list(DISTRIBUTIONS)}")
        if value.input_mode != "File":
            raise ConfigError(field, f"input_mode {value.input_mode!r} is not supported; use 'File'")
        uri = check_storage_uri(field, value.s3_data, ("s3", "file", "fsx"))
        if uri.startswith("file://") and not os.path.exists(uri[len("file://") :]):
            raise ConfigError(field, f"{uri} does not exist; check the path or upload the data first")
        try:
            channels.append(Channel(name=name, uri=uri, distribution=value.distribution))
        except ValidationError as e:
            raise ConfigError(field, e.errors()[0]["msg"].removeprefix("Value error, ")) from None
    return channels
