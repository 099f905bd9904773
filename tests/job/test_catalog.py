"""(issue 34) The instance catalog covers every SageMaker training instance type (botocore's enum), its rows are what
infra/instance_catalog.py writes from the shipped data files, and the backends accept what they can run: SageMaker,
Kubernetes and local every valid type, EC2 refusing only what it cannot provision well, naming why."""
import os
import subprocess
import sys

import pytest

from trainyard.errors import ConfigError
from trainyard.job import catalog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "infra"))
import instance_catalog  # noqa: E402 - infra/ is not a package


def test_the_catalog_is_what_the_generator_writes_and_covers_sagemakers_training_types():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "infra", "instance_catalog.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    enum = set(instance_catalog.training_types())
    known = set(catalog.known_types()) - {catalog.LOCAL, catalog.LOCAL_GPU}
    assert len(enum) > 200 and known <= enum
    # the one type neither source describes is left out, and said
    assert enum - known == {"p6e-gb200.36xlarge"}, enum - known
    assert "p6e-gb200.36xlarge" in r.stderr


@pytest.mark.parametrize("name,facts", [
    ("ml.m5.xlarge", dict(accelerator_kind="cpu", accelerator_count=0, vcpus=4, memory_mib=16384, processes_per_host=1,
                          efa_supported=False)),
    ("ml.g4dn.12xlarge", dict(accelerator="NVIDIA T4", accelerator_count=4, accelerator_memory_mib=16384,
                              processes_per_host=4)),
    ("ml.p3.16xlarge", dict(accelerator="NVIDIA V100", accelerator_count=8, vcpus=64, efa_supported=False)),
    ("ml.g6e.48xlarge", dict(accelerator="NVIDIA L40S", accelerator_count=8, efa_supported=True)),
    ("ml.trn2.48xlarge", dict(accelerator="AWS Trainium2", accelerator_count=16, accelerator_memory_mib=96 * 1024,
                              processes_per_host=128, max_efa_interfaces=16)),
    ("ml.p5.48xlarge", dict(accelerator="NVIDIA H100", accelerator_count=8, max_efa_interfaces=32,
                            network="3200 Gigabit")),
])
def test_lookup_of_types_the_examples_use(name, facts):
    t = catalog.lookup(name)
    assert {k: getattr(t, k) for k in facts} == facts


def test_an_unknown_type_names_the_closest():
    with pytest.raises(ConfigError, match=r"unknown instance type 'ml.m5.xlarg' \(did you mean m5.xlarge"):
        catalog.lookup("ml.m5.xlarg")


def test_trainium2_memory_is_the_documented_96_gib_not_the_ec2_datas():
    """moto's DescribeInstanceTypes copy gives Trainium2 512 GiB per chip; AWS's Trn2 page says 96 GiB (1.5 TB per
    trn2.48xlarge): the generator corrects it, or the planner would fit models that do not fit."""
    api = instance_catalog.ec2_types()["trn2.48xlarge"]
    assert api["NeuronInfo"]["NeuronDevices"][0]["MemoryInfo"]["SizeInMiB"] == 512 * 1024
    assert instance_catalog.row(api)["accelerator_memory_mib"] == 96 * 1024


def test_instance_types_command_lists_a_family():
    r = subprocess.run([sys.executable, "-m", "trainyard.sdk.cli", "catalog", "g4dn"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["type", "accelerator", "count"]
    assert [line.split()[0] for line in lines[1:]] == [
        "ml.g4dn.xlarge", "ml.g4dn.2xlarge", "ml.g4dn.4xlarge", "ml.g4dn.8xlarge", "ml.g4dn.16xlarge", "ml.g4dn.12xlarge"]


@pytest.mark.parametrize("instance_type", ["ml.m5.xlarge", "ml.c5.2xlarge", "ml.g4dn.xlarge", "ml.p3.2xlarge",
                                           "ml.g6.12xlarge", "ml.g6e.48xlarge", "ml.trn2.48xlarge"])
def test_sagemaker_accepts_the_types_its_examples_use(instance_type, tmp_path):
    """`Estimator(..., instance_type="ml.m5.xlarge", backend="sagemaker")` used to be refused as unknown."""
    from trainyard import Estimator
    from trainyard.sdk.backends.sagemaker.request import create_training_job_request, validate

    (tmp_path / "train.py").write_text("print(1)\n")
    est = Estimator(entry_point="train.py", source_dir=str(tmp_path), instance_type=instance_type, instance_count=2,
                    backend="sagemaker", role="arn:aws:iam::123456789012:role/r", output_path="s3://bkt/out",
                    image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/trainyard:1",
                    distribution={"torch_distributed": {"enabled": True}})
    spec = est._job_spec(None, "job-1")
    request = create_training_job_request(spec, spec_uri="s3://bkt/job-1/spec.json", region="us-east-1")
    validate(request)
    assert request["ResourceConfig"]["InstanceType"] == instance_type
    assert spec.processes_per_host == catalog.lookup(instance_type).processes_per_host
