"""The cloud entry points, run in the built CPU image as each platform runs them:

- SageMaker's `train` on 2 containers, each on a network of the job's own with its `algo-N` name, under the
  contract SageMaker writes from the backend's own CreateTrainingJob request (resourceconfig.json,
  hyperparameters.json, inputdataconfig.json, the channel already downloaded, the request's `Environment`);
- the EC2 node agent (the command the user data runs) against the embedded store, which answers the S3, EC2 and
  CloudWatch Logs calls, and a fake IMDS, on 2 "instances";
- the Kubernetes entry (the pod template's command, its ConfigMap mounted where the template mounts it) with the
  training operator's variables, on 2 pods.

Every container runs this machine's network where the platform gives the host network (EC2) or where the
store must be reached on 127.0.0.1 (Kubernetes); SageMaker's containers reach nothing but each other."""
import base64
import json
import os
import re
import subprocess
import textwrap
import time
import uuid

import boto3
import pytest

from trainyard.job.spec import build_spec
from trainyard.sdk import packaging
from trainyard.sdk.backends.local import containers
from trainyard.sdk.backends.sagemaker import request as sm_request
from trainyard.sdk.backends.kubernetes import manifests
from trainyard.sdk.backends.local.backend import free_port
from tests.container.fake_imds import FakeImds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = textwrap.dedent('''\
    import argparse, json, os, socket
    import torch, torch.distributed as dist
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float)
    p.add_argument("--tag")
    a = p.parse_args()
    me, hosts = os.environ["SM_CURRENT_HOST"], json.loads(os.environ["SM_HOSTS"])
    data = os.environ["SM_CHANNEL_TRAIN"]
    files = sorted(os.listdir(data))
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print(f"{me} of {hosts} ({socket.gethostname()}): rank {dist.get_rank()} of {dist.get_world_size()}, "
          f"sum {t.item():.0f}, lr {a.lr}, tag {a.tag}, files {files}, "
          f"env {os.environ.get('MY_SETTING')}, master {os.environ['MASTER_ADDR']}", flush=True)
    if dist.get_rank() == 0:
        open(os.path.join(os.environ["SM_MODEL_DIR"], "result.json"), "w").write(json.dumps({"sum": t.item()}))
    dist.destroy_process_group()
''')


def _source(tmp_path) -> packaging.Package:
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(SCRIPT)
    return packaging.package(str(src))


def _start(engine, ref: str, name: str, options: list[str], command: list[str], log) -> subprocess.Popen:
    _, path = engine
    cmd = [path, "run", "--rm", "--name", name, "--label", f"{containers.LABEL}={name}",
           *containers.run_options(engine), "--shm-size", str(containers.SHM_BYTES), *options, ref, *command]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _finish(engine, procs: dict[str, subprocess.Popen], logs: dict[str, str], timeout: float = 300) -> dict[str, str]:
    """Wait for every container; their output by name. A container still running at `timeout` is removed."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:
                subprocess.run([engine[1], "rm", "-f", "-t", "0", name], capture_output=True)
                proc.wait(timeout=60)
    out = {}
    for name, path in logs.items():
        with open(path) as fh:
            out[name] = fh.read()
    codes = {name: proc.returncode for name, proc in procs.items()}
    assert set(codes.values()) == {0}, (codes, {n: t[-3000:] for n, t in out.items()})
    return out


def _gone(engine, names: list[str]) -> None:
    left = subprocess.run([engine[1], "ps", "-a", "--format", "{{.Names}}"], capture_output=True,
                          text=True).stdout.split()
    assert not set(names) & set(left), left


# -- SageMaker ---------------------------------------------------------------------------------------


def _play_sagemaker(req: dict, ml: str, host: str, hosts: list[str], channel_files: dict[str, bytes]) -> dict:
    """What SageMaker writes under /opt/ml before `docker run <image> train`; returns the container's env."""
    config = os.path.join(ml, "input", "config")
    os.makedirs(config)
    for d in ("model", "output/data", "code"):
        os.makedirs(os.path.join(ml, d))
    with open(f"{config}/resourceconfig.json", "w") as fh:
        json.dump({"current_host": host, "current_instance_type": req["ResourceConfig"]["InstanceType"],
                   "current_group_name": "homogeneousCluster", "hosts": hosts, "network_interface_name": "eth0",
                   "instance_groups": [{"instance_group_name": "homogeneousCluster", "hosts": hosts,
                                        "instance_type": req["ResourceConfig"]["InstanceType"]}]}, fh)
    with open(f"{config}/hyperparameters.json", "w") as fh:
        json.dump(req["HyperParameters"], fh)
    with open(f"{config}/inputdataconfig.json", "w") as fh:
        json.dump({c["ChannelName"]: {"TrainingInputMode": c.get("InputMode", "File"), "RecordWrapperType": "None",
                                      "S3DistributionType": c["DataSource"]["S3DataSource"]["S3DataDistributionType"]}
                   for c in req["InputDataConfig"]}, fh)
    for channel in req["InputDataConfig"]:  # SageMaker downloads every File-mode channel before the container runs
        folder = os.path.join(ml, "input", "data", channel["ChannelName"])
        os.makedirs(folder)
        for name, data in channel_files.items():
            with open(os.path.join(folder, name), "wb") as fh:
                fh.write(data)
    return {**req["Environment"], "TRAINING_JOB_NAME": req["TrainingJobName"],
            "TRAINING_JOB_ARN": f"arn:aws:sagemaker:us-east-1:123456789012:training-job/{req['TrainingJobName']}"}


def test_sagemakers_train_runs_on_two_containers_under_sagemakers_contract(engine, cpu_image, tmp_path):
    job = f"sm-image-{uuid.uuid4().hex[:6]}"
    shipped = tmp_path / "shipped"  # what S3 holds on SageMaker: here a folder every container sees read-only
    shipped.mkdir()
    code_uri = packaging.upload(_source(tmp_path), f"file://{shipped}/code")
    spec = build_spec(job_name=job, entry_point="train.py", entry_kind="script", instance_type="ml.g5.xlarge",
                      instance_count=2, processes_per_host=2, code_uri=code_uri, backend="sagemaker",
                      role="arn:aws:iam::123456789012:role/SageMakerRole", image_uri=cpu_image,
                      output_path="s3://bkt/out", hyperparameters={"lr": 0.5, "tag": "x y"},
                      environment={"MY_SETTING": "from-environment"}, max_run=600,
                      channels=[{"name": "train", "uri": "s3://bkt/train"}])
    spec_uri = f"file://{shipped}/spec.json"
    (shipped / "spec.json").write_text(spec.to_json())
    req = sm_request.create_training_job_request(spec, spec_uri=spec_uri, region="us-east-1")
    sm_request.validate(req)
    hosts = ["algo-1", "algo-2"]
    network = f"{job}-net"
    subprocess.run([engine[1], "network", "create", network], check=True, capture_output=True)
    procs, logs = {}, {}
    try:
        for host in hosts:
            ml = str(tmp_path / host)
            env = _play_sagemaker(req, ml, host, hosts, {"a.txt": b"alpha", "b.txt": b"beta"})
            options = ["--network", network, "--network-alias", host, "--hostname", host,
                       "--volume", f"{ml}:/opt/ml", "--volume", f"{shipped}:{shipped}:ro"]
            for k, v in env.items():
                options += ["--env", f"{k}={v}"]
            name = f"{job}-{host}"
            logs[name] = str(tmp_path / f"{host}.log")
            with open(logs[name], "w") as log:
                procs[name] = _start(engine, cpu_image, name, options, ["train"], log)
        out = _finish(engine, procs, logs)
    finally:
        subprocess.run([engine[1], "network", "rm", "-f", network], capture_output=True)
    text = "\n".join(out.values())
    for rank in range(4):
        host = hosts[rank // 2]
        assert (f"{host} of ['algo-1', 'algo-2'] ({host}): rank {rank} of 4, sum 10, lr 0.5, tag x y, "
                f"files ['a.txt', 'b.txt'], env from-environment, master algo-1") in text, text[-4000:]
    assert json.loads((tmp_path / "algo-1" / "model" / "result.json").read_text()) == {"sum": 10.0}
    assert not (tmp_path / "algo-2" / "model" / "result.json").exists()
    for host in hosts:  # SageMaker uploads /opt/ml/model itself: the driver left it as it was, and reported no failure
        assert not (tmp_path / host / "output" / "failure").exists()
    _gone(engine, list(procs))


# -- EC2 ---------------------------------------------------------------------------------------------


@pytest.fixture
def store(monkeypatch):
    """This process's AWS calls go to the embedded store with its owner's key; the containers get the same env."""
    from trainyard.sdk.store import ensure_store

    env = {**ensure_store().env(), "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # boto3's default session keeps the credentials it first resolved: an earlier test's (another store's) key
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    return env


def _store_job(tmp_path, kind: str, **spec_fields):
    """A bucket of the store holding a 2-file channel and the code, and the spec of a 2 x 2 job on them."""
    job = f"{kind}-image-{uuid.uuid4().hex[:6]}"
    bucket = f"ty-{job}"
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=bucket)
    for name, body in (("a.txt", b"alpha"), ("b.txt", b"beta")):
        s3.put_object(Bucket=bucket, Key=f"data/{name}", Body=body)
    code_uri = packaging.upload(_source(tmp_path), f"s3://{bucket}/code")
    channel = {"name": "train", "uri": f"s3://{bucket}/data", **spec_fields.pop("channel", {})}
    spec = build_spec(job_name=job, entry_point="train.py", entry_kind="script", code_uri=code_uri, instance_count=2,
                      processes_per_host=2, output_path=f"s3://{bucket}/out", hyperparameters={"lr": 0.5, "tag": "x y"},
                      environment={"MY_SETTING": "from-environment"}, max_run=600, channels=[channel], **spec_fields)
    return job, bucket, s3, spec


def test_the_ec2_node_agent_runs_a_two_instance_job_against_the_embedded_store(engine, cpu_image, tmp_path, store):
    from trainyard.container import node
    from trainyard.sdk.backends.aws.userdata import agent_command

    job, bucket, s3, spec = _store_job(tmp_path, "ec2", instance_type="g5.xlarge", image_uri=cpu_image)
    state_uri = f"s3://{bucket}/out/{job}/trainyard"
    s3.put_object(Bucket=bucket, Key=f"out/{job}/trainyard/spec.json", Body=spec.to_json().encode())
    ec2 = boto3.client("ec2")
    launched = ec2.run_instances(ImageId="ami-12c6146b", MinCount=2, MaxCount=2, InstanceType="g5.xlarge",
                                 TagSpecifications=[{"ResourceType": "instance", "Tags": [
                                     {"Key": "trainyard:job", "Value": job}, {"Key": "trainyard:attempt", "Value": "1"}]}])
    instances = sorted(launched["Instances"], key=lambda i: i["AmiLaunchIndex"])
    # the agent's command as the user data writes it (tests/sdk/test_userdata.py checks the rest of the script)
    from trainyard.sdk.backends.aws import userdata

    command = agent_command(userdata.AGENT_MARKER + "\n" + userdata._docker_run(spec, False, False, state_uri,
                                                                                 "us-east-1", 1))
    # moto's private addresses lead nowhere: the algo-N names go to a file of the instance's own (as in
    # tests/cloud/test_ec2_lifecycle.py), and the rendezvous to 127.0.0.1
    command += ["--hosts-file", "/opt/ml/hosts"]
    port = free_port()
    procs, logs, fakes = {}, {}, []
    try:
        for inst in instances:
            fake = FakeImds(inst["AmiLaunchIndex"], inst["InstanceId"])
            fakes.append(fake)
            env = {**store, "AWS_REGION": "us-east-1", "TRAINYARD_IMDS_ENDPOINT": fake.url,
                   "TRAINYARD_MASTER_ADDR": "127.0.0.1", "TRAINYARD_MASTER_PORT": str(port),
                   "TRAINYARD_SPOT_POLL_S": "0.5", "OMP_NUM_THREADS": "1"}
            ml = tmp_path / inst["InstanceId"]
            ml.mkdir()
            options = ["--network", "host", "--volume", f"{ml}:/opt/ml"]  # the user data's network and folder
            for k, v in env.items():
                options += ["--env", f"{k}={v}"]
            name = f"{job}-{inst['AmiLaunchIndex']}"
            logs[name] = str(tmp_path / f"{name}.log")
            with open(logs[name], "w") as log:
                procs[name] = _start(engine, cpu_image, name, options, command, log)
        out = _finish(engine, procs, logs)
    finally:
        for fake in fakes:
            fake.stop()
    text = "\n".join(out.values())
    for rank in range(4):  # the hosts' names are the machine's here (host network): the line's start is SM_'s
        assert re.search(rf"algo-{rank // 2 + 1} of \['algo-1', 'algo-2'\] \([^)]*\): rank {rank} of 4, sum 10, "
                         rf"lr 0.5, tag x y, files \['a.txt', 'b.txt'\], env from-environment, master 127.0.0.1", text), \
            text[-4000:]
    for host in ("algo-1", "algo-2"):
        status = json.loads(s3.get_object(Bucket=bucket, Key=f"out/{job}/trainyard/hosts/{host}/status.json")["Body"].read())
        assert status["phase"] == "Completed" and status["exit_code"] == 0, status
    logs_client = boto3.client("logs")
    events = logs_client.get_log_events(logGroupName=node.LOG_GROUP, logStreamName=f"{job}/algo-1", startFromHead=True)
    assert any("sum 10" in e["message"] for e in events["events"])
    assert s3.head_object(Bucket=bucket, Key=f"out/{job}/output/model.tar.gz")["ContentLength"] > 0
    _gone(engine, list(procs))


# -- Kubernetes --------------------------------------------------------------------------------------


def test_the_kubernetes_entry_runs_two_pods_with_the_operators_variables(engine, cpu_image, tmp_path, store):
    job, bucket, s3, spec = _store_job(tmp_path, "k8s", instance_type="ml.g5.xlarge", backend="kubernetes",
                                       image_uri=cpu_image, channel={"distribution": "ShardedByS3Key"})
    template = manifests.pytorchjob(spec)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    container = template["containers"][0]
    config_mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "contract")
    config = tmp_path / "configmap"  # the kubelet projects one file per key
    config.mkdir()
    for key, text in manifests.contract_files(spec).items():
        (config / key).write_text(text)
    port = free_port()
    master = f"{job}-master-0"
    procs, logs = {}, {}
    for rank in range(2):
        env = {**store, "MASTER_ADDR": master, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        ml = tmp_path / f"pod-{rank}"
        ml.mkdir()
        options = ["--network", "host", "--add-host", f"{master}:127.0.0.1", "--volume", f"{ml}:/opt/ml",
                   "--volume", f"{config}:{config_mount}:ro", "--hostname", f"{job}-{'master' if rank == 0 else 'worker'}-0"]
        for k, v in env.items():
            options += ["--env", f"{k}={v}"]
        name = f"{job}-{rank}"
        logs[name] = str(tmp_path / f"{name}.log")
        with open(logs[name], "w") as log:
            procs[name] = _start(engine, cpu_image, name, options, container["command"], log)
    out = _finish(engine, procs, logs)
    text = "\n".join(out.values())
    # ShardedByS3Key: each pod staged its own share of the channel
    for rank in range(4):
        files = ["a.txt"] if rank < 2 else ["b.txt"]
        assert f"rank {rank} of 4, sum 10, lr 0.5, tag x y, files {files}, env from-environment, master {master}" \
            in text, text[-4000:]
    assert "[algo-1] kubernetes: the driver exited with status 0" in text
    assert s3.head_object(Bucket=bucket, Key=f"out/{job}/output/model.tar.gz")["ContentLength"] > 0
    _gone(engine, list(procs))
