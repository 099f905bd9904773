"""A whole EC2 job against the moto server: `fit()` provisions, the test plays each instance's part, the
detached controller follows the job to its end and tears everything down.

Playing an instance: the test reads the user data the instances were launched with (from the launch
template, as EC2 would hand it to cloud-init), takes its node-agent command (`agent_command`) and runs
it here, with a fake IMDS per instance (launch index, instance id, spot notice) and the rendezvous on
127.0.0.1 (moto's private addresses lead nowhere). Everything before that line (Lustre mount, ECR
login, docker pull) is tested in tests/sdk/test_userdata.py.
"""
import base64
import glob
import os
import signal
import subprocess
import sys

import boto3
import pytest

from tests.waiting import eventually, within
from tests.timeline import assert_phases_in_order, assert_transitions_cover_the_job
from trainyard import Estimator
from trainyard.container.phases import IMAGE_END_ENV, IMAGE_START_ENV, USERDATA_START_ENV
from trainyard.job import catalog
from trainyard.job.jsonio import now_iso
from trainyard.sdk.backends.aws.userdata import agent_command
from trainyard.sdk.backends import open_job
from trainyard.sdk.backends.local.backend import free_port
from trainyard.container.lifeline import descendants
from tests.container.fake_imds import FakeImds

from .conftest import IMAGE, Recorder, leftovers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HPS = {"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "seed": 3, "lr": 0.01,
       "warmup_steps": 2}


class Instances:
    """Plays the part of a job's instances: one node agent (and fake IMDS) per launched instance."""

    def __init__(self, job: str, root: str, count: int = 2):
        self.job, self.root, self.count = job, root, count
        self.agents: list[subprocess.Popen] = []
        self.imds: list[FakeImds] = []

    def start(self, attempt: int, timeout: float = 120) -> None:
        ec2 = boto3.client("ec2")

        def launched():
            return [i for r in ec2.describe_instances(Filters=[
                {"Name": "tag:trainyard:job", "Values": [self.job]}, {"Name": "tag:trainyard:attempt", "Values": [str(attempt)]},
                {"Name": "instance-state-name", "Values": ["pending", "running"]}])["Reservations"] for i in r["Instances"]]

        # the controller launches a later attempt in its own time; all of its instances, or a poll in the middle of
        # the server's RunInstances may see only the first (attempt 2 then waited for a host that never started)
        found = eventually(lambda: (lambda f: f if len(f) >= self.count else None)(launched()), timeout, interval=0.5,
                           what=f"attempt {attempt}'s {self.count} instances launched")
        running = now_iso()
        template = ec2.describe_launch_templates(Filters=[{"Name": "tag:trainyard:job", "Values": [self.job]}])
        data = ec2.describe_launch_template_versions(
            LaunchTemplateId=template["LaunchTemplates"][0]["LaunchTemplateId"], Versions=["$Latest"])
        user_data = base64.b64decode(data["LaunchTemplateVersions"][0]["LaunchTemplateData"]["UserData"]).decode()
        command = agent_command(user_data)
        assert command[:3] == ["python", "-m", "trainyard.container.node"] and f"--attempt {attempt}" in " ".join(command)
        # what the user data would hand the agent: when it started (the instances run) and when its image pull
        # began and ended (here: the reading of the user data above, timed)
        assert all(f"-e {name}" in user_data for name in (USERDATA_START_ENV, IMAGE_START_ENV, IMAGE_END_ENV))
        booted = {USERDATA_START_ENV: running, IMAGE_START_ENV: running, IMAGE_END_ENV: now_iso()}
        port = free_port()
        for inst in sorted(found, key=lambda i: i["AmiLaunchIndex"]):
            imds = FakeImds(inst["AmiLaunchIndex"], inst["InstanceId"])
            self.imds.append(imds)
            root = f"{self.root}/attempt-{attempt}/{inst['InstanceId']}"
            os.makedirs(root)
            env = {**os.environ, "TRAINYARD_IMDS_ENDPOINT": imds.url, "TRAINYARD_MASTER_ADDR": "127.0.0.1",
                   "TRAINYARD_MASTER_PORT": str(port), "TRAINYARD_SPOT_POLL_S": "0.5", "OMP_NUM_THREADS": "1",
                   **booted}
            with open(f"{root}.log", "w") as log:
                # the algo-N names go to a hosts file of the instance's own, not to this machine's /etc/hosts
                self.agents.append(subprocess.Popen([sys.executable, *command[1:], "--root", root,
                                                     "--hosts-file", f"{root}.hosts"], env=env,
                                                    stdout=log, stderr=subprocess.STDOUT))

    def agent_logs(self, attempt: int, tail: int = 1500) -> str:
        """The end of each of an attempt's agent logs (its driver's and ranks' lines are in them): what a failed
        wait shows."""
        out = []
        for path in sorted(glob.glob(f"{self.root}/attempt-{attempt}/*.log")):
            with open(path, errors="replace") as fh:
                out.append(f"--- {os.path.basename(path)}\n{fh.read()[-tail:]}")
        return "\n".join(out)

    def interrupt(self) -> None:
        for imds in self.imds:
            imds.interrupt()

    def stop(self) -> None:
        """What terminating the instances does: every process on them ends (the driver and training
        processes run in process groups of their own, so the whole tree is found first)."""
        from trainyard.container.lifeline import signal_all

        for agent in self.agents:
            signal_all([agent.pid, *descendants(agent.pid)], signal.SIGKILL)
            agent.wait(timeout=30)
        for imds in self.imds:
            imds.stop()


def _wait(job, timeout: float = 300) -> dict:
    within(lambda: job.status() != "InProgress", timeout, interval=0.5)
    return job.describe()


def _training_processes(agent_pid: int) -> list[int]:
    """The built-in trainer's ranks under a node agent (not torchrun's own process)."""
    def cmdline(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    return [p for p in descendants(agent_pid)
            if b"trainyard.engine.train" in cmdline(p) and b"torch.distributed.run" not in cmdline(p)]


def _until_checkpointed(job, ckpt: str) -> None:
    from trainyard.engine.components.checkpoint import list_steps

    eventually(lambda: any(list_steps(ckpt).values()), 240, interval=0.5, what=lambda: job.log_text()[-3000:])


def _second_attempt_resumes(job, instances: Instances) -> str:
    """Plays attempt 2's instances until the job resumes, then stops the job; returns its log."""
    instances.start(attempt=2, timeout=180)
    within(lambda: "resumed from step" in job.log_text(), 240, interval=0.5)
    logs = job.log_text()
    job.stop()
    return logs


def _estimator(account, **kw) -> Estimator:
    return Estimator(entry_point="trainyard.engine.train", instance_type="ml.p4d.24xlarge", instance_count=2,
                     processes_per_host=1, output_path="s3://ty-out/jobs", image_uri=IMAGE, role=account["role"],
                     boto_session=Recorder().session, max_run=600, **kw)


def test_a_job_runs_to_completion_and_leaves_nothing(account, tmp_path):
    est = _estimator(account, hyperparameters={**HPS, "steps": 4, "decay_steps": 4})
    job = est.fit(wait=False, job_name="lifecycle")
    instances = Instances("lifecycle", str(tmp_path))
    try:
        instances.start(attempt=1)
        d = _wait(job)
    finally:
        instances.stop()
    assert d["TrainingJobStatus"] == "Completed", (d.get("FailureReason"), job.log_text()[-3000:])
    assert assert_transitions_cover_the_job(d) == [
        "Starting", "LaunchingMLInstances", "DownloadingTrainingImage", "PreparingTrainingStack", "Downloading",
        "Training", "Uploading", "Completed"]
    # no channels and no code to fetch (an installed module); the built-in trainer's first step shows in
    # algo-1's metrics.jsonl, and on algo-2 (whose rank prints nothing) by the engine's marker file
    assert_phases_in_order(d, {"algo-1": ["capacity", "image", "peers", "first_step", "upload"],
                               "algo-2": ["capacity", "image", "peers", "first_step"]})
    cost = d["EstimatedCost"]  # 2 instances from their LaunchTime to the teardown, at the catalog's price
    assert cost["PricePerHour"] == catalog.price_table()["on_demand"]["us-east-1"]["p4d.24xlarge"]
    assert cost["Amount"] == cost["InstanceHours"] * cost["PricePerHour"] and cost["Market"] == "on-demand"
    # within the job's time (EC2's LaunchTime has whole seconds: up to one more second each)
    assert 0 < cost["InstanceHours"] <= 2 * ((d["TrainingEndTime"] - d["CreationTime"]).total_seconds() + 1) / 3600
    assert d["BillableTimeInSeconds"] == round(cost["InstanceHours"] * 3600 / 2)
    logs = job.log_text()  # mirrored from CloudWatch Logs by the controller
    # both hosts' streams (rank 1 prints nothing of its own: the built-in trainer speaks on rank 0)
    assert "[algo-1/0]" in logs and "[algo-2] driver: completed" in logs and "step 4/4" in logs
    rows = job.metrics()  # rank 0's metrics.jsonl, shipped by algo-1's agent and mirrored by the controller
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in rows), rows
    assert f"step 4/4 loss {rows[-1]['loss']:.4f}" in logs
    bucket, key = d["ModelArtifacts"]["S3ModelArtifacts"][len("s3://"):].split("/", 1)
    assert boto3.client("s3").head_object(Bucket=bucket, Key=key)["ContentLength"] > 0
    assert leftovers("lifecycle") == {}
    again = Estimator.attach("lifecycle").latest_training_job
    assert type(again) is type(open_job("lifecycle")) and again.describe()["TrainingJobArn"].endswith(":training-job/lifecycle")
    assert again.describe()["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"


def test_a_spot_interruption_resumes_on_new_capacity_from_the_checkpoint(account, tmp_path):
    ckpt = "s3://ty-out/ckpt/spot"
    est = _estimator(account, hyperparameters={**HPS, "steps": 400, "decay_steps": 400, "checkpoint_every": 2},
                     checkpoint_s3_uri=ckpt, use_spot_instances=True, max_wait=1200, max_retry_attempts=1)
    job = est.fit(wait=False, job_name="spot")
    instances = Instances("spot", str(tmp_path))
    try:
        instances.start(attempt=1)
        _until_checkpointed(job, ckpt)
        instances.interrupt()  # the two-minute notice on both instances
        logs = _second_attempt_resumes(job, instances)
    finally:
        instances.stop()
    # the ranks stop together after a step and make sure it is checkpointed (an emergency save, or the
    # regular one when that step had one), and the next attempt starts right after it
    assert "SIGTERM: stopping after step " in logs, logs[-3000:]
    saved = int(logs.split("SIGTERM: stopping after step ")[1].split()[0])
    assert f"emergency checkpoint step {saved}" in logs or f"SIGTERM: step {saved} is already checkpointed" in logs
    assert f"resumed from step {saved} at {ckpt}" in logs
    steps = [r["step"] for r in job.metrics()]  # attempt 1's rows, then what attempt 2 shipped before the stop
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= saved, (saved, steps)
    d = job.describe()
    seen = assert_transitions_cover_the_job(d)
    assert seen.count("Interrupted") == 1 and seen[seen.index("Interrupted") + 1] == "LaunchingMLInstances"
    assert d["TrainingJobStatus"] == "Stopped" and leftovers("spot") == {}
    # 4 instances over the two attempts, at the spot estimate
    cost = d["EstimatedCost"]
    assert cost["Market"] == "spot" and cost["Amount"] == cost["InstanceHours"] * cost["PricePerHour"]
    assert len(job._status()["InstanceTimes"]) == 4


def test_a_killed_rank_restarts_the_job_on_new_instances(account, tmp_path):
    """On-demand, max_retry_attempts=1: the training process of algo-2 is killed (as by the OOM killer); the
    controller launches attempt 2 on new instances, which resumes from the last committed step."""

    ckpt = "s3://ty-out/ckpt/retry"
    est = _estimator(account, hyperparameters={**HPS, "steps": 400, "decay_steps": 400, "checkpoint_every": 2},
                     checkpoint_s3_uri=ckpt, max_retry_attempts=1)
    job = est.fit(wait=False, job_name="retry")
    instances = Instances("retry", str(tmp_path))
    try:
        instances.start(attempt=1)
        _until_checkpointed(job, ckpt)
        ranks = _training_processes(instances.agents[1].pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        logs = _second_attempt_resumes(job, instances)
    finally:
        instances.stop()
    assert "resumed from step" in logs, logs[-3000:] + "\n" + instances.agent_logs(2)
    d = job.describe()
    first = d["Attempts"][0]
    assert first["Attempt"] == 1 and first["Outcome"] == "Failed", first
    assert first["RetryClass"] in ("killed process", "collective error"), first
    seen = assert_transitions_cover_the_job(d)
    assert seen.count("Restarting") == 1 and seen[seen.index("Restarting") + 1] == "LaunchingMLInstances"
    assert d["TrainingJobStatus"] == "Stopped" and leftovers("retry") == {}


def test_a_stopped_rank_is_found_by_its_hosts_driver_and_named(account, tmp_path):
    """No process sees every host on EC2: each driver watches its own ranks. A SIGSTOPed rank on algo-2 is
    named by algo-2's driver; the controller prefers that diagnosis to algo-1's, whose rank only waits."""
    est = _estimator(account, hyperparameters={**HPS, "steps": 400, "decay_steps": 400}, hang_timeout_s=6)
    job = est.fit(wait=False, job_name="hang")
    instances = Instances("hang", str(tmp_path))
    try:
        instances.start(attempt=1)
        within(lambda: "step 3/400" in job.log_text(), 240, interval=0.5)
        ranks = _training_processes(instances.agents[1].pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGSTOP)
        d = _wait(job, timeout=180)
    finally:
        instances.stop()
    assert d["TrainingJobStatus"] == "Failed", job.log_text()[-3000:]
    assert d["FailureReason"].startswith("Hang: rank 1 (algo-2) stopped in "), d["FailureReason"]
    assert "(SIGSTOP" in d["FailureReason"].split(";")[0], d["FailureReason"]
    assert "[algo-2] driver: rank 1 (algo-2) stacks:" in job.log_text()
    assert leftovers("hang") == {}
