"""The SageMaker SDK surface, argument by argument: what each one does, what is refused, what is reported inert.
Fast: no job is started (tests/sagemaker runs copied SageMaker launches end to end)."""
import io
import json
import subprocess
import tarfile

import pytest

import trainyard
from trainyard.container.contract import render_contract
from trainyard.debugger import DebuggerHookConfig, ProfilerConfig, Rule, TensorBoardOutputConfig, rule_configs
from trainyard.huggingface import HuggingFace
from trainyard.inputs import TrainingInput
from trainyard.local import LocalSession
from trainyard.errors import ConfigError
from trainyard.pytorch import PyTorch
from trainyard.sdk.jobs import metrics
from trainyard.sdk.estimator import Estimator
from trainyard.sdk.session import default_output_path


def test_inert_arguments_are_named_once_and_requests_for_nothing_are_not(src, capsys):
    est = PyTorch(entry_point="train.py", source_dir=src, instance_type="local", role="arn:aws:iam::1:role/r",
                  debugger_hook_config=DebuggerHookConfig(s3_output_path="s3://b/d"), disable_profiler=False,
                  rules=[Rule.sagemaker(rule_configs.loss_not_decreasing())], keep_alive_period_in_seconds=600,
                  profiler_config=ProfilerConfig(system_monitor_interval_millis=500),
                  tensorboard_output_config=TensorBoardOutputConfig("s3://bkt/tb"), enable_network_isolation=False,
                  encrypt_inter_container_traffic=True, subnets=["subnet-0abc"])
    # tensorboard_output_config is used; a ProfilerConfig without framework_profile_params asks for SageMaker's
    # system monitor only, which Trainyard does not run; image_uri runs local hosts in that image (not inert)
    assert est.inert_arguments == ("debugger_hook_config", "rules", "keep_alive_period_in_seconds",
                                   "encrypt_inter_container_traffic", "profiler_config", "subnets")
    err = capsys.readouterr().err
    assert err.count("accepted with no effect on local jobs") == 1 and "encrypt_inter_container_traffic" in err
    # debugger off, profiler off, isolation off: what Trainyard does anyway, so nothing is said
    quiet = PyTorch(entry_point="train.py", source_dir=src, instance_type="local", debugger_hook_config=False,
                    disable_profiler=True, enable_network_isolation=False)
    assert quiet.inert_arguments == () and "no effect" not in capsys.readouterr().err


def test_unknown_keyword_is_a_type_error_naming_it(src):
    with pytest.raises(TypeError, match="instance_cuont"):
        Estimator(entry_point="train.py", source_dir=src, instance_cuont=2)


def test_versions_are_checked_against_what_runs_the_job(src, capsys):
    import torch

    have = torch.__version__.split("+")[0]
    PyTorch(entry_point="train.py", source_dir=src, instance_type="local", framework_version=have[:4].rstrip("."))
    assert "framework_version" not in capsys.readouterr().err
    PyTorch(entry_point="train.py", source_dir=src, instance_type="local", framework_version="1.11.0",
            py_version="py38")
    err = capsys.readouterr().err
    assert "framework_version '1.11.0'" in err and have in err and "py_version 'py38'" in err and "3.11" in err
    ec2 = PyTorch(entry_point="train.py", source_dir=src, instance_type="ml.p4d.24xlarge",
                  output_path="s3://bucket/o", framework_version="2.13", py_version="py312")
    # no distribution: the script runs once per host, as plain python (SageMaker's toolkit)
    assert "the Trainyard image" not in capsys.readouterr().err and ec2.processes_per_host == 1
    with pytest.raises(ConfigError, match="tensorflow_version"):
        HuggingFace(entry_point="train.py", source_dir=src, instance_type="local", tensorflow_version="2.6")
    # another major version of transformers: the job's overlay installs it (the notebooks' 4.x API)
    HuggingFace(entry_point="train.py", source_dir=src, instance_type="local", transformers_version="4.26",
                pytorch_version="2.13")
    err = capsys.readouterr().err
    assert "transformers_version '4.26'" in err and "installs transformers==4.26.* into its requirements overlay" in err


@pytest.mark.parametrize("kw, field", [
    (dict(input_mode="Pipe"), "input_mode"),
    (dict(training_recipe="llama3-8b"), "training_recipe"),
    (dict(instance_groups=[object(), object()]), "instance_groups"),
    (dict(instance_type="local_gpu"), "instance_type"),
    (dict(metric_definitions=[{"Name": "loss", "Regex": "loss=\\S+"}]), "metric_definitions"),
    (dict(metric_definitions=[{"Name": "loss", "Regex": "("}]), "metric_definitions"),
    (dict(tags=[{"Key": "aws:x", "Value": "1"}]), "tags"),
    (dict(dependencies=["/no/such/dir"]), "dependencies"),
    (dict(git_config={"branch": "main"}), "git_config"),
])
def test_refused_with_the_field_named(src, kw, field):
    if field == "instance_type":
        import torch

        if torch.cuda.device_count():
            pytest.skip("this machine has a GPU: local_gpu is valid here")
    with pytest.raises(ConfigError) as e:
        Estimator(entry_point="train.py", source_dir=src, **kw)
    assert e.value.field == field, str(e.value)


def test_hyperparameters_and_set_hyperparameters(src):
    est = Estimator(entry_point="train.py", source_dir=src, hyperparameters={"epochs": 1})
    est.set_hyperparameters(epochs=2, lr=0.1)
    assert est.hyperparameters() == {"epochs": 2, "lr": 0.1}
    with pytest.raises(ConfigError, match="hyperparameters"):
        est.set_hyperparameters(**{"bad name": 1})
    with pytest.raises(ValueError, match="no training job"):
        est.logs()


def test_training_input_arguments_reach_inputdataconfig(src, tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    (data / "x.csv").write_text("1\n")
    est = Estimator(entry_point="train.py", source_dir=src, input_mode="FastFile")
    ti = TrainingInput(f"file://{data}", distribution=None, compression="Gzip", content_type="text/csv",
                       record_wrapping="RecordIO", s3_data_type="S3Prefix", input_mode=None,
                       attribute_names=["source-ref"], target_attribute_name="y", shuffle_config=None)
    spec = est._job_spec({"train": ti}, "job-1")
    cfg = json.loads(render_contract(spec, 0).files["input/config/inputdataconfig.json"])
    assert cfg["train"] == {"TrainingInputMode": "FastFile", "S3DistributionType": "FullyReplicated",
                            "RecordWrapperType": "RecordIO", "ContentType": "text/csv", "CompressionType": "Gzip",
                            "AttributeNames": ["source-ref"]}
    with pytest.raises(ConfigError, match="inputs.train: s3_data_type"):
        est._job_spec({"train": TrainingInput(f"file://{data}", s3_data_type="ManifestFile")}, "job-2")


def test_model_uri_becomes_the_model_channel(src, tmp_path):
    (tmp_path / "model.tar.gz").write_bytes(b"x")
    est = Estimator(entry_point="train.py", source_dir=src, model_uri=f"file://{tmp_path}/model.tar.gz")
    spec = est._job_spec(f"file://{tmp_path}", "job-1")
    assert sorted(c.name for c in spec.channels) == ["model", "training"]


def test_dependencies_and_git_config_are_packaged(tmp_path):
    repo = tmp_path / "repo"
    (repo / "code").mkdir(parents=True)
    (repo / "code" / "train.py").write_text("import helper\n")
    (repo / "lib" / "helper").mkdir(parents=True)
    (repo / "lib" / "helper" / "__init__.py").write_text("X = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    first = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (repo / "code" / "train.py").write_text("import helper  # changed\n")
    subprocess.run([*git, "commit", "-qam", "two"], check=True)
    est = Estimator(entry_point="train.py", source_dir="code", dependencies=["lib/helper"],
                    git_config={"repo": str(repo), "branch": "main", "commit": first})
    with tarfile.open(fileobj=io.BytesIO(est._package().data)) as tar:
        names = sorted(tar.getnames())
        assert tar.extractfile("train.py").read() == b"import helper\n"  # the commit asked for
    assert names == ["helper/__init__.py", "train.py"]
    with pytest.raises(ConfigError, match="git_config: git could not checkout"):
        Estimator(entry_point="train.py", source_dir="code", git_config={"repo": str(repo), "commit": "f" * 40})


def test_metric_definitions_scrape_like_sagemaker():
    defs = [{"Name": "train:loss", "Regex": "^loss: ([0-9.]+)"}, {"Name": "acc", "Regex": "acc=([0-9.]+)%"}]
    rows = metrics.scrape(["[algo-1/0] loss: 0.50 acc=90%", "[algo-2/0] loss: nan", "noise", "loss: 0.25"], defs, 5.0)
    assert rows == [{"timestamp": 5.0, "train:loss": 0.5, "acc": 90.0}, {"timestamp": 5.0, "train:loss": 0.25}]
    assert metrics.final_metric_data_list(rows) == [
        {"MetricName": "train:loss", "Value": 0.25, "Timestamp": 5.0}, {"MetricName": "acc", "Value": 90.0, "Timestamp": 5.0}]


def test_session_on_the_embedded_store(trainyard_home, tmp_path):
    s = trainyard.Session(default_bucket_prefix="team")
    bucket = s.default_bucket()
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "a.txt").write_text("a")
    (tmp_path / "data" / "sub" / "b.txt").write_text("b")
    assert s.upload_data(str(tmp_path / "data"), key_prefix="ds") == f"s3://{bucket}/team/ds"
    assert s.upload_data(str(tmp_path / "data" / "a.txt"), bucket=bucket, key_prefix="one") == \
        f"s3://{bucket}/team/one/a.txt"
    got = s.download_data(str(tmp_path / "back"), bucket, key_prefix="team/ds")
    assert sorted(p.split("/back/")[1] for p in got) == ["a.txt", "sub/b.txt"]
    assert (tmp_path / "back" / "sub" / "b.txt").read_text() == "b"
    assert trainyard.get_execution_role().startswith("arn:aws:iam::")
    assert default_output_path(s, local=True) == f"s3://{bucket}/team"
    assert default_output_path(LocalSession(), local=True) == f"s3://{bucket}"
    with pytest.raises(ConfigError, match="output_path"):
        default_output_path(None, local=False)
