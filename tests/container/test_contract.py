"""The contract renderer: exact files and variables, as SageMaker's toolkit would produce them."""
import json

from trainyard.container.contract import hp_env, render_contract, user_args
from trainyard.parallel.parallelism import Parallelism
from trainyard.job.spec import build_spec


def _spec(**kw):
    fields = dict(
        job_name="job-1", entry_point="train.py", entry_kind="script", code_uri="s3://bkt/code/sourcedir.tar.gz",
        instance_type="ml.p4d.24xlarge", instance_count=3, processes_per_host=8, output_path="s3://bkt/out",
        hyperparameters={"epochs": 10, "lr": 0.5, "name": "abc", "flag": False, "layers": [1, 2]},
        channels=[{"name": "train", "uri": "s3://bkt/train"}, {"name": "test", "uri": "s3://bkt/test",
                                                              "distribution": "ShardedByS3Key"}],
        checkpoint_s3_uri="s3://bkt/ckpt",
    )
    fields.update(kw)
    return build_spec(**fields)


def test_config_files_are_exact():
    c = render_contract(_spec(), 1)
    files = {k: json.loads(v) for k, v in c.files.items()}
    assert files["input/config/hyperparameters.json"] == {
        "epochs": "10", "lr": "0.5", "name": '"abc"', "flag": "false", "layers": "[1, 2]"}
    assert files["input/config/resourceconfig.json"] == {
        "current_host": "algo-2",
        "current_instance_type": "ml.p4d.24xlarge",
        "current_group_name": "homogeneousCluster",
        "hosts": ["algo-1", "algo-2", "algo-3"],
        "instance_groups": [{"instance_group_name": "homogeneousCluster", "instance_type": "ml.p4d.24xlarge",
                             "hosts": ["algo-1", "algo-2", "algo-3"]}],
        "network_interface_name": "eth0",
    }
    assert files["input/config/inputdataconfig.json"] == {
        "test": {"TrainingInputMode": "File", "S3DistributionType": "ShardedByS3Key", "RecordWrapperType": "None"},
        "train": {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated", "RecordWrapperType": "None"},
    }
    assert files["input/config/checkpointconfig.json"] == {"LocalPath": "/opt/ml/checkpoints", "S3Uri": "s3://bkt/ckpt"}
    assert "input/data/train" in c.dirs and "input/data/test" in c.dirs and "output/data" in c.dirs


def test_no_checkpoint_config_without_uri():
    assert "input/config/checkpointconfig.json" not in render_contract(_spec(checkpoint_s3_uri=None), 0).files


def test_environment_variables():
    env = render_contract(_spec(), 2, master_addr="algo-1", master_port=7777).env
    assert env["SM_HOSTS"] == '["algo-1", "algo-2", "algo-3"]'
    assert env["SM_CURRENT_HOST"] == "algo-3"
    assert env["SM_CURRENT_HOST_RANK"] == "2"
    assert env["SM_HOST_COUNT"] == "3"
    assert env["SM_MASTER_ADDR"] == "algo-1" and env["SM_MASTER_PORT"] == "7777"
    assert env["SM_NUM_GPUS"] == "8" and env["SM_NUM_CPUS"] == "96"
    assert env["SM_CHANNELS"] == '["test", "train"]'
    assert env["SM_CHANNEL_TRAIN"] == "/opt/ml/input/data/train"
    assert env["SM_CHANNEL_TEST"] == "/opt/ml/input/data/test"
    assert json.loads(env["SM_HPS"]) == {"epochs": 10, "lr": 0.5, "name": "abc", "flag": False, "layers": [1, 2]}
    assert env["SM_HP_EPOCHS"] == "10" and env["SM_HP_NAME"] == "abc" and env["SM_HP_FLAG"] == "false"
    # the training toolkit's mapping.to_cmd_args: str(value), so False and [1, 2] read as Python literals
    assert json.loads(env["SM_USER_ARGS"]) == [
        "--epochs", "10", "--flag", "False", "--layers", "[1, 2]", "--lr", "0.5", "--name", "abc"]
    assert env["SM_HP_LAYERS"] == "[1, 2]"
    # instance groups: one homogeneous group, as SageMaker describes a single-type job
    assert json.loads(env["SM_INSTANCE_GROUPS"]) == ["homogeneousCluster"]
    assert json.loads(env["SM_INSTANCE_GROUPS_DICT"]) == {"homogeneousCluster": {
        "instance_group_name": "homogeneousCluster", "instance_type": "ml.p4d.24xlarge",
        "hosts": ["algo-1", "algo-2", "algo-3"]}}
    assert env["SM_CURRENT_INSTANCE_GROUP"] == "homogeneousCluster"
    assert json.loads(env["SM_CURRENT_INSTANCE_GROUP_HOSTS"]) == ["algo-1", "algo-2", "algo-3"]
    assert json.loads(env["SM_DISTRIBUTION_INSTANCE_GROUPS"]) == []  # no distribution: none takes part
    assert env["SM_IS_HETERO"] == "false" and env["SM_LOG_LEVEL"] == "20"
    assert json.loads(env["SM_FRAMEWORK_PARAMS"]) == {}
    assert env["SM_FRAMEWORK_MODULE"]
    assert env["SM_MODEL_DIR"] == "/opt/ml/model"
    assert env["SM_INPUT_DIR"] == "/opt/ml/input"
    assert env["SM_INPUT_CONFIG_DIR"] == "/opt/ml/input/config"
    assert env["SM_OUTPUT_DIR"] == "/opt/ml/output"
    assert env["SM_OUTPUT_DATA_DIR"] == "/opt/ml/output/data"
    assert env["SM_MODULE_DIR"] == "s3://bkt/code/sourcedir.tar.gz"
    assert env["SM_USER_ENTRY_POINT"] == "train.py"
    assert env["TRAINING_JOB_NAME"] == "job-1"
    training_env = json.loads(env["SM_TRAINING_ENV"])
    assert training_env["current_host"] == "algo-3" and training_env["hosts"] == ["algo-1", "algo-2", "algo-3"]
    assert training_env["channel_input_dirs"] == {"test": "/opt/ml/input/data/test", "train": "/opt/ml/input/data/train"}
    # every key of the training environment is also an SM_ variable
    assert all(f"SM_{k.upper()}" in env for k in training_env)


def _engines_view(env: dict) -> dict:
    """The distribution as the engine reads it from the contract (the variable carries the non-default keys)."""
    return Parallelism.parse(json.loads(env["TRAINYARD_DISTRIBUTION"])).to_dict()


def test_typed_distribution_reaches_the_engine():
    env = render_contract(_spec(), 0).env
    assert _engines_view(env) == {
        "mics": {"partition_group_size": 24, "hierarchical_allgather": None, "reshard_after_forward": True,
                 "two_hop_sync": True, "replica_sync": "bucketed", "replica_bucket_mb": 4.0,
                 "replica_compression": None, "hierarchical_chunks": 4, "cpu_offload": False},
        "gradient_accumulation_steps": None, "activation_checkpointing": "none", "mixed_precision": None,
        "gradient_clipping": None, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1,
        "context_parallel_degree": 1, "expert_parallel_degree": 1, "pipeline_schedule": "1f1b", "virtual_stages": 1,
        "microbatches": None, "pipeline_split": None}
    smp = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "sharded_data_parallel_degree": 8, "sdp_hierarchical_allgather": False, "sdp_gradient_clipping": 1.0}}}}
    typed = _engines_view(render_contract(_spec(distribution=smp), 0).env)
    assert typed["mics"] == {"partition_group_size": 8, "hierarchical_allgather": False, "reshard_after_forward": True,
                             "two_hop_sync": True, "replica_sync": "bucketed", "replica_bucket_mb": 4.0,
                             "replica_compression": None, "hierarchical_chunks": 4, "cpu_offload": False}
    assert typed["gradient_clipping"] == 1.0
    v2 = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"hybrid_shard_degree": 4}}}}
    assert _engines_view(render_contract(_spec(distribution=v2), 0).env)["mics"][
        "partition_group_size"] == 4


def test_root_moves_every_path_and_user_env_wins():
    c = render_contract(_spec(environment={"SM_LOG_LEVEL": "10", "MY_VAR": "x"}), 0, root="/jobs/j/algo-1")
    assert c.env["SM_MODEL_DIR"] == "/jobs/j/algo-1/model"
    assert c.env["SM_CHANNEL_TRAIN"] == "/jobs/j/algo-1/input/data/train"
    assert c.env["SM_CHECKPOINT_DIR"] == "/jobs/j/algo-1/checkpoints"
    assert json.loads(c.files["input/config/checkpointconfig.json"])["LocalPath"] == "/jobs/j/algo-1/checkpoints"
    assert c.env["SM_LOG_LEVEL"] == "10" and c.env["MY_VAR"] == "x"


def test_hosts_sorted_by_index_not_as_strings():
    c = render_contract(_spec(instance_count=11), 9)
    hosts = json.loads(c.files["input/config/resourceconfig.json"])["hosts"]
    assert hosts[1] == "algo-2" and hosts[-1] == "algo-11"
    assert json.loads(c.files["input/config/resourceconfig.json"])["current_host"] == "algo-10"


def test_hyperparameter_encoding():
    """SM_HP_* are JSON for non-strings; the command line is the toolkit's to_cmd_args."""
    assert hp_env("x y") == "x y" and hp_env(True) == "true" and hp_env({"a": 1}) == '{"a": 1}'
    assert user_args({"bb": 1, "aa": "z"}) == ["--aa", "z", "--bb", "1"]
    assert user_args({"k": 3, "use-cuda": False, "d": {"b": 2, "a": 1}, "none": None, "f": 0.001}) == [
        "-d", "a=1,b=2", "-f", "0.001", "-k", "3", "--none", "", "--use-cuda", "False"]


def test_framework_params_say_the_launcher():
    mpi = {"mpi": {"enabled": True, "processes_per_host": 8, "custom_mpi_options": "-x NCCL_DEBUG=INFO"}}
    params = json.loads(render_contract(_spec(distribution=mpi), 0).env["SM_FRAMEWORK_PARAMS"])
    assert params["sagemaker_mpi_enabled"] is True and params["sagemaker_mpi_num_of_processes_per_host"] == 8
    assert params["sagemaker_mpi_custom_mpi_options"] == "-x NCCL_DEBUG=INFO"
    td = {"torch_distributed": {"enabled": True}}
    env = render_contract(_spec(distribution=td), 0).env
    assert json.loads(env["SM_FRAMEWORK_PARAMS"]) == {"sagemaker_torch_distributed_enabled": True}
    assert json.loads(env["SM_DISTRIBUTION_INSTANCE_GROUPS"]) == ["homogeneousCluster"]


def test_local_instance_and_module_entry():
    spec = _spec(instance_type="local", instance_count=1, processes_per_host=2, entry_point="trainyard.engine.train",
                 entry_kind="module", code_uri=None)
    c = render_contract(spec, 0, num_cpus=2)
    assert json.loads(c.files["input/config/resourceconfig.json"])["current_instance_type"] == "local"
    assert c.env["SM_NUM_GPUS"] == "0" and c.env["SM_NUM_CPUS"] == "2"
    assert c.env["SM_MODULE_NAME"] == "trainyard.engine.train"


def test_tensorboard_and_profiler_configs_as_sagemaker_writes_them():
    """tensorboardoutputconfig.json is SageMaker's {LocalPath, S3OutputPath}; profilerconfig.json SageMaker's
    ProfilingParameters (a start and a count for one run of steps) with Trainyard's every step and rank; the engine
    reads both (engine/components/contract.py)."""
    from trainyard.engine.components.contract import profiler_from_contract, tensorboard_dir_from_contract

    spec = _spec(tensorboard_output_config={"s3_output_path": "s3://bkt/tb"},
                 profiler={"steps": [5, 6], "ranks": [0, 9]})
    files = {k: json.loads(v) for k, v in render_contract(spec, 1, root="/jobs/j/algo-2").files.items()}
    assert files["input/config/tensorboardoutputconfig.json"] == {"LocalPath": "/jobs/j/algo-2/output/tensorboard",
                                                                  "S3OutputPath": "s3://bkt/tb"}
    assert files["input/config/profilerconfig.json"] == {
        "ProfilingParameters": {"ProfilerEnabled": "true", "LocalPath": "/jobs/j/algo-2/output/profiler",
                                "DetailedProfilingConfig": '{"StartStep": 5, "NumSteps": 2}'},
        "S3OutputPath": "s3://bkt/out", "Steps": [5, 6], "Ranks": [0, 9]}
    # steps that are not one run: no SageMaker start and count, every step in Steps; a folder outside /opt/ml stays
    spec = _spec(profiler={"steps": [2, 7], "local_path": "/scratch/prof", "s3_output_path": "s3://bkt/prof"},
                 tensorboard_output_config={"s3_output_path": "s3://bkt/tb", "container_local_output_path": "/tb"})
    c = render_contract(spec, 0, root="/jobs/j/algo-1")
    prof = json.loads(c.files["input/config/profilerconfig.json"])
    assert prof["ProfilingParameters"] == {"ProfilerEnabled": "true", "LocalPath": "/scratch/prof"}
    assert prof["Steps"] == [2, 7] and prof["S3OutputPath"] == "s3://bkt/prof"
    assert json.loads(c.files["input/config/tensorboardoutputconfig.json"])["LocalPath"] == "/tb"
    env = {"SM_INPUT_CONFIG_DIR": "/nonexistent"}
    assert tensorboard_dir_from_contract(env) == "" and profiler_from_contract(env) is None


def test_the_engine_reads_what_the_contract_wrote(tmp_path):
    from trainyard.container.contract import write_contract
    from trainyard.engine.components.contract import profiler_from_contract, tensorboard_dir_from_contract

    spec = _spec(tensorboard_output_config={"s3_output_path": "s3://bkt/tb"}, profiler={"steps": [3, 4, 8]})
    root = str(tmp_path / "algo-1")
    write_contract(render_contract(spec, 0, root=root), root)
    env = {"SM_INPUT_CONFIG_DIR": f"{root}/input/config"}
    assert tensorboard_dir_from_contract(env) == f"{root}/output/tensorboard"
    assert profiler_from_contract(env) == {"steps": [3, 4, 8], "ranks": [0], "dir": f"{root}/output/profiler"}


def test_no_tensorboard_or_profiler_config_unless_asked():
    files = render_contract(_spec(), 0).files
    assert "input/config/tensorboardoutputconfig.json" not in files and "input/config/profilerconfig.json" not in files
