"""A JobSpec as SageMaker's `CreateTrainingJob` request: the SageMaker backend's one translation.

The job SageMaker runs is the one the other backends run: the Trainyard image (`image_uri`, in ECR) as
`AlgorithmSpecification.TrainingImage`, the channels as `InputDataConfig` (S3 prefixes with their mode,
distribution and record options; `fsx://fs-id/path` as an FSx for Lustre `FileSystemDataSource`, which needs
the job's subnets and security groups as `VpcConfig`), the hyperparameters JSON-encoded as SageMaker's Python
SDK passes them, plus SageMaker's own `sagemaker_program`, `sagemaker_submit_directory` and
`sagemaker_container_log_level`, the engine's layout in `Environment` (`TRAINYARD_DISTRIBUTION`), and the
whole spec's location (`TRAINYARD_SPEC_URI`, the backend uploads it next to the code) for what SageMaker's
contract does not carry (processes per host, hang timeout, profiler).

`check(spec)` refuses, with the field named, what SageMaker would refuse or what the request cannot say,
before anything is uploaded; `create_training_job_request` is then validated against botocore's own model
of the API (`validate`).
"""
from __future__ import annotations

import re
from typing import Any

from trainyard.container import attempts
from trainyard.container.contract import DISTRIBUTION_ENV, SPEC_URI_ENV, hp_json
from trainyard.job import catalog
from trainyard.errors import ConfigError
from trainyard.job.spec import JobSpec
from trainyard.job.uris import split_fsx

# an IAM role ARN: SageMaker takes no role name and no instance profile
ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,512}$")
MAX_VOLUME_GB = 16384
MAX_RUNTIME_S = 28 * 24 * 3600  # CreateTrainingJob's MaxRuntimeInSeconds ceiling
MAX_HYPERPARAMETERS = 100
MAX_HP_VALUE = 2500
MAX_ENV_ENTRIES = 100
MAX_ENV_VALUE = 512
MAX_TAGS = 50


def ml_instance_type(instance_type: str) -> str:
    """SageMaker's name of an instance type: `ml.p4d.24xlarge` for `p4d.24xlarge` or `ml.p4d.24xlarge`."""
    return "ml." + catalog.lookup(instance_type).name


def check(spec: JobSpec) -> None:
    """What SageMaker would refuse, or what the request cannot carry, named by field (nothing is called)."""
    if catalog.lookup(spec.instance_type).is_local:
        raise ConfigError("instance_type", "SageMaker runs ml.* instance types; give one such as 'ml.p4d.24xlarge' "
                                           "(or run this job with the local backend)")
    if not spec.role or not ROLE_ARN.match(spec.role):
        raise ConfigError("role", f"SageMaker needs an IAM role ARN such as 'arn:aws:iam::123456789012:role/"
                                  f"SageMakerRole', got {spec.role!r}")
    if not spec.image_uri:
        raise ConfigError("image_uri", "SageMaker runs the Trainyard image: give its ECR URI (`trainyard image push` "
                                       "prints it)")
    if not 1 <= spec.volume_size <= MAX_VOLUME_GB:
        raise ConfigError("volume_size", f"SageMaker volumes are 1 to {MAX_VOLUME_GB} GB, got {spec.volume_size}")
    if spec.max_run > MAX_RUNTIME_S:
        raise ConfigError("max_run", f"SageMaker runs a training job at most {MAX_RUNTIME_S} s (28 days), got "
                                     f"{spec.max_run}; checkpoint and start a new job to go on")
    for ch in spec.channels:
        if ch.uri.startswith("file://"):
            raise ConfigError("inputs", f"channel {ch.name!r}: SageMaker reads s3:// or fsx:// channels, not "
                                        f"{ch.uri}; upload it first (Session().upload_data)")
        if ch.uri.startswith("fsx://") and not (spec.subnets and spec.security_group_ids):
            raise ConfigError("subnets", f"channel {ch.name!r} is on FSx for Lustre: SageMaker mounts it in the "
                                         "job's VPC; give subnets and security_group_ids that reach the file system")
    if len(spec.hyperparameters) + 3 > MAX_HYPERPARAMETERS:
        raise ConfigError("hyperparameters", f"SageMaker takes at most {MAX_HYPERPARAMETERS} hyperparameters "
                                             f"(3 are Trainyard's), got {len(spec.hyperparameters)}")
    for k, v in spec.hyperparameters.items():
        if len(hp_json(v)) > MAX_HP_VALUE:
            raise ConfigError("hyperparameters", f"{k!r}: SageMaker keeps at most {MAX_HP_VALUE} characters of a "
                                                 "value (JSON-encoded); pass large values as a file in a channel")
    if len(spec.environment) + 2 > MAX_ENV_ENTRIES:
        raise ConfigError("environment", f"SageMaker takes at most {MAX_ENV_ENTRIES} variables (2 are Trainyard's)")
    for k, v in {**spec.environment, DISTRIBUTION_ENV: spec.parallelism.to_env()}.items():
        if len(v) > MAX_ENV_VALUE:
            what = "distribution" if k == DISTRIBUTION_ENV else "environment"
            raise ConfigError(what, f"{k}: SageMaker keeps at most {MAX_ENV_VALUE} characters of a variable, "
                                    f"this one has {len(v)}")
    if len(spec.tags) > MAX_TAGS:
        raise ConfigError("tags", f"SageMaker takes at most {MAX_TAGS} tags, got {len(spec.tags)}")


def _channel(ch) -> dict[str, Any]:
    if ch.uri.startswith("fsx://"):
        fs_id, path = split_fsx(ch.uri)
        return {"ChannelName": ch.name, "InputMode": "File", "DataSource": {"FileSystemDataSource": {
            "FileSystemId": fs_id, "FileSystemAccessMode": "ro", "FileSystemType": "FSxLustre",
            "DirectoryPath": path}}}
    source: dict[str, Any] = {"S3DataType": ch.s3_data_type, "S3Uri": ch.uri, "S3DataDistributionType": ch.distribution}
    if ch.attribute_names:
        source["AttributeNames"] = list(ch.attribute_names)
    out: dict[str, Any] = {"ChannelName": ch.name, "InputMode": ch.input_mode, "DataSource": {"S3DataSource": source}}
    for key, value in (("ContentType", ch.content_type), ("CompressionType", ch.compression),
                       ("RecordWrapperType", ch.record_wrapping)):
        if value is not None:
            out[key] = value
    return out


def create_training_job_request(spec: JobSpec, *, spec_uri: str, region: str) -> dict[str, Any]:
    """CreateTrainingJob's parameters for `spec` (named, with its code uploaded: `spec.code_uri`)."""
    hps = {k: hp_json(v) for k, v in spec.hyperparameters.items()}
    hps.update(sagemaker_program=hp_json(spec.entry_point), sagemaker_region=hp_json(region),
               sagemaker_container_log_level=hp_json(spec.container_log_level))
    if spec.code_uri:
        hps["sagemaker_submit_directory"] = hp_json(spec.code_uri)
    algorithm: dict[str, Any] = {"TrainingImage": spec.image_uri, "TrainingInputMode": spec.input_mode}
    if spec.metric_definitions:
        algorithm["MetricDefinitions"] = [{"Name": d["Name"], "Regex": d["Regex"]} for d in spec.metric_definitions]
    if spec.enable_sagemaker_metrics is not None:
        algorithm["EnableSageMakerMetricsTimeSeries"] = bool(spec.enable_sagemaker_metrics)
    resources: dict[str, Any] = {"InstanceType": ml_instance_type(spec.instance_type),
                                 "InstanceCount": spec.instance_count, "VolumeSizeInGB": spec.volume_size}
    if spec.keep_alive_period_in_seconds:
        resources["KeepAlivePeriodInSeconds"] = spec.keep_alive_period_in_seconds
    stopping: dict[str, Any] = {"MaxRuntimeInSeconds": spec.max_run}
    if spec.use_spot_instances and spec.max_wait:
        stopping["MaxWaitTimeInSeconds"] = spec.max_wait
    req: dict[str, Any] = {
        "TrainingJobName": spec.job_name,
        "HyperParameters": hps,
        "AlgorithmSpecification": algorithm,
        "RoleArn": spec.role,
        "OutputDataConfig": {"S3OutputPath": spec.output_path},
        "ResourceConfig": resources,
        "StoppingCondition": stopping,
        "EnableManagedSpotTraining": bool(spec.use_spot_instances),
        "Environment": {**spec.environment, DISTRIBUTION_ENV: spec.parallelism.to_env(),
                        SPEC_URI_ENV: spec_uri},
    }
    if spec.channels:
        req["InputDataConfig"] = [_channel(ch) for ch in spec.channels]
    if spec.checkpoint_s3_uri:
        req["CheckpointConfig"] = {"S3Uri": spec.checkpoint_s3_uri, "LocalPath": spec.checkpoint_local_path}
    req.update(attempts.sagemaker_retry(spec.max_retry_attempts))
    if spec.subnets:
        req["VpcConfig"] = {"Subnets": list(spec.subnets), "SecurityGroupIds": list(spec.security_group_ids)}
    if spec.tags:
        req["Tags"] = [{"Key": k, "Value": v} for k, v in spec.tags.items()]
    tb = spec.tensorboard_output_config
    if tb is not None:
        req["TensorBoardOutputConfig"] = {"S3OutputPath": tb.s3_output_path, "LocalPath": tb.container_local_output_path}
    return req


def validate(request: dict[str, Any]) -> None:
    """botocore's own parameter validation of CreateTrainingJob (the shapes, types, lengths and patterns of the
    service model this boto3 ships); raises botocore's ParamValidationError."""
    import botocore.session
    from botocore.validate import validate_parameters

    model = botocore.session.get_session().get_service_model("sagemaker")
    validate_parameters(request, model.operation_model("CreateTrainingJob").input_shape)
