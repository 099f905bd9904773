"""The image on SageMaker (container/sagemaker.py): from SageMaker's resourceconfig.json and the spec the
SageMaker backend uploaded, the driver's launch facts for this host."""
import json

import pytest

from trainyard.container import sagemaker
from trainyard.container.contract import JOB_FILE
from trainyard.job.spec import build_spec


def _root(tmp_path, current: str, hosts: list[str]):
    (tmp_path / "input" / "config").mkdir(parents=True)
    (tmp_path / "input" / "config" / "resourceconfig.json").write_text(json.dumps(
        {"current_host": current, "hosts": hosts, "network_interface_name": "eth7"}))
    spec = build_spec(job_name="sm-job", entry_point="train.py", entry_kind="script", instance_type="ml.p4d.24xlarge",
                      instance_count=len(hosts), processes_per_host=8, output_path="s3://bkt/out",
                      role="arn:aws:iam::123456789012:role/R", image_uri="1.dkr.ecr.us-east-1.amazonaws.com/t:1")
    (tmp_path / "spec.json").write_text(spec.to_json())
    return str(tmp_path), {sagemaker.SPEC_URI_ENV: f"file://{tmp_path}/spec.json"}


def test_launch_facts_from_sagemakers_contract(tmp_path):
    root, env = _root(tmp_path, "algo-10", [f"algo-{i}" for i in range(1, 11)])
    assert sagemaker.on_sagemaker(root)
    job = sagemaker.prepare(root, env)
    assert job["host_index"] == 9 and job["master_addr"] == "algo-1" and job["network_interface"] == "eth7"
    assert json.loads((tmp_path / JOB_FILE).read_text())["spec"]["job_name"] == "sm-job"
    assert not sagemaker.on_sagemaker(root)  # the facts are written: the driver runs as on EC2


def test_refusals(tmp_path):
    root, env = _root(tmp_path, "algo-1", ["algo-1", "algo-2", "algo-3"])
    with pytest.raises(RuntimeError, match="TRAINYARD_SPEC_URI is not set"):
        sagemaker.prepare(root, {})
    spec = json.loads((tmp_path / "spec.json").read_text())
    spec["instance_count"] = 2
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with pytest.raises(RuntimeError, match="SageMaker started 3 host"):
        sagemaker.prepare(root, env)
    assert sagemaker.main(["train"]) == 2  # no SageMaker contract at /opt/ml here
