"""The Kubernetes backend (sdk/backends/kubernetes/) against a stub API server (k8s_stub.py: plain HTTP on 127.0.0.1, started
here, the kubeconfig pointing at it with a bearer token): `fit(wait=False)` uploads the code to the test's moto S3
and creates the job's objects through the official `kubernetes` client; the stub plays the training operator's
conditions (Created -> Running -> Succeeded, and a Failed one with a pod's termination message), and the handle
follows them with describe(), wait(), logs(), stop() and metrics()."""
import json
import os

import boto3
import jsonschema
import pytest

from trainyard import Estimator
from trainyard.errors import ConfigError, JobFailedError
from trainyard.job.uris import split_s3
from trainyard.sdk.backends import open_job
from trainyard.sdk.jobs.jobstate import job_dir
from trainyard.sdk.backends.kubernetes import manifests
from trainyard.sdk.backends.kubernetes.job import KubernetesJob

from .k8s_stub import FakeCluster
from .test_k8s_manifests import FS, IMAGE, SCHEMA

pytest.importorskip("kubernetes")

MASTER_LINES = ["[algo-1] driver: launching torchrun", "[algo-1/0] step 1/2 loss 2.50", "[algo-1/0] step 2/2 loss 1.25"]


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    c = FakeCluster()
    url = c.start()
    monkeypatch.setenv("KUBECONFIG", c.kubeconfig(tmp_path / "kubeconfig", url))
    monkeypatch.setenv("TRAINYARD_PROGRESS", "plain")
    yield c
    c.stop()


def _est(tmp_path, bucket, **kw):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text("print('hello')\n")
    args = dict(entry_point="train.py", source_dir=str(src), instance_type="ml.p4d.24xlarge", instance_count=2,
                image_uri=IMAGE, output_path=f"s3://{bucket}/out", backend="kubernetes",
                kubernetes={"namespace": "training", "service_account": "trainyard-job"},
                hyperparameters={"steps": 2}, metric_definitions=[{"Name": "loss", "Regex": r"loss ([0-9.]+)"}])
    return Estimator(**{**args, **kw})


def test_fit_submits_and_follows_a_job_to_completed(cluster, s3_bucket, tmp_path, capsys):
    cluster.play("k8s-ok", ["Created", "Running", "Running", "Running", "Succeeded"])
    cluster.logs = {"master-0": MASTER_LINES, "worker-0": ["[algo-2] driver: launching torchrun", "a plain line"]}
    job = _est(tmp_path, s3_bucket).fit(job_name="k8s-ok", wait=False)
    assert isinstance(job, KubernetesJob)
    sent = cluster.get("PyTorchJob", "k8s-ok", "training")
    jsonschema.Draft7Validator(SCHEMA).validate(sent)
    assert sent["spec"] == manifests.render(job.spec)[-1]["spec"]  # what the cluster got is the rendered job
    config = cluster.get("ConfigMap", "k8s-ok-contract", "training")
    assert json.loads(config["data"]["spec.json"])["code_uri"] == job.spec.code_uri
    assert config["metadata"]["ownerReferences"] == [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                                                      "name": "k8s-ok", "uid": sent["metadata"]["uid"]}]
    bucket, key = split_s3(job.spec.code_uri)
    assert boto3.client("s3").head_object(Bucket=bucket, Key=key)["ContentLength"] > 0  # the code was uploaded
    assert "PyTorchJob training/k8s-ok created" in capsys.readouterr().out

    first = job.describe()
    assert (first["TrainingJobStatus"], first["SecondaryStatus"]) == ("InProgress", "Starting")
    done = job.wait(logs="All", poll=0.01)
    assert (done["TrainingJobStatus"], done["SecondaryStatus"]) == ("Completed", "Completed")
    assert [t["Status"] for t in done["SecondaryStatusTransitions"]] == ["Starting", "Training", "Completed"]
    assert done["TrainingEndTime"] >= done["TrainingStartTime"] >= done["CreationTime"]
    assert done["ModelArtifacts"]["S3ModelArtifacts"] == f"s3://{s3_bucket}/out/k8s-ok/output/model.tar.gz"
    out = capsys.readouterr().out
    for line in ("[algo-1/0] step 2/2 loss 1.25", "[algo-2] driver: launching torchrun", "[algo-2] a plain line"):
        assert out.count(line) == 1, out  # each line once, prefixed with its host once
    assert [r["loss"] for r in job.metrics()] == [2.5, 1.25]
    job.logs(wait=False)  # everything so far, again, in time order
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ", 1)[1] for line in lines[:2]] == ["[algo-1] driver: launching torchrun",
                                                             "[algo-2] driver: launching torchrun"]
    assert lines[-1].endswith("[algo-1/0] step 2/2 loss 1.25") and len(lines) == 5

    again = open_job("k8s-ok")  # from the job folder, as another process would
    assert isinstance(again, KubernetesJob) and again.namespace == "training"
    cluster.stop()  # an ended job is described from the job folder, without the cluster
    assert again.describe()["TrainingJobStatus"] == "Completed"
    assert Estimator.attach("k8s-ok").latest_training_job.status() == "Completed"


def test_a_failed_job_says_why(cluster, s3_bucket, tmp_path):
    cluster.play("k8s-bad", ["Created", "Running", ("Failed", "PyTorchJob training/k8s-bad is failed because 1 "
                                                             "Worker replica(s) failed.")])
    cluster.failed_pod["k8s-bad"] = ("worker-0", "algo-2 rank 9 (local 1) exited with code 1: ValueError: bad batch")
    job = _est(tmp_path, s3_bucket, max_retry_attempts=1).fit(job_name="k8s-bad", wait=False)
    sent = cluster.get("PyTorchJob", "k8s-bad", "training")["spec"]
    assert sent["runPolicy"]["backoffLimit"] == 1
    assert sent["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
    with pytest.raises(JobFailedError) as e:
        job.wait(logs="None", poll=0.01)
    assert e.value.reason == "algo-2 rank 9 (local 1) exited with code 1: ValueError: bad batch"
    d = job.describe()
    assert (d["TrainingJobStatus"], d["SecondaryStatus"]) == ("Failed", "Failed")
    assert d["SecondaryStatusTransitions"][-1]["StatusMessage"].endswith("1 Worker replica(s) failed.")


def test_stop_deletes_the_job_and_what_it_made(cluster, s3_bucket, tmp_path):
    cluster.play("k8s-stop", ["Created", "Running"])
    est = _est(tmp_path, s3_bucket, kubernetes={
        "namespace": "training", "fsx": {FS: {"dns_name": f"{FS}.fsx.us-east-1.amazonaws.com", "mount_name": "abc"}}})
    job = est.fit({"data": f"fsx://{FS}/tokens"}, job_name="k8s-stop", wait=False)
    pv = f"training-k8s-stop-{FS}"
    claim = cluster.get("PersistentVolumeClaim", f"k8s-stop-{FS}", "training")
    assert cluster.get("PersistentVolume", pv)["spec"]["claimRef"]["name"] == claim["metadata"]["name"]
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "PyTorchJob"
    assert job.describe()["TrainingJobStatus"] == "InProgress"
    job.stop()
    assert ("DELETE", "/apis/kubeflow.org/v1/namespaces/training/pytorchjobs/k8s-stop") in cluster.requests
    assert cluster.get("PersistentVolume", pv) is None
    assert cluster.get("ConfigMap", "k8s-stop-contract", "training") is None  # owned by the job: collected
    d = job.describe()
    assert (d["TrainingJobStatus"], d["SecondaryStatus"]) == ("Stopped", "Stopped") and "FailureReason" not in d
    assert [t["Status"] for t in d["SecondaryStatusTransitions"]][-1] == "Stopped"
    job.stop()  # stopping an ended job does nothing


def test_plan_reads_the_cluster_and_refuses_with_the_field_named(cluster, s3_bucket, tmp_path, monkeypatch):
    def refused(**kw):
        with pytest.raises(ConfigError) as e:
            _est(tmp_path, s3_bucket, **kw).fit(job_name="k8s-plan", wait=False)
        return e.value

    assert refused(kubernetes={"namespace": "nowhere"}).field == "kubernetes.namespace"
    assert refused(kubernetes={"namespace": "training", "service_account": "nobody"}).field == \
        "kubernetes.service_account"
    cluster.serves_pytorchjobs = False
    e = refused()
    assert e.field == "backend" and "Kubeflow Training Operator" in str(e)
    cluster.serves_pytorchjobs = True
    cluster.objects[("PyTorchJob", "training", "k8s-plan")] = {"metadata": {"name": "k8s-plan", "uid": "u"}}
    assert refused().field == "job_name"
    del cluster.objects[("PyTorchJob", "training", "k8s-plan")]
    e = refused(kubernetes={"kubeconfig": str(tmp_path / "missing")})
    assert e.field == "kubernetes.kubeconfig" and "aws eks update-kubeconfig" in str(e)
    url = cluster.server.server_address
    monkeypatch.setenv("KUBECONFIG", cluster.kubeconfig(tmp_path / "wrong", f"http://{url[0]}:{url[1]}", "nope"))
    assert refused().field == "kubernetes" and "401" in str(refused())
    assert not any(m == "POST" for m, _ in cluster.requests)  # nothing was created


def test_dry_run_and_a_refused_object_leave_nothing(cluster, s3_bucket, tmp_path, capsys):
    # a user with rights in one namespace only may not read namespaces or service accounts: not held against it
    cluster.forbidden = {"/api/v1/namespaces/training", "/api/v1/namespaces/training/serviceaccounts/trainyard-job"}
    plan = _est(tmp_path, s3_bucket).fit(job_name="k8s-dry", dry_run=True)
    text = capsys.readouterr().out
    assert "Kubeflow PyTorchJob training/k8s-dry" in text and "nvidia.com/gpu=8, vpc.amazonaws.com/efa=4" in text
    assert plan.manifests[-1]["kind"] == "PyTorchJob" and not cluster.objects
    cluster.refuse_kind["PyTorchJob"] = (422, "PyTorchJob.kubeflow.org \"k8s-no\" is invalid: spec: Required value")
    with pytest.raises(ConfigError) as e:
        _est(tmp_path, s3_bucket).fit(job_name="k8s-no", wait=False)
    assert e.value.field == "kubernetes" and "is invalid" in str(e.value)
    assert not cluster.objects  # the ConfigMap made before it was deleted again
    assert ("DELETE", "/api/v1/namespaces/training/configmaps/k8s-no-contract") in cluster.requests
    assert not os.path.exists(job_dir("k8s-no"))  # the name stays free
