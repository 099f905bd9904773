"""Local jobs inside the CPU image (`image_uri` with instance_type "local"): a 2 x 2 built-in trainer job trains as
in host mode, a SageMaker-style script with requirements.txt runs on 2 hosts, and a failing rank, a hung rank
and stop() are reported and cleaned up as in host mode, leaving no container, network or mount of the job."""
import json
import os
import signal
import sys
import textwrap
import time

import pytest

from trainyard import Estimator
from trainyard.errors import JobFailedError

from tests.e2e.helpers import beat_at_step, heartbeat, wait_for_log
from tests.waiting import within

from .conftest import leftovers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "container"))
from wheels import make_wheel  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HPS = {"model": "tiny", "steps": 3, "global_batch_size": 8, "seq_len": 32, "seed": 5, "dtype": "float32"}


def _losses(job) -> list[float]:
    return [r["loss"] for r in job.metrics()]


def test_a_2x2_mics_job_trains_in_the_image_as_in_host_mode(engine, cpu_image):
    runs = {}
    for mode, extra in (("image", {"image_uri": cpu_image}), ("host", {})):
        est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                        processes_per_host=2, distribution={"mics": {"partition_group_size": 2}}, hyperparameters=HPS,
                        max_run=300, **extra)
        started = time.monotonic()
        est.fit(logs="None")
        runs[mode] = (est.latest_training_job, time.monotonic() - started)
    image_job, host_job = runs["image"][0], runs["host"][0]
    assert image_job.status() == host_job.status() == "Completed"
    assert len(_losses(image_job)) == 3
    assert _losses(image_job) == pytest.approx(_losses(host_job), rel=1e-6, abs=1e-6)
    assert "driver: launching -m trainyard.engine.train" in image_job.log_text()
    assert "rendezvous at algo-1:" in image_job.log_text()  # the first host's name resolves in the image
    assert leftovers(engine, image_job.name) == {}
    print(f"2 x 2 job: {runs['image'][1]:.1f} s in the image, {runs['host'][1]:.1f} s as processes")


SCRIPT = textwrap.dedent('''\
    import json, os, socket
    import torch.distributed as dist
    import tinypkg  # from requirements.txt: a wheel in the code
    import iniconfig  # from requirements.txt: this machine's package index, as in host mode (not in the image)
    hosts = json.loads(os.environ["SM_HOSTS"])
    me = os.environ["SM_CURRENT_HOST"]
    assert os.environ["SM_MODEL_DIR"] == "/opt/ml/model" and os.path.isdir("/opt/ml/input/config")
    addrs = {h: socket.gethostbyname(h) for h in hosts}  # algo-N resolve in the container
    dist.init_process_group("gloo")
    import torch
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print(f"{me} of {hosts}: world {dist.get_world_size()}, sum {t.item():.0f}, tinypkg {tinypkg.VERSION}, "
          f"master {os.environ['MASTER_ADDR']}, {addrs}", flush=True)
    if dist.get_rank() == 0:
        open("/opt/ml/model/result.json", "w").write(json.dumps({"sum": t.item()}))
    dist.destroy_process_group()
''')


def test_a_sagemaker_style_script_with_requirements_runs_in_the_image_on_two_hosts(engine, cpu_image, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(SCRIPT)
    wheel = make_wheel(str(src / "wheels"), "tinypkg", "0.3")
    (src / "requirements.txt").write_text(f"./wheels/{os.path.basename(wheel)}\niniconfig\n")
    est = Estimator(entry_point="train.py", source_dir=str(src), instance_type="local", instance_count=2,
                    processes_per_host=2, image_uri=cpu_image, max_run=300)
    est.fit(logs="None")
    job = est.latest_training_job
    logs = job.log_text()
    for host in ("algo-1", "algo-2"):
        assert f"{host} of ['algo-1', 'algo-2']: world 4, sum 10, tinypkg 0.3, master algo-1" in logs, logs[-3000:]
    from .conftest import ROOT  # noqa: F401  (the store's objects are read with the SDK's own helpers)
    from tests.e2e.helpers import read_tar

    assert json.loads(read_tar(est.model_data)["result.json"]) == {"sum": 10.0}
    assert job.describe()["AlgorithmSpecification"]["TrainingImage"] == cpu_image
    assert f"hosts run in containers of {cpu_image} (podman)" in logs or engine[0] != "podman"
    assert leftovers(engine, job.name) == {}


FAIL = textwrap.dedent('''\
    import os
    if os.environ["SM_CURRENT_HOST"] == "algo-2" and os.environ["LOCAL_RANK"] == "1":
        raise ValueError("boom-in-image: the data is corrupt")
    import time; time.sleep(30)
''')
LONG = "import time\nfor i in range(600):\n    print('step', i, flush=True)\n    time.sleep(0.1)\n"


def test_a_failing_rank_a_hung_rank_and_stop_are_reported_and_cleaned_up(engine, cpu_image, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "fail.py").write_text(FAIL)
    (src / "long.py").write_text(LONG)
    common = dict(source_dir=str(src), instance_type="local", instance_count=2, processes_per_host=2,
                  image_uri=cpu_image, max_run=300)
    # a failing rank: named with its host, rank and exception
    est = Estimator(entry_point="fail.py", **common)
    with pytest.raises(JobFailedError):
        est.fit(logs="None")
    failed = est.latest_training_job
    reason = failed.describe()["FailureReason"]
    assert "algo-2" in reason and "rank 3" in reason and "ValueError: boom-in-image" in reason, reason
    # a hung rank (SIGSTOP by its pid: the containers share this machine's pids): found and named
    hung = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2,
                     processes_per_host=2, image_uri=cpu_image, max_run=300, hang_timeout_s=6,
                     hyperparameters={**HPS, "steps": 100000, "log_every": 50}).fit(wait=False)
    beat = beat_at_step(hung, "algo-2", 3, 2, timeout=120)
    os.kill(beat["pid"], signal.SIGSTOP)
    with pytest.raises(JobFailedError) as e:
        hung.wait(logs="None")
    assert str(e.value).count("Hang: rank 3 (algo-2) stopped") == 1, str(e.value)
    # stop(): the job ends Stopped
    est = Estimator(entry_point="long.py", **common)
    job = est.fit(wait=False)
    wait_for_log(job, "step 3", timeout=120)
    job.stop()
    assert job.status() == "Stopped"
    for j in (failed, hung, job):
        assert leftovers(engine, j.name) == {}, j.name


def test_the_emulated_link_still_shapes_the_hosts_traffic_in_the_image(engine, cpu_image):
    import re

    from trainyard.sdk.backends.local import netem
    from tests.e2e.helpers import SCRIPTS, store_client

    if netem.unavailable_reason():
        pytest.skip(f"emulated network unavailable: {netem.unavailable_reason()}")
    store_client().put_object(Bucket="image-net", Key="train/a.txt", Body=b"a")
    before = set(netem.leftovers())
    est = Estimator(entry_point="sm_train.py", source_dir=SCRIPTS, instance_type="local", instance_count=2,
                    processes_per_host=2, max_run=240, image_uri=cpu_image, hyperparameters={"mode": "bandwidth"},
                    emulated_network={"bandwidth_mbit": 50, "delay_ms": 0.2})
    est.fit({"train": "s3://image-net/train"}, logs="None")
    job = est.latest_training_job
    m = re.search(r"\[algo-1/0\] allreduce_s=([0-9.]+) master=(\S+) at=(\S+)", job.log_text())
    assert m, job.log_text()[-3000:]
    # a ring all-reduce of 8 MiB over 2 hosts sends at least 4 MiB across each host's link: >= 0.67 s at 50 Mbit/s
    # (tests/e2e/test_emulated_network.py: 2000 Mbit/s takes less than a quarter of that)
    assert float(m.group(1)) > 0.6 and m.group(2) == "algo-1" and m.group(3).startswith(("198.18.", "198.19."))
    assert job.describe()["TrainingJobStatus"] == "Completed"  # the model went to the store through the relay
    assert set(netem.leftovers()) == before and leftovers(engine, job.name) == {}


def test_a_killed_rank_resumes_from_the_images_checkpoint(engine, cpu_image, monkeypatch):
    """A checkpoint written in the image (Debian's Python 3.11.2, which pickles DCP's metadata enums its own way)
    is loaded by the retry, which ends with the losses of an uninterrupted run as processes."""
    import uuid

    from tests.e2e.helpers import store_client, use_store
    from trainyard.engine.components.checkpoint import list_steps

    use_store(monkeypatch)  # this process reads the checkpoint's steps from the store
    store_client().put_object(Bucket="image-resume", Key="made", Body=b"")  # the store makes the bucket
    hps = {**HPS, "steps": 12, "checkpoint_every": 3, "lr": 0.01}
    common = dict(entry_point="trainyard.engine.train", instance_type="local", instance_count=2, processes_per_host=1,
                  hyperparameters=hps, max_run=300)
    clean = Estimator(**common, checkpoint_s3_uri=f"s3://image-resume/{uuid.uuid4().hex[:8]}")
    clean.fit(logs="None")
    ckpt = f"s3://image-resume/{uuid.uuid4().hex[:8]}"
    job = Estimator(**common, checkpoint_s3_uri=ckpt, image_uri=cpu_image, max_retry_attempts=1).fit(wait=False)
    within(lambda: any(list_steps(ckpt).values()), 180, interval=0.2)
    beat = heartbeat(job, "algo-2", 1)
    assert beat and any(list_steps(ckpt).values()), job.log_text()[-3000:]
    os.kill(beat["pid"], signal.SIGKILL)
    job.wait(logs="None")
    text = job.log_text()
    assert job.status() == "Completed" and "resumed from step" in text, text[-3000:]
    assert "damaged" not in text, text[-3000:]
    assert {r["step"]: r["loss"] for r in job.metrics()}[12] == pytest.approx(
        {r["step"]: r["loss"] for r in clean.latest_training_job.metrics()}[12], rel=1e-6, abs=1e-6)
    assert leftovers(engine, job.name) == {}
