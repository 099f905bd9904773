"""(4) Processes per host. The PyTorch MNIST notebook on 2 local hosts: ONE process per host, ranked by
host (`dist.init_process_group(backend, rank=host_rank, world_size=len(hosts))`), gloo all_reduce across
the hosts through MASTER_ADDR/MASTER_PORT as SageMaker's PyTorch container sets them, the model read back
from model.tar.gz. Then the distributions: torch_distributed on CPU is still 1 per host, mpi with
processes_per_host=2 gives 2.

Notebook: aws/amazon-sagemaker-examples sagemaker-python-sdk/pytorch_mnist/pytorch_mnist.ipynb (the
`sagemaker.Session()` / `upload_data` / `PyTorch(...)` / `fit({'training': inputs})` cells, with the
framework_version/py_version of its later revision); script: scripts/mnist.py.
"""
import collections
import json
import platform
import shutil

import pytest
import torch

from .helpers import MAX_RUN, LOCAL_ROLE, PROC_LINE, SCRIPTS, all_text, read_tar, side_channels

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _tiny_mnist(data_dir):
    data_dir.mkdir()
    g = torch.Generator().manual_seed(0)
    for name, n in (("train.pt", 64), ("test.pt", 32)):
        x = torch.randn(n, 4, generator=g)
        torch.save({"x": x, "y": (x.sum(1) > 0).long()}, data_dir / name)


def test_pytorch_mnist_notebook_on_two_hosts(tmp_path, monkeypatch, capsys, caplog, recwarn):
    caplog.set_level("INFO")
    monkeypatch.chdir(tmp_path)
    shutil.copy(f"{SCRIPTS}/mnist.py", tmp_path / "mnist.py")
    _tiny_mnist(tmp_path / "data")

    import trainyard
    from trainyard.pytorch import PyTorch

    sagemaker_session = trainyard.Session()

    bucket = sagemaker_session.default_bucket()
    prefix = "sagemaker/ddp-mnist"

    role = trainyard.get_execution_role()

    inputs = sagemaker_session.upload_data(path="data", bucket=bucket, key_prefix=prefix)
    print("input spec (in this case, just an S3 path): {}".format(inputs))

    estimator = PyTorch(
        entry_point="mnist.py",
        role=role,
        py_version="py38",
        framework_version="1.11.0",
        instance_count=2,
        instance_type="local",
        hyperparameters={"epochs": 1, "backend": "gloo"},
        max_run=MAX_RUN,
    )

    estimator.fit({"training": inputs})

    said = side_channels(capsys.readouterr(), caplog, recwarn)
    out = said["stdout"]
    assert estimator.latest_training_job.describe()["TrainingJobStatus"] == "Completed"
    # exactly one process per host
    for host in ("algo-1", "algo-2"):
        assert out.count(f"Process started on host {host} ") == 1, out[-3000:]
    assert "Initialized the distributed environment: 'gloo' backend on 2 nodes." in out
    # the all_reduce went across both hosts, the averaged gradients kept them identical
    model = read_tar(estimator.model_data)
    assert "model.pth" in model
    report = json.loads(model["dist.json"])
    assert report["world_size"] == 2 and report["host_rank"] == 0 and report["current_host"] == "algo-1"
    assert report["hosts"] == ["algo-1", "algo-2"]
    assert report["sum_of_host_ranks"] == 1.0
    assert report["params_in_sync"] is True
    assert report["master_addr"] == "algo-1" and report["master_port"].isdigit()
    # started as SageMaker starts it without a distribution: plain python, no launcher's variables
    assert report["launched_with"] == {"RANK": None, "LOCAL_RANK": None, "WORLD_SIZE": None}, report
    assert "launching python mnist.py --backend gloo --epochs 1 once, host 1 of 2" in out
    # framework_version / py_version differ from this machine's: a message says so, the job still ran
    text = all_text(said)
    local_torch = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    local_py = ".".join(platform.python_version_tuple()[:2])
    for needle in ("1.11.0", "py38", local_torch):
        assert needle in text, f"no message naming {needle!r} (requested vs local versions)"
    assert local_py in text or f"py{local_py.replace('.', '')}" in text, "no message naming the local Python"


@pytest.mark.parametrize("distribution,instance_count,per_host", [
    ({"torch_distributed": {"enabled": True}}, 2, 1),
    ({"mpi": {"enabled": True, "processes_per_host": 2}}, 1, 2),
], ids=["torch_distributed-cpu-1-per-host", "mpi-processes_per_host-2"])
def test_processes_per_host_follow_the_distribution(tmp_path, capsys, distribution, instance_count, per_host):
    from trainyard.pytorch import PyTorch

    shutil.copy(f"{SCRIPTS}/count_procs.py", tmp_path / "count_procs.py")
    estimator = PyTorch(entry_point="count_procs.py", source_dir=str(tmp_path), role=LOCAL_ROLE,
                        framework_version="2.0.0", py_version="py310", instance_count=instance_count,
                        instance_type="local", distribution=distribution, max_run=MAX_RUN)
    estimator.fit()
    out = capsys.readouterr().out
    procs = [m.groups() for m in PROC_LINE.finditer(out)]
    per = collections.Counter(host for host, *_ in procs)
    assert per == {f"algo-{i + 1}": per_host for i in range(instance_count)}, out[-3000:]
    for host in per:  # distinct processes on each host
        pids = [pid for h, pid, _, _ in procs if h == host]
        assert len(set(pids)) == len(pids), procs
    if per_host > 1:  # processes started by mpirun know their rank
        assert sorted(rank for _, _, rank, _ in procs) == [str(r) for r in range(len(procs))], procs
