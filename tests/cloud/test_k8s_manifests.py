"""The Kubernetes objects of a job (sdk/backends/kubernetes/manifests.py) and what is refused before them (sdk/backends/kubernetes/check.py).

The PyTorchJob is validated against a subset of the Kubeflow PyTorchJob CRD's OpenAPI v3 schema written for these
tests (data/pytorchjob_crd_schema.json: the v1 API's fields, closed where Trainyard renders an object whole, since
the API server would silently drop a misspelt field), and every core object (the pod template, the ConfigMap, the
PersistentVolume and its claim) through the `kubernetes` client's own models: deserialized into the model and
serialized back, it must come back unchanged, which a field name the model does not have cannot."""
import copy
import json
import os

import jsonschema
import pytest
import yaml

from trainyard import Estimator
from trainyard.errors import ConfigError
from trainyard.job.spec import JobSpec, build_spec
from trainyard.sdk.cli import main
from trainyard.sdk.backends.kubernetes import check
from trainyard.sdk.backends.kubernetes import manifests

kubernetes = pytest.importorskip("kubernetes")  # the `kubernetes` extra: make test installs it

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainyard:1"
FS = "fs-0123456789abcdef0"
SCHEMA = json.load(open(os.path.join(os.path.dirname(__file__), "data", "pytorchjob_crd_schema.json")))
K8S = {"namespace": "training", "service_account": "trainyard-job",
       "fsx": {FS: {"dns_name": f"{FS}.fsx.us-east-1.amazonaws.com", "mount_name": "abcdefgh"}},
       "node_selector": {"eks.amazonaws.com/capacityType": "ON_DEMAND"},
       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}


def spec(**kw):
    fields = dict(job_name="llama-run-1", entry_point="train.py", entry_kind="script",
                  code_uri="s3://my-bucket/out/trainyard-code/abc/sourcedir.tar.gz", hyperparameters={"lr": 0.1},
                  instance_type="ml.p4d.24xlarge", instance_count=3, processes_per_host=8,
                  output_path="s3://my-bucket/out",
                  image_uri=IMAGE, max_retry_attempts=2, max_run=7200, backend="kubernetes", kubernetes=K8S,
                  channels=[{"name": "train", "uri": "s3://my-bucket/tokens", "distribution": "ShardedByS3Key"},
                            {"name": "data", "uri": f"fsx://{FS}/datasets/tokens"}], tags={"team": "ml"})
    return build_spec(**{**fields, **kw})


def round_trip(data: dict, model: str) -> dict:
    """`data` deserialized into the client's `model` and serialized back: unknown field names are dropped."""
    client = kubernetes.client.ApiClient()
    return client.sanitize_for_serialization(client._ApiClient__deserialize(copy.deepcopy(data), model))


def assert_model(data: dict, model: str) -> None:
    back = round_trip(data, model)
    assert back == data, f"not a {model}: {json.dumps(data, sort_keys=True)} came back as " \
                         f"{json.dumps(back, sort_keys=True)}"


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {m["kind"]: m for m in objects}


def test_the_pytorchjob_validates_against_the_crd_schema_and_the_client_models():
    objects = manifests.render(spec())
    assert [m["kind"] for m in objects] == ["ConfigMap", "PersistentVolume", "PersistentVolumeClaim", "PyTorchJob"]
    kinds = by_kind(objects)
    job = kinds["PyTorchJob"]
    jsonschema.Draft7Validator(SCHEMA).validate(job)
    for role in ("Master", "Worker"):
        assert_model(job["spec"]["pytorchReplicaSpecs"][role]["template"], "V1PodTemplateSpec")
    assert_model(kinds["ConfigMap"], "V1ConfigMap")
    assert_model(kinds["PersistentVolume"], "V1PersistentVolume")
    assert_model(kinds["PersistentVolumeClaim"], "V1PersistentVolumeClaim")


def test_what_the_pytorchjob_says():
    s = spec()
    job = by_kind(manifests.render(s))["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1" and job["metadata"]["name"] == "llama-run-1"
    assert job["metadata"]["namespace"] == "training"
    assert json.loads(job["metadata"]["annotations"]["trainyard.io/tags"]) == {"team": "ml"}
    run = job["spec"]["runPolicy"]
    assert run == {"cleanPodPolicy": "None", "backoffLimit": 2, "activeDeadlineSeconds": 7200}
    assert job["spec"]["nprocPerNode"] == "8"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
    assert {r["restartPolicy"] for r in replicas.values()} == {"OnFailure"}
    pod = replicas["Master"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["name"] == "pytorch" and c["image"] == IMAGE
    assert c["command"] == ["python", "-m", "trainyard.container.kubernetes"]
    assert c["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"}]
    # p4d.24xlarge: 8 A100s, 4 EFA interfaces, 96 vCPUs, 1152 GiB (most of it requested)
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4"}
    assert c["resources"]["requests"] == {"cpu": "86", "memory": f"{int(1179648 * 0.85)}Mi"}
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge",
                                   "eks.amazonaws.com/capacityType": "ON_DEMAND"}
    assert pod["serviceAccountName"] == "trainyard-job" and pod["tolerations"] == K8S["tolerations"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/trainyard"]["readOnly"] and "/dev/shm" in mounts
    assert mounts["/opt/ml/input/data/data"] == {"name": "fsx-0", "mountPath": "/opt/ml/input/data/data",
                                                 "readOnly": True, "subPath": "datasets/tokens"}
    assert "/opt/ml/input/data/train" not in mounts  # S3 channels: staged by the pod's entry, not mounted
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    assert volumes["fsx-0"]["persistentVolumeClaim"] == {"claimName": f"llama-run-1-{FS}", "readOnly": True}
    assert volumes["contract"]["configMap"]["name"] == "llama-run-1-contract"


def test_the_contract_configmap_and_the_fsx_volume():
    s = spec()
    assert JobSpec.from_json(s.to_json()) == s  # the options round-trip with the spec
    assert s.evolve(backend=None).backend == "kubernetes"  # the options choose it
    kinds = by_kind(manifests.render(s))
    data = kinds["ConfigMap"]["data"]
    assert json.loads(data["spec.json"]) == json.loads(s.to_json())
    assert json.loads(data["hyperparameters.json"]) == {"lr": "0.1"}
    resource = json.loads(data["resourceconfig.json"])
    assert resource["hosts"] == ["algo-1", "algo-2", "algo-3"] and "current_host" not in resource
    assert set(json.loads(data["inputdataconfig.json"])) == {"train", "data"}
    pv, pvc = kinds["PersistentVolume"], kinds["PersistentVolumeClaim"]
    assert pv["spec"]["csi"] == {"driver": "fsx.csi.aws.com", "volumeHandle": FS, "volumeAttributes": {
        "dnsname": f"{FS}.fsx.us-east-1.amazonaws.com", "mountname": "abcdefgh"}}
    assert pv["spec"]["claimRef"] == {"namespace": "training", "name": pvc["metadata"]["name"]}
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"] == f"training-llama-run-1-{FS}"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == ""


def test_variants_single_host_no_retries_ml_names_and_accelerators():
    one = by_kind(manifests.render(spec(instance_count=1, max_retry_attempts=0, channels=[], kubernetes=None)))
    assert list(one) == ["ConfigMap", "PyTorchJob"]
    job = one["PyTorchJob"]
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"] and job["metadata"]["namespace"] == "default"
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]
    assert master["restartPolicy"] == "Never" and job["spec"]["runPolicy"]["backoffLimit"] == 0
    assert "serviceAccountName" not in master["template"]["spec"]
    jsonschema.Draft7Validator(SCHEMA).validate(job)

    def limits(itype, **kw):
        s = spec(instance_type=itype, channels=[], kubernetes=kw or None, processes_per_host=1)
        return manifests.resources(s)["limits"], manifests.pod_template(s)["spec"]["nodeSelector"]

    assert limits("ml.p5.48xlarge") == ({"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"},
                                        {"node.kubernetes.io/instance-type": "p5.48xlarge"})
    assert limits("trn1.32xlarge")[0] == {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "8"}
    assert limits("ml.g5.2xlarge")[0] == {"nvidia.com/gpu": "1"}  # no EFA on this size
    assert limits("ml.p5.48xlarge", efa=False)[0] == {"nvidia.com/gpu": "8"}
    claim = spec(kubernetes={"fsx": {FS: {"claim_name": "shared-fsx"}}})
    kinds = by_kind(manifests.render(claim))
    assert "PersistentVolume" not in kinds and "PersistentVolumeClaim" not in kinds  # the existing claim is used
    pod = kinds["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {"name": "fsx-0", "persistentVolumeClaim": {"claimName": "shared-fsx", "readOnly": True}} in pod["volumes"]


def test_the_checks_catch_misspelt_fields():
    """The schema and the model round trip are not vacuous: a misspelt key fails each."""
    job = by_kind(manifests.render(spec()))["PyTorchJob"]
    validator = jsonschema.Draft7Validator(SCHEMA)
    for path, bad in ((("spec", "runPolicy"), "backOffLimit"), (("spec",), "nProcPerNode"),
                      (("spec", "pytorchReplicaSpecs", "Master"), "restartpolicy")):
        broken = copy.deepcopy(job)
        node = broken
        for key in path:
            node = node[key]
        node[bad] = 1
        assert not validator.is_valid(broken), bad
    broken = copy.deepcopy(job)
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Sometimes"
    assert not validator.is_valid(broken)
    broken = copy.deepcopy(job)
    broken["spec"]["nprocPerNode"] = 8  # a string in v1
    assert not validator.is_valid(broken)
    template = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    for where, bad in (("spec", "nodeSelecter"), ("container", "volumeMount"), ("container", "resource")):
        broken = copy.deepcopy(template)
        target = broken["spec"] if where == "spec" else broken["spec"]["containers"][0]
        target[bad] = {"x": "1"}
        with pytest.raises(AssertionError, match="came back as"):
            assert_model(broken, "V1PodTemplateSpec")


@pytest.mark.parametrize("change, field, words", [
    ({"instance_type": "local", "backend": None, "kubernetes": None, "image_uri": None, "channels": []},
     "instance_type", "cluster's EC2 nodes"),
    ({"image_uri": None}, "image_uri", "trainyard image push"),
    ({"job_name": "Llama-Run"}, "job_name", "job_name='llama-run'"),
    ({"job_name": "x" * 60}, "job_name", "at most 54"),
    ({"use_spot_instances": True, "max_wait": 7200}, "use_spot_instances", "capacityType"),
    ({"subnets": ["subnet-0abc"]}, "subnets", "node group's subnets"),
    ({"volume_size": 200}, "volume_size", "node's disk"),
    ({"output_path": "file:///tmp/out"}, "output_path", "pods cannot read"),
    ({"channels": [{"name": "train", "uri": "file:///tmp/data"}]}, "inputs.train", "upload it to s3://"),
    ({"channels": [{"name": "data", "uri": "fsx://fs-0123456789abcdef1/x"}]}, "kubernetes.fsx", "fs-0123456789abcdef1"),
    ({"channels": [{"name": "data", "uri": f"fsx://{FS}/x", "distribution": "ShardedByS3Key"}]}, "inputs.data",
     "mounted whole"),
    ({"channels": [{"name": "m", "uri": "s3://my-bucket/m.manifest", "s3_data_type": "ManifestFile"}]}, "inputs.m",
     "S3Prefix"),
    ({"instance_type": "ml.g5.2xlarge", "processes_per_host": 1, "channels": [], "kubernetes": {"efa": True}},
     "kubernetes.efa", "no EFA"),
    ({"kubernetes": {**K8S, "node_selector": {"node.kubernetes.io/instance-type": "p5.48xlarge"}}},
     "kubernetes.node_selector", "contradicts"),
    ({"hyperparameters": {f"h{i}": "x" * 2000 for i in range(600)}}, "hyperparameters", "1048576"),
])
def test_check_refuses_with_the_field_named(change, field, words):
    s = spec(**change)
    with pytest.raises(ConfigError) as e:
        check.check(s)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_check_passes_the_representative_job():
    check.check(spec())


def test_to_kubernetes_writes_the_yaml_and_the_code(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('hi')\n")
    est = Estimator(entry_point="train.py", source_dir=str(tmp_path / "src"), instance_type="ml.p4d.24xlarge",
                    instance_count=2, image_uri=IMAGE, output_path="s3://my-bucket/out", kubernetes=K8S,
                    hyperparameters={"epochs": 2})
    out = tmp_path / "k8s"
    objects = est.to_kubernetes(str(out), {"data": f"fsx://{FS}/datasets"}, job_name="run-7")
    text = (out / "pytorchjob.yaml").read_text()
    assert list(yaml.safe_load_all(text)) == objects
    code_uri = json.loads(objects[0]["data"]["spec.json"])["code_uri"]
    assert code_uri.startswith("s3://my-bucket/run-7/source/trainyard-code/")  # beside the job, as SageMaker stages it
    assert f"aws s3 cp sourcedir.tar.gz {code_uri}" in text
    assert (out / "sourcedir.tar.gz").stat().st_size > 0
    assert est.to_kubernetes(job_name="run-8")[-1]["metadata"]["name"] == "run-8"  # no path: nothing written
    with pytest.raises(ConfigError, match="job_name: 'Run-9'"):
        est.to_kubernetes(job_name="Run-9")
    local = Estimator(entry_point="train.py", source_dir=str(tmp_path / "src"), instance_type="local")
    with pytest.raises(ConfigError) as e:
        local.to_kubernetes(str(tmp_path / "never"))
    assert e.value.field == "instance_type" and not (tmp_path / "never").exists()


def test_render_kubernetes_command(tmp_path, capsys):
    kwargs = {"entry_point": "json.tool", "instance_type": "ml.p5.48xlarge", "instance_count": 2,
              "image_uri": IMAGE, "output_path": "s3://my-bucket/out", "kubernetes": {"namespace": "training"},
              "hyperparameters": {"steps": 2}}
    out = tmp_path / "k8s"
    assert main(["render", "kubernetes", json.dumps(kwargs), str(out), "--job-name", "cli-run",
                 "--inputs", json.dumps({"train": "s3://my-bucket/tokens"})]) == 0
    assert capsys.readouterr().out.split() == [str(out / "pytorchjob.yaml")]  # an installed module: no code to ship
    job = list(yaml.safe_load_all((out / "pytorchjob.yaml").read_text()))[-1]
    assert job["metadata"] == {"name": "cli-run", "namespace": "training", "labels": {
        "trainyard.io/job": "cli-run", "app.kubernetes.io/managed-by": "trainyard"}}
    assert main(["render", "kubernetes", json.dumps({**kwargs, "kubernetes": {"namespace": "Bad"}}), str(out)]) == 2
    assert "kubernetes.namespace: namespace 'Bad'" in capsys.readouterr().err
