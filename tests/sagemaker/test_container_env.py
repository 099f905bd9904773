"""What a script sees inside a job, per SageMaker's training toolkit (aws/sagemaker-training-toolkit
src/sagemaker_training/environment.py `Environment.to_env_vars`, mapping.py `to_cmd_args` / `to_env_vars`)
and SageMaker's PyTorch container (aws/sagemaker-pytorch-training-toolkit training.py: DNS lookup of every
host, MASTER_ADDR=hosts[0], MASTER_PORT): (6) algo-N names, (9) TrainingInput arguments, (10) hyperparameters
parsed by argparse, (11) the SM_* variables.

ONE job (2 hosts, 3 channels) is shared by the tests of this module; scripts/train_env.py prints a line
`SMENV {json}` on every host.
"""
import contextlib
import io
import json
import logging
import os
import shutil

import pytest
import torch

from .helpers import MAX_RUN, LOCAL_ROLE, SCRIPTS, decode_hp, marker_json, read_tar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HOSTS = ["algo-1", "algo-2"]
HYPERPARAMETERS = {
    "epochs": 10,
    "use-cuda": False,
    "layers": [64, 32],
    "k": 3,
    "learning_rate": 5e-5,
    "model_name": "distilbert-base-uncased",
    "opts": {"a": 1, "b": "x"},
    "flag": True,
}
# sagemaker_training.mapping.to_cmd_args(HYPERPARAMETERS): sorted names, "-k" for one letter, str(value),
# a dict as "k=v,k=v"
EXPECTED_ARGV = ["--epochs", "10", "--flag", "True", "-k", "3", "--layers", "[64, 32]", "--learning_rate", "5e-05",
                 "--model_name", "distilbert-base-uncased", "--opts", "a=1,b=x", "--use-cuda", "False"]
TRAIN_FILES = [f"part-{i}.csv" for i in range(4)]


@pytest.fixture(scope="module")
def env_job(tmp_path_factory):
    import trainyard
    from trainyard.inputs import TrainingInput
    from trainyard.pytorch import PyTorch

    root = tmp_path_factory.mktemp("env-job")
    for channel, names in (("train", TRAIN_FILES), ("test", ["test.csv"]), ("extra", ["extra.txt"])):
        (root / "data" / channel).mkdir(parents=True)
        for name in names:
            (root / "data" / channel / name).write_text(f"{channel}/{name}\n")
    src = root / "code"
    src.mkdir()
    shutil.copy(f"{SCRIPTS}/train_env.py", src / "train_env.py")

    sagemaker_session = trainyard.Session()
    bucket = sagemaker_session.default_bucket()
    uris = {c: sagemaker_session.upload_data(path=str(root / "data" / c), bucket=bucket, key_prefix=f"env-job/{c}")
            for c in ("train", "test", "extra")}

    estimator = PyTorch(entry_point="train_env.py", source_dir=str(src), role=LOCAL_ROLE,
                        framework_version="2.0.0", py_version="py310", instance_count=2, instance_type="local",
                        hyperparameters=HYPERPARAMETERS, container_log_level=logging.WARNING, max_run=MAX_RUN)
    inputs = {
        "train": TrainingInput(uris["train"], distribution="ShardedByS3Key", content_type="text/csv",
                               s3_data_type="S3Prefix", input_mode="File"),
        "test": TrainingInput(uris["test"]),
        "extra": TrainingInput(uris["extra"], distribution=None, compression=None, content_type=None,
                               record_wrapping=None, s3_data_type="S3Prefix", input_mode="FastFile",
                               attribute_names=None, target_attribute_name=None, shuffle_config=None),
    }
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        estimator.fit(inputs)
    out = buf.getvalue()
    reports = {r["host"]: r for r in marker_json(out, "SMENV")}
    assert sorted(reports) == HOSTS, out[-4000:]
    return {"estimator": estimator, "reports": reports, "out": out,
            "describe": estimator.latest_training_job.describe()}


def _env(env_job, host):
    return env_job["reports"][host]["env"]


# (6) ------------------------------------------------------------------------------------------------------
def test_algo_host_names_resolve_inside_the_job(env_job):
    for host, r in env_job["reports"].items():
        assert r["resolve_errors"] == {}, (host, r["resolve_errors"])
        assert sorted(r["resolved"]) == HOSTS
        assert r["bind_error"] is None, (host, r["bind_error"])
        env = r["env"]
        assert env.get("MASTER_ADDR") == "algo-1", (host, env.get("MASTER_ADDR"))
        assert env.get("MASTER_PORT", "").isdigit(), (host, env.get("MASTER_PORT"))


# (9) ------------------------------------------------------------------------------------------------------
def test_training_input_arguments_reach_the_job(env_job):
    reports = env_job["reports"]
    shards = [set(reports[h]["channels"]["train"]) for h in HOSTS]
    assert shards[0] and shards[1] and not shards[0] & shards[1], shards  # ShardedByS3Key: disjoint shares
    assert shards[0] | shards[1] == set(TRAIN_FILES)
    for host in HOSTS:
        assert reports[host]["channels"]["test"] == ["test.csv"]  # FullyReplicated (the default)
        assert reports[host]["channels"]["extra"] == ["extra.txt"]  # FastFile: same files, same path
        config = json.loads(_env(env_job, host)["SM_INPUT_DATA_CONFIG"])
        assert sorted(config) == ["extra", "test", "train"]
        assert config["train"]["ContentType"] == "text/csv"
        assert config["train"]["S3DistributionType"] == "ShardedByS3Key"
        assert config["train"]["TrainingInputMode"] == "File"
        assert config["test"]["S3DistributionType"] == "FullyReplicated"
        assert config["test"]["TrainingInputMode"] == "File"
        assert config["extra"]["TrainingInputMode"] == "FastFile"
        assert all(c.get("RecordWrapperType", "None") == "None" for c in config.values())
    described = {c["ChannelName"]: c for c in env_job["describe"]["InputDataConfig"]}
    s3 = described["train"]["DataSource"]["S3DataSource"]
    assert s3["S3DataType"] == "S3Prefix" and s3["S3DataDistributionType"] == "ShardedByS3Key"
    assert described["train"]["ContentType"] == "text/csv"
    assert described["test"]["DataSource"]["S3DataSource"]["S3DataDistributionType"] == "FullyReplicated"
    assert described["extra"]["InputMode"] == "FastFile"


# (10) -----------------------------------------------------------------------------------------------------
def test_hyperparameters_parse_as_in_sagemaker(env_job):
    for host in HOSTS:
        r = env_job["reports"][host]
        assert r["argv"] == EXPECTED_ARGV, (host, r["argv"])
        args = r["args"]
        assert args["epochs"] == 10  # type=int
        assert args["k"] == 3  # "-k", type=int
        assert args["layers"] == [64, 32]  # type=ast.literal_eval
        assert args["use_cuda"] is False and args["flag"] is True  # type=lambda s: s == "True"
        assert args["learning_rate"] == "5e-05"  # type=str, as the HF notebooks then float() it
        assert args["model_name"] == "distilbert-base-uncased"
        assert args["opts"] == "a=1,b=x"
        env = r["env"]
        # SM_HP_<NAME>: strings as they are, everything else JSON (mapping.to_env_vars)
        assert env["SM_HP_MODEL_NAME"] == "distilbert-base-uncased"
        for name, value in HYPERPARAMETERS.items():
            if name == "model_name":
                continue
            raw = env.get(f"SM_HP_{name.upper()}")
            assert raw is not None and json.loads(raw) == value, (f"SM_HP_{name.upper()}", raw)
        assert env["SM_HP_USE-CUDA"] == "false" and env["SM_HP_FLAG"] == "true"
        assert json.loads(env["SM_HPS"]) == HYPERPARAMETERS
        assert json.loads(env["SM_USER_ARGS"]) == EXPECTED_ARGV
    est = env_job["estimator"]
    for name, value in HYPERPARAMETERS.items():
        assert decode_hp(est.hyperparameters()[name]) == value, name


# (11) -----------------------------------------------------------------------------------------------------
TOOLKIT_VARS = [
    "SM_HOSTS", "SM_NETWORK_INTERFACE_NAME", "SM_HPS", "SM_USER_ENTRY_POINT", "SM_FRAMEWORK_PARAMS",
    "SM_RESOURCE_CONFIG", "SM_INPUT_DATA_CONFIG", "SM_OUTPUT_DATA_DIR", "SM_CHANNELS", "SM_CURRENT_HOST",
    "SM_CURRENT_INSTANCE_TYPE", "SM_CURRENT_INSTANCE_GROUP", "SM_CURRENT_INSTANCE_GROUP_HOSTS",
    "SM_INSTANCE_GROUPS", "SM_INSTANCE_GROUPS_DICT", "SM_DISTRIBUTION_INSTANCE_GROUPS", "SM_IS_HETERO",
    "SM_MODULE_NAME", "SM_LOG_LEVEL", "SM_FRAMEWORK_MODULE", "SM_INPUT_DIR", "SM_INPUT_CONFIG_DIR",
    "SM_OUTPUT_DIR", "SM_NUM_CPUS", "SM_NUM_GPUS", "SM_MODEL_DIR", "SM_MODULE_DIR", "SM_TRAINING_ENV",
    "SM_USER_ARGS", "SM_OUTPUT_INTERMEDIATE_DIR", "SM_CHANNEL_TRAIN", "SM_CHANNEL_TEST", "SM_CHANNEL_EXTRA",
]
# sagemaker_training/params.py
SAGEMAKER_HYPERPARAMETERS = ("sagemaker_program", "sagemaker_submit_directory", "sagemaker_enable_cloudwatch_metrics",
                             "sagemaker_region", "sagemaker_container_log_level", "sagemaker_job_name",
                             "default_user_module_name", "_tuning_objective_metric", "sagemaker_s3_output")
TRAINING_ENV_KEYS = [
    "additional_framework_parameters", "channel_input_dirs", "current_host", "current_instance_group",
    "current_instance_type", "framework_module", "hosts", "hyperparameters", "input_config_dir",
    "input_data_config", "input_dir", "instance_groups", "is_hetero", "is_master", "job_name", "log_level",
    "master_hostname", "model_dir", "module_dir", "module_name", "network_interface_name", "num_cpus",
    "num_gpus", "output_data_dir", "output_dir", "output_intermediate_dir", "resource_config",
    "user_entry_point",
]


def test_sm_variables_of_the_training_toolkit(env_job):
    for host in HOSTS:
        env = _env(env_job, host)
        missing = [v for v in TOOLKIT_VARS if v not in env]
        assert not missing, (host, missing)
        assert json.loads(env["SM_HOSTS"]) == HOSTS
        assert env["SM_CURRENT_HOST"] == host
        assert json.loads(env["SM_CHANNELS"]) == ["extra", "test", "train"]
        for c in ("train", "test", "extra"):
            assert env[f"SM_CHANNEL_{c.upper()}"].endswith(f"/input/data/{c}")
        assert env_job["reports"][host]["model_dir_is_dir"]
        assert env["SM_USER_ENTRY_POINT"] == "train_env.py" and env["SM_MODULE_NAME"] == "train_env"
        assert env["SM_MODULE_DIR"], "SM_MODULE_DIR is empty"
        assert env["SM_LOG_LEVEL"] == str(logging.WARNING)  # container_log_level
        assert int(env["SM_NUM_CPUS"]) >= 1
        if not torch.cuda.is_available():
            assert env["SM_NUM_GPUS"] == "0"
        assert env["SM_NETWORK_INTERFACE_NAME"]
        # additional_framework_parameters: the sagemaker_* hyperparameters that are NOT the toolkit's own
        # (sagemaker_training.params.SAGEMAKER_HYPERPARAMETERS are split off)
        framework_params = json.loads(env["SM_FRAMEWORK_PARAMS"])
        assert isinstance(framework_params, dict)
        own = set(framework_params) & set(SAGEMAKER_HYPERPARAMETERS)
        assert not own, f"SM_FRAMEWORK_PARAMS holds the toolkit's own {sorted(own)}"
        # one homogeneous instance group, as SageMaker describes a single-group job
        assert env["SM_CURRENT_INSTANCE_GROUP"] == "homogeneousCluster"
        assert json.loads(env["SM_INSTANCE_GROUPS"]) == ["homogeneousCluster"]
        assert json.loads(env["SM_CURRENT_INSTANCE_GROUP_HOSTS"]) == HOSTS
        groups = json.loads(env["SM_INSTANCE_GROUPS_DICT"])
        assert groups["homogeneousCluster"]["hosts"] == HOSTS
        assert groups["homogeneousCluster"]["instance_group_name"] == "homogeneousCluster"
        assert json.loads(env["SM_DISTRIBUTION_INSTANCE_GROUPS"]) == []  # no distribution asked for
        assert env["SM_IS_HETERO"] == "false"
        resource = json.loads(env["SM_RESOURCE_CONFIG"])
        assert resource["current_host"] == host and resource["hosts"] == HOSTS
        training_env = json.loads(env["SM_TRAINING_ENV"])
        missing = [k for k in TRAINING_ENV_KEYS if k not in training_env]
        assert not missing, (host, missing)
        assert training_env["hyperparameters"] == HYPERPARAMETERS  # no sagemaker_* entries among them
        assert training_env["current_host"] == host and training_env["hosts"] == HOSTS
        assert training_env["is_master"] is (host == "algo-1")
        assert training_env["master_hostname"] == "algo-1"
        assert training_env["job_name"] == env_job["estimator"].latest_training_job.name
        assert training_env["log_level"] == logging.WARNING
        assert training_env["channel_input_dirs"]["train"] == env["SM_CHANNEL_TRAIN"]
    # algo-1's report is also in model.tar.gz, and each host could write to SM_OUTPUT_DATA_DIR
    model = read_tar(env_job["estimator"].model_data)
    assert json.loads(model["env.json"])["host"] == "algo-1"
    assert os.path.basename(env_job["estimator"].model_data) == "model.tar.gz"
