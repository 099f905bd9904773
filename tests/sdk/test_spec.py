"""JobSpec: JSON round trip and invariants; the instance catalog."""
import json

import pytest

from trainyard.job import catalog
from trainyard.errors import ConfigError
from trainyard.job.spec import JobSpec, build_spec


def _fields(**kw):
    f = dict(job_name="j-1", entry_point="train.py", entry_kind="script", code_uri="s3://bkt/code.tar.gz",
             hyperparameters={"a": 1, "b": "x", "c": [1.5, None], "d": {"e": True}}, instance_type="ml.p5.48xlarge",
             instance_count=4, processes_per_host=8, distribution={"torch_distributed": {"enabled": True}},
             environment={"X": "1"}, channels=[{"name": "train", "uri": "s3://bkt/t", "distribution": "ShardedByS3Key"}],
             checkpoint_s3_uri="s3://bkt/ck", output_path="s3://bkt/out", max_run=3600, role="arn:aws:iam::1:role/r")
    f.update(kw)
    return f


def test_json_round_trip():
    spec = build_spec(**_fields())
    again = JobSpec.from_json(spec.to_json())
    assert again == spec
    assert json.loads(again.to_json()) == json.loads(spec.to_json())
    assert spec.instance_type == "p5.48xlarge" and spec.world_size == 32
    assert spec.hosts == ["algo-1", "algo-2", "algo-3", "algo-4"]


def test_evolve_validates_the_whole_spec_again():
    spec = build_spec(**_fields())
    moved = spec.evolve(code_uri="s3://bkt/other.tar.gz", instance_count=2)
    assert moved.code_uri == "s3://bkt/other.tar.gz" and moved.world_size == 16 and spec.instance_count == 4
    assert moved.evolve(instance_count=4, code_uri=spec.code_uri) == spec
    with pytest.raises(ConfigError, match="instance_count"):
        spec.evolve(instance_count=0)
    with pytest.raises(ConfigError):
        spec.evolve(no_such_field=1)


def test_extra_fields_are_forbidden():
    with pytest.raises(ConfigError) as e:
        build_spec(**_fields(gpus=8))
    assert e.value.field == "gpus"
    data = json.loads(build_spec(**_fields()).to_json())
    data["surprise"] = 1
    with pytest.raises(ValueError):
        JobSpec.model_validate(data)


def test_duplicate_channels_refused():
    with pytest.raises(ConfigError):
        build_spec(**_fields(channels=[{"name": "a", "uri": "s3://bkt/1"}, {"name": "a", "uri": "s3://bkt/2"}]))


def test_catalog_facts():
    p4d = catalog.lookup("ml.p4d.24xlarge")
    assert (p4d.num_gpus, p4d.max_efa_interfaces, p4d.accelerator_memory_mib) == (8, 4, 40960)
    assert catalog.lookup("p5.48xlarge").max_efa_interfaces == 32
    assert catalog.lookup("p5en.48xlarge").max_efa_interfaces == 16
    assert catalog.lookup("p4de.24xlarge").accelerator_memory_mib == 81920
    assert catalog.lookup("g5.xlarge").efa_supported is False
    trn = catalog.lookup("trn1.32xlarge")
    assert trn.num_gpus == 0 and trn.accelerator_kind == "neuron" and trn.max_efa_interfaces == 8
    families = {n.split(".")[0] for n in catalog.known_types()}
    assert {"p4d", "p4de", "p5", "p5e", "p5en", "g5", "trn1", "local"} <= families
