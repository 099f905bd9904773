"""Training inputs: SageMaker's `TrainingInput`, and the normalisation of `fit(inputs=...)`."""
from __future__ import annotations

import os
from dataclasses import dataclass

from pydantic import ValidationError

from trainyard.errors import ConfigError, known_keywords
from trainyard.job.spec import Channel
from trainyard.job.uris import check_storage_uri

DEFAULT_CHANNEL = "training"  # SageMaker's channel name when `inputs` is a single URI
DISTRIBUTIONS = ("FullyReplicated", "ShardedByS3Key")


@known_keywords  # a mistyped argument names the closest one
@dataclass(frozen=True, slots=True)
class TrainingInput:
    """One channel's data, with SageMaker's arguments and defaults: `s3_data` is an `s3://` prefix or a
    `file://` path.

    `distribution="ShardedByS3Key"` gives each host a disjoint share of the objects (in key order,
    host i takes every N-th); `FullyReplicated` (the default, also for None) gives every host all of them.
    `input_mode` None means the Estimator's; `File` and `FastFile` both stage files (`Pipe` is refused).
    `content_type`, `record_wrapping`, `compression` and `attribute_names` reach the script in
    `inputdataconfig.json` (SageMaker uses compression in Pipe mode only); `S3Prefix` is staged, manifest
    types are refused. `target_attribute_name`, `shuffle_config`, `instance_groups` are accepted with no effect.
    """

    s3_data: str
    distribution: str | None = None
    compression: str | None = None
    content_type: str | None = None
    record_wrapping: str | None = None
    s3_data_type: str = "S3Prefix"
    instance_groups: list[str] | None = None
    input_mode: str | None = None
    attribute_names: list[str] | None = None
    target_attribute_name: str | None = None
    shuffle_config: object = None
    hub_access_config: dict | None = None
    model_access_config: dict | None = None

    @property
    def config(self) -> dict:
        """The channel as SageMaker's CreateTrainingJob takes it (`sagemaker.inputs.TrainingInput.config`)."""
        s3 = {"S3DataType": self.s3_data_type, "S3Uri": self.s3_data}
        if self.distribution is not None or self.target_attribute_name is None:
            s3["S3DataDistributionType"] = self.distribution or "FullyReplicated"
        if self.attribute_names:
            s3["AttributeNames"] = list(self.attribute_names)
        if self.instance_groups:
            s3["InstanceGroupNames"] = list(self.instance_groups)
        out: dict = {"DataSource": {"S3DataSource": s3}}
        for key, value in (("CompressionType", self.compression), ("ContentType", self.content_type),
                           ("RecordWrapperType", self.record_wrapping), ("InputMode", self.input_mode),
                           ("TargetAttributeName", self.target_attribute_name)):
            if value is not None:
                out[key] = value
        if self.shuffle_config is not None:
            out["ShuffleConfig"] = {"Seed": self.shuffle_config.seed}
        return out


@known_keywords
@dataclass(frozen=True, slots=True)
class ShuffleConfig:
    """SageMaker's shuffle of a channel's objects for Pipe mode; accepted in `TrainingInput`, no effect in
    File mode (SageMaker's rule, and Trainyard stages files)."""

    seed: int


@known_keywords
@dataclass(frozen=True, slots=True)
class FileSystemInput:
    """A channel read from FSx for Lustre (EC2 jobs): the file system is mounted on every host and the
    channel's folder is `directory_path` in it. SageMaker's argument names."""

    file_system_id: str
    file_system_type: str = "FSxLustre"
    directory_path: str = "/"
    file_system_access_mode: str = "ro"
    content_type: str | None = None

    def uri(self, field: str) -> str:
        if self.file_system_type != "FSxLustre":
            raise ConfigError(field, f"file_system_type {self.file_system_type!r} is not supported; use 'FSxLustre'")
        if self.file_system_access_mode not in ("ro", "rw"):
            raise ConfigError(field, f"file_system_access_mode must be 'ro' or 'rw', got {self.file_system_access_mode!r}")
        return f"fsx://{self.file_system_id}/{self.directory_path.strip('/')}".rstrip("/")


def to_channels(inputs: object, default_input_mode: str = "File") -> list[Channel]:
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
            value = TrainingInput(value.uri(field), content_type=value.content_type)
        if isinstance(value, str):
            value = TrainingInput(value)
        if not isinstance(value, TrainingInput):
            raise ConfigError(field, f"expected a URI string or TrainingInput, got {type(value).__name__}")
        distribution = value.distribution or "FullyReplicated"
        if distribution not in DISTRIBUTIONS:
            raise ConfigError(field, f"distribution {distribution!r} is not one of {list(DISTRIBUTIONS)}")
        mode = value.input_mode or default_input_mode
        if mode not in ("File", "FastFile"):
            raise ConfigError(field, f"input_mode {mode!r} is not supported: Trainyard stages channels as files; "
                                     "use 'File' or 'FastFile'")
        if value.s3_data_type != "S3Prefix":
            raise ConfigError(field, f"s3_data_type {value.s3_data_type!r} is not supported; use 'S3Prefix' "
                                     "(a prefix whose objects are the channel's files)")
        if value.compression not in (None, "None", "Gzip"):
            raise ConfigError(field, f"compression {value.compression!r}: use None or 'Gzip'")
        uri = value.s3_data
        if isinstance(uri, str) and uri.startswith("file://") and not uri.startswith("file:///"):
            uri = "file://" + os.path.abspath(uri[len("file://"):])  # local mode's `file://./data`: from here
        uri = check_storage_uri(field, uri, ("s3", "file", "fsx"))
        if uri.startswith("file://") and not os.path.exists(uri[len("file://") :]):
            raise ConfigError(field, f"{uri} does not exist; check the path or upload the data first")
        try:
            channels.append(Channel(
                name=name, uri=uri, distribution=distribution, input_mode=mode, content_type=value.content_type,
                compression=value.compression, record_wrapping=value.record_wrapping,
                attribute_names=tuple(value.attribute_names) if value.attribute_names else None))
        except ValidationError as e:
            raise ConfigError(field, e.errors()[0]["msg"].removeprefix("Value error, ")) from None
    return channels
