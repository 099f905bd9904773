"""The image on Kubernetes (container/kubernetes.py): from the job's ConfigMap (rendered here by the SDK's own
sdk/backends/kubernetes/manifests.py and laid out as the kubelet projects it, one file per key) and the training operator's
variables, each pod's launch facts, staged channels and contract."""
import json
import os

import pytest

from trainyard.container import kubernetes as entry
from trainyard.container.contract import JOB_FILE, PLATFORM_ENV
from trainyard.container.hang import HANG_WATCH_ENV
from trainyard.job.spec import build_spec
from trainyard.sdk.backends.kubernetes.manifests import contract_files

FS = "fs-0123456789abcdef0"


def _spec(tmp_path, **kw):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for i in range(4):
        (data / f"part-{i}.bin").write_bytes(bytes(10 + i))
    fields = dict(job_name="k8s-job", entry_point="train.py", entry_kind="script", instance_type="ml.p4d.24xlarge",
                  instance_count=2, processes_per_host=8, output_path="s3://bkt/out",
                  image_uri="1.dkr.ecr.us-east-1.amazonaws.com/t:1", backend="kubernetes", hyperparameters={"lr": 0.5},
                  channels=[{"name": "train", "uri": f"file://{data}", "distribution": "ShardedByS3Key"},
                            {"name": "tokens", "uri": f"fsx://{FS}/tokens"}],
                  kubernetes={"fsx": {FS: {"dns_name": "fs.example", "mount_name": "abc"}}})
    return build_spec(**{**fields, **kw})


def _config_dir(tmp_path, spec):
    config = tmp_path / "etc-trainyard"
    config.mkdir()
    for key, text in contract_files(spec).items():
        (config / key).write_text(text)
    return str(config)


ENV = {"MASTER_ADDR": "k8s-job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
       "PYTHONUNBUFFERED": "1"}


def test_launch_facts_from_the_operators_variables(tmp_path):
    spec = _spec(tmp_path)
    facts = entry.launch_facts(spec, ENV)
    assert facts["host_index"] == 1 and facts["master_addr"] == "k8s-job-master-0" and facts["master_port"] == 23456
    assert facts["spec"]["job_name"] == "k8s-job"
    assert entry.launch_facts(spec, {**ENV, "WORLD_SIZE": "16"})["host_index"] == 1  # pods x nprocPerNode
    assert entry.launch_facts(spec, {**ENV, "RANK": "5", "PET_NODE_RANK": "0"})["host_index"] == 0
    with pytest.raises(RuntimeError, match="MASTER_ADDR, RANK not set"):
        entry.launch_facts(spec, {"MASTER_PORT": "1"})
    with pytest.raises(RuntimeError, match="rank 2, the spec asks for 2 host"):
        entry.launch_facts(spec, {**ENV, "RANK": "2"})
    with pytest.raises(RuntimeError, match="WORLD_SIZE=3"):
        entry.launch_facts(spec, {**ENV, "WORLD_SIZE": "3"})


def test_prepare_stages_this_pods_share_and_writes_its_contract(tmp_path):
    spec = _spec(tmp_path)
    config = _config_dir(tmp_path, spec)
    root = tmp_path / "ml"
    (root / "input" / "data" / "tokens").mkdir(parents=True)  # the pod's claim, mounted by the kubelet
    said = []
    job = entry.prepare(str(root), config, ENV, say=said.append)
    assert job["host_index"] == 1
    facts = json.loads((root / JOB_FILE).read_text())
    assert facts["master_addr"] == "k8s-job-master-0" and facts["spec"]["code_uri"] is None
    assert json.loads((root / "input/config/resourceconfig.json").read_text())["current_host"] == "algo-2"
    assert json.loads((root / "input/config/hyperparameters.json").read_text()) == {"lr": "0.5"}
    staged = sorted(p.name for p in (root / "input/data/train").iterdir())
    assert staged == ["part-1.bin", "part-3.bin"]  # ShardedByS3Key: every second object for the second host
    assert any(f"channel tokens: fsx://{FS}/tokens mounted at" in line for line in said)


def test_an_fsx_channel_that_is_not_mounted_fails_the_pod(tmp_path):
    spec = _spec(tmp_path)
    with pytest.raises(FileNotFoundError, match="PersistentVolumeClaim"):
        entry.prepare(str(tmp_path / "ml"), _config_dir(tmp_path, spec), ENV, say=lambda m: None)


def test_main_runs_the_driver_and_reports_a_failure(tmp_path, monkeypatch):
    spec = _spec(tmp_path, channels=[], kubernetes=None)
    root = tmp_path / "ml"
    seen = {}

    def driver(argv):
        seen.update(argv=argv, platform=os.environ[PLATFORM_ENV], hangs=os.environ[HANG_WATCH_ENV])
        (root / "output").mkdir(parents=True, exist_ok=True)
        (root / "output" / "failure").write_text("algo-1 rank 3 exited with code 1\n" + "x" * 10000)
        return 1

    monkeypatch.setattr(entry.driver, "main", driver)
    monkeypatch.setattr(entry, "TERMINATION_LOG", str(tmp_path / "termination-log"))
    monkeypatch.setenv("TRAINYARD_ML_ROOT", str(root))
    monkeypatch.setenv(entry.CONFIG_ENV, _config_dir(tmp_path, spec))
    for k, v in {**ENV, "RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    for name in (PLATFORM_ENV, HANG_WATCH_ENV):  # main() sets them: undone after the test
        monkeypatch.setenv(name, "")
    assert entry.main([]) == 1
    assert seen == {"argv": ["--root", str(root)], "platform": "kubernetes", "hangs": "driver"}
    message = (tmp_path / "termination-log").read_bytes()
    assert message.startswith(b"algo-1 rank 3 exited") and len(message) == entry.TERMINATION_MAX_BYTES


def test_main_without_a_configmap_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(entry.CONFIG_ENV, str(tmp_path))
    assert entry.main([]) == 2
    assert "no job spec at" in capsys.readouterr().err
