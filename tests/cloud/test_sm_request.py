"""The SageMaker backend's CreateTrainingJob request (sdk/backends/sagemaker/request.py), built from a representative JobSpec
and validated by botocore's own parameter validation against the SageMaker service model boto3 ships; and the
checks that refuse, field named, what SageMaker would refuse. Nothing is called: no service is needed."""
import json

import pytest
from botocore.exceptions import ParamValidationError

from trainyard.parallel.parallelism import Parallelism
from trainyard.errors import ConfigError
from trainyard.job.observability import TensorBoardOutput
from trainyard.job.spec import build_spec
from trainyard.sdk.backends.sagemaker import request as sm_request

ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainyard:abc123"


def _spec(**kw):
    fields = dict(
        job_name="sm-job-1", entry_point="train.py", entry_kind="script", instance_type="ml.p4d.24xlarge",
        instance_count=2, processes_per_host=8, role=ROLE, image_uri=IMAGE, output_path="s3://bkt/out",
        code_uri="s3://bkt/code/abc/sourcedir.tar.gz", checkpoint_s3_uri="s3://bkt/ckpt", max_run=7200,
        use_spot_instances=True, max_wait=10800, max_retry_attempts=2, volume_size=200,
        subnets=("subnet-0123456789abcdef0",), security_group_ids=("sg-0123456789abcdef0",),
        hyperparameters={"lr": 0.001, "layers": [64, 32], "name": "x", "flag": False},
        environment={"NCCL_DEBUG": "WARN"}, tags={"team": "ml"},
        distribution={"mics": {"partition_group_size": 8}},
        metric_definitions=[{"Name": "loss", "Regex": r"loss (\S+)"}],
        channels=[{"name": "train", "uri": "s3://bkt/train/", "distribution": "ShardedByS3Key", "input_mode": "FastFile"},
                  {"name": "eval", "uri": "s3://bkt/eval", "content_type": "application/json", "compression": "Gzip"},
                  {"name": "ref", "uri": "fsx://fs-0123456789abcdef0/mnt1/ref"}],
        tensorboard_output_config=TensorBoardOutput(s3_output_path="s3://bkt/tb"),
    )
    fields.update(kw)
    return build_spec(**fields)


def test_the_request_of_a_representative_job_has_sagemakers_shape():
    spec = _spec(backend="sagemaker", keep_alive_period_in_seconds=1800)
    sm_request.check(spec)
    req = sm_request.create_training_job_request(spec, spec_uri="s3://bkt/out/sm-job-1/trainyard/spec.json",
                                                 region="us-east-1")
    sm_request.validate(req)  # botocore's own validation: shapes, types, lengths, enums
    assert req["TrainingJobName"] == "sm-job-1" and req["RoleArn"] == ROLE
    assert req["AlgorithmSpecification"] == {"TrainingImage": IMAGE, "TrainingInputMode": "File",
                                             "MetricDefinitions": [{"Name": "loss", "Regex": r"loss (\S+)"}]}
    # every value JSON-encoded, as SageMaker's Python SDK passes them, with SageMaker's own keys
    assert req["HyperParameters"] == {
        "lr": "0.001", "layers": "[64, 32]", "name": '"x"', "flag": "false", "sagemaker_program": '"train.py"',
        "sagemaker_region": '"us-east-1"', "sagemaker_container_log_level": "20",
        "sagemaker_submit_directory": '"s3://bkt/code/abc/sourcedir.tar.gz"'}
    train, evaluation, ref = req["InputDataConfig"]
    assert train == {"ChannelName": "train", "InputMode": "FastFile", "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": "s3://bkt/train/", "S3DataDistributionType": "ShardedByS3Key"}}}
    assert evaluation["ContentType"] == "application/json" and evaluation["CompressionType"] == "Gzip"
    assert ref["DataSource"] == {"FileSystemDataSource": {"FileSystemId": "fs-0123456789abcdef0",
                                                          "FileSystemAccessMode": "ro", "FileSystemType": "FSxLustre",
                                                          "DirectoryPath": "/mnt1/ref"}}
    assert req["OutputDataConfig"] == {"S3OutputPath": "s3://bkt/out"}
    assert req["ResourceConfig"] == {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 2, "VolumeSizeInGB": 200,
                                     "KeepAlivePeriodInSeconds": 1800}
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 7200, "MaxWaitTimeInSeconds": 10800}
    assert req["CheckpointConfig"] == {"S3Uri": "s3://bkt/ckpt", "LocalPath": "/opt/ml/checkpoints"}
    assert req["EnableManagedSpotTraining"] is True and req["RetryStrategy"] == {"MaximumRetryAttempts": 2}
    assert req["VpcConfig"] == {"Subnets": ["subnet-0123456789abcdef0"], "SecurityGroupIds": ["sg-0123456789abcdef0"]}
    assert req["Tags"] == [{"Key": "team", "Value": "ml"}]
    env = req["Environment"]
    assert env["NCCL_DEBUG"] == "WARN" and env["TRAINYARD_SPEC_URI"] == "s3://bkt/out/sm-job-1/trainyard/spec.json"
    assert Parallelism.parse(json.loads(env["TRAINYARD_DISTRIBUTION"])) == spec.parallelism
    assert req["TensorBoardOutputConfig"] == {"S3OutputPath": "s3://bkt/tb", "LocalPath": "/opt/ml/output/tensorboard"}


def test_a_minimal_job_and_ec2_names():
    spec = _spec(instance_type="p5.48xlarge", channels=(), subnets=(), security_group_ids=(), use_spot_instances=False,
                 max_wait=None, max_retry_attempts=0, tags={}, tensorboard_output_config=None, checkpoint_s3_uri=None)
    req = sm_request.create_training_job_request(spec, spec_uri="s3://bkt/s.json", region="eu-west-1")
    sm_request.validate(req)
    assert req["ResourceConfig"]["InstanceType"] == "ml.p5.48xlarge" and req["EnableManagedSpotTraining"] is False
    assert not {"InputDataConfig", "CheckpointConfig", "RetryStrategy", "VpcConfig", "Tags"} & set(req)
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 7200}


def test_botocore_validation_catches_what_sagemaker_would_reject():
    req = sm_request.create_training_job_request(_spec(), spec_uri="s3://bkt/s.json", region="us-east-1")
    req["ResourceConfig"]["InstanceCount"] = "2"
    with pytest.raises(ParamValidationError, match="InstanceCount"):
        sm_request.validate(req)


@pytest.mark.parametrize("field,change,says", [
    ("role", {"role": "SageMakerRole"}, "IAM role ARN"),
    ("role", {"role": "arn:aws:iam::123456789012:instance-profile/x"}, "IAM role ARN"),
    ("image_uri", {"image_uri": None, "use_spot_instances": False, "max_wait": None}, "ECR URI"),
    ("max_run", {"max_run": 29 * 24 * 3600, "max_wait": 30 * 24 * 3600}, "28 days"),
    ("subnets", {"subnets": (), "security_group_ids": ()}, "FSx for Lustre"),
    ("inputs", {"channels": [{"name": "train", "uri": "file:///data/train"}]}, "s3:// or fsx://"),
    ("hyperparameters", {"hyperparameters": {"big": "x" * 3000}}, "2500 characters"),
    ("environment", {"environment": {"LONG": "y" * 600}}, "512 characters"),
])
def test_check_names_the_field(field, change, says):
    with pytest.raises(ConfigError) as e:
        sm_request.check(_spec(**change))
    assert e.value.field == field and says in str(e.value), str(e.value)
