"""(2) Every constructor argument of SageMaker's EstimatorBase / Framework / PyTorch / HuggingFace and every
argument of `fit` is accepted: pure construction, no job (except that a wrong `local_gpu` check may start one).

The values are what SageMaker's docs show for each argument; `instance_type="local"` throughout.
"""
import inspect
import logging
import os

import pytest
import torch

from .helpers import LOCAL_ROLE, copy_scripts

KMS = "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"
BUCKET = "sagemaker-us-east-1-111122223333"


@pytest.fixture
def src(tmp_path):
    """A source_dir with an entry point, and a `dependencies` library folder."""
    copy_scripts(tmp_path / "code", "train_handle.py")
    os.rename(tmp_path / "code" / "train_handle.py", tmp_path / "code" / "train.py")
    (tmp_path / "libs" / "common").mkdir(parents=True)
    (tmp_path / "libs" / "common" / "__init__.py").write_text("")
    return tmp_path


def _local_session():
    from trainyard.local import LocalSession

    sagemaker_session = LocalSession()
    sagemaker_session.config = {"local": {"local_code": True}}
    return sagemaker_session


def test_pytorch_accepts_every_estimator_argument(src):
    from trainyard.pytorch import PyTorch

    sagemaker_session = _local_session()
    metric_definitions = [{"Name": "train:loss", "Regex": "loss: ([0-9\\.]+)"}]
    estimator = PyTorch(
        entry_point="train.py",
        source_dir=str(src / "code"),
        role=LOCAL_ROLE,
        framework_version="2.0.0",
        py_version="py310",
        instance_count=1,
        instance_type="local",
        hyperparameters={"epochs": 1},
        # EstimatorBase
        keep_alive_period_in_seconds=1800,
        volume_size=30,
        volume_kms_key=KMS,
        max_run=3600,
        input_mode="File",
        output_path=f"s3://{BUCKET}/output",
        output_kms_key=KMS,
        base_job_name="pytorch-args",
        sagemaker_session=sagemaker_session,
        tags=[{"Key": "team", "Value": "ml"}],
        subnets=["subnet-0a1b2c3d"],
        security_group_ids=["sg-0a1b2c3d"],
        model_uri=f"s3://{BUCKET}/pretrained/model.tar.gz",
        model_channel_name="model",
        metric_definitions=metric_definitions,
        encrypt_inter_container_traffic=True,
        use_spot_instances=False,
        max_wait=None,
        checkpoint_s3_uri=f"s3://{BUCKET}/checkpoints",
        checkpoint_local_path="/opt/ml/checkpoints",
        enable_network_isolation=False,
        enable_sagemaker_metrics=True,
        disable_profiler=True,
        environment={"MY_FLAG": "1"},
        max_retry_attempts=1,
        git_config=None,
        container_log_level=logging.INFO,
        code_location=f"s3://{BUCKET}/code",
        dependencies=[str(src / "libs" / "common")],
        instance_groups=None,
        # Framework / PyTorch
        image_uri=None,
        distribution={"torch_distributed": {"enabled": True}},
    )
    # SageMaker's public attributes hold what was given; no job yet
    assert estimator.latest_training_job is None
    assert estimator.role == LOCAL_ROLE
    assert estimator.instance_count == 1 and estimator.instance_type == "local"
    assert estimator.framework_version == "2.0.0" and estimator.py_version == "py310"
    assert estimator.entry_point == "train.py"
    assert estimator.source_dir == str(src / "code")
    assert estimator.base_job_name == "pytorch-args"
    assert estimator.max_run == 3600 and estimator.volume_size == 30
    assert list(estimator.metric_definitions) == metric_definitions
    assert dict(estimator.environment) == {"MY_FLAG": "1"}
    assert estimator.distribution == {"torch_distributed": {"enabled": True}}
    assert estimator.sagemaker_session is sagemaker_session


def test_fit_takes_sagemakers_arguments():
    from trainyard.estimator import Estimator
    from trainyard.huggingface import HuggingFace
    from trainyard.pytorch import PyTorch

    for cls in (PyTorch, HuggingFace, Estimator):
        params = inspect.signature(cls.fit).parameters
        missing = {"inputs", "wait", "logs", "job_name", "experiment_config"} - set(params)
        assert not missing, f"{cls.__name__}.fit lacks {sorted(missing)}"
        assert params["wait"].default is True
        assert params["logs"].default in ("All", True)
        assert params["inputs"].default is None


def test_debugger_configuration_is_accepted(src):
    """sagemaker.debugger objects as the Debugger/Profiler docs build them."""
    from trainyard.debugger import DebuggerHookConfig, ProfilerConfig, Rule, TensorBoardOutputConfig, rule_configs
    from trainyard.pytorch import PyTorch

    common = dict(entry_point="train.py", source_dir=str(src / "code"), role=LOCAL_ROLE, framework_version="2.0.0",
                  py_version="py310", instance_count=1, instance_type="local")
    estimator = PyTorch(
        **common,
        debugger_hook_config=DebuggerHookConfig(s3_output_path=f"s3://{BUCKET}/debug",
                                                hook_parameters={"save_interval": "100"}),
        rules=[Rule.sagemaker(rule_configs.loss_not_decreasing()), Rule.sagemaker(rule_configs.vanishing_gradient())],
        profiler_config=ProfilerConfig(system_monitor_interval_millis=500),
        tensorboard_output_config=TensorBoardOutputConfig(s3_output_path=f"s3://{BUCKET}/tensorboard",
                                                          container_local_output_path="/opt/ml/output/tensorboard"),
        disable_profiler=False,
    )
    assert estimator.latest_training_job is None
    # the usual way to turn the debugger hook off
    assert PyTorch(**common, debugger_hook_config=False, disable_profiler=True).latest_training_job is None


def test_huggingface_and_generic_estimator_accept_their_arguments(src):
    from trainyard.estimator import Estimator
    from trainyard.huggingface import HuggingFace

    huggingface_estimator = HuggingFace(
        entry_point="train.py",
        source_dir=str(src / "code"),
        instance_type="local",
        instance_count=1,
        transformers_version="4.26",
        pytorch_version="1.13",
        tensorflow_version=None,
        py_version="py39",
        role=LOCAL_ROLE,
        hyperparameters={"epochs": 1, "train_batch_size": 32, "model_name": "distilbert-base-uncased"},
        image_uri=None,
        distribution=None,
        compiler_config=None,
        metric_definitions=[{"Name": "loss", "Regex": "'loss': ([0-9]+(.|e\\-)[0-9]+),?"}],
    )
    assert huggingface_estimator.latest_training_job is None
    # the generic Estimator in script mode, with the image a SageMaker user must name
    estimator = Estimator(
        image_uri="763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.0.0-cpu-py310",
        role=LOCAL_ROLE,
        instance_count=1,
        instance_type="local",
        entry_point="train.py",
        source_dir=str(src / "code"),
        hyperparameters={"epochs": 1},
        volume_size=30,
        max_run=3600,
        input_mode="File",
        base_job_name="generic-args",
        environment={"MY_FLAG": "1"},
    )
    assert estimator.latest_training_job is None
    assert estimator.hyperparameters()["epochs"] in (1, "1")


def test_training_input_config_is_sagemakers():
    """`TrainingInput(...).config` is SageMaker's CreateTrainingJob channel, with SageMaker's defaults
    (sagemaker/inputs.py: FullyReplicated unless a distribution or target attribute is given)."""
    from trainyard.inputs import ShuffleConfig, TrainingInput

    assert TrainingInput("s3://bucket/train").config == {
        "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": "s3://bucket/train",
                                        "S3DataDistributionType": "FullyReplicated"}}}
    full = TrainingInput("s3://bucket/train", distribution="ShardedByS3Key", compression="Gzip",
                         content_type="text/csv", record_wrapping="RecordIO", s3_data_type="S3Prefix",
                         input_mode="FastFile", attribute_names=["source-ref", "label"],
                         target_attribute_name="label", shuffle_config=ShuffleConfig(42))
    assert full.config == {
        "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": "s3://bucket/train",
                                        "S3DataDistributionType": "ShardedByS3Key",
                                        "AttributeNames": ["source-ref", "label"]}},
        "CompressionType": "Gzip", "ContentType": "text/csv", "RecordWrapperType": "RecordIO",
        "InputMode": "FastFile", "TargetAttributeName": "label", "ShuffleConfig": {"Seed": 42},
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: local_gpu is legitimate here")
def test_local_gpu_without_a_gpu_names_instance_type(src):
    from trainyard.pytorch import PyTorch

    with pytest.raises(Exception) as excinfo:
        estimator = PyTorch(entry_point="train.py", source_dir=str(src / "code"), role=LOCAL_ROLE,
                            framework_version="2.0.0", py_version="py310", instance_count=1,
                            instance_type="local_gpu", max_run=60)
        estimator.fit(wait=True, logs="None")  # only reached if construction did not refuse it
    msg = str(excinfo.value)
    assert "instance_type" in msg and "local_gpu" in msg, msg
