"""The SageMaker backend (sdk/backends/sagemaker/backend.py) against the moto server: fit() uploads the code and the spec
and creates the training job (moto's CreateTrainingJob/DescribeTrainingJob/ListTrainingJobs); the handle
follows it. moto answers every job as Completed at once and has no StopTrainingJob: a botocore hook on the
user's session plays SageMaker's status transitions (after-call on DescribeTrainingJob) and answers
StopTrainingJob (before-call), as said here; the job's lines are put into CloudWatch Logs (moto) as the
instances would write them."""
import json
import time
import types

import boto3
import pytest

from trainyard import Estimator
from trainyard.errors import ConfigError, JobFailedError
from trainyard.sdk.backends import open_job

from .conftest import IMAGE

STEPS = ["Starting", "Downloading", "Training", "Uploading"]


class SageMakerPlay:
    """Plays SageMaker on a boto3 session: each DescribeTrainingJob answers the next status of `script`."""

    def __init__(self, script: list[tuple[str, str]], reason: str = ""):
        self.session = boto3.Session()
        self.script, self.reason, self.calls, self.stopped = script, reason, 0, False
        self.session.events.register("after-call.sagemaker.DescribeTrainingJob", self._describe)
        self.session.events.register("before-call.sagemaker.StopTrainingJob", self._stop)

    def _describe(self, parsed, **_):
        if "TrainingJobStatus" not in parsed:
            return
        status, secondary = ("Stopped", "Stopped") if self.stopped else self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        parsed.update(TrainingJobStatus=status, SecondaryStatus=secondary)
        parsed["SecondaryStatusTransitions"] = [{"Status": s, "StartTime": parsed["CreationTime"]} for _, s in
                                                self.script[:min(self.calls, len(self.script))]]
        if status == "Failed":
            parsed["FailureReason"] = self.reason
        elif "FailureReason" in parsed:
            del parsed["FailureReason"]

    def _stop(self, **_):
        self.stopped = True
        return types.SimpleNamespace(status_code=200, headers={}), {}


def _lines(job: str, host: str, lines: list[str]) -> None:
    logs = boto3.client("logs")
    group = "/aws/sagemaker/TrainingJobs"
    if not logs.describe_log_groups(logGroupNamePrefix=group)["logGroups"]:
        logs.create_log_group(logGroupName=group)
    stream = f"{job}/{host}-1764000000"
    logs.create_log_stream(logGroupName=group, logStreamName=stream)
    now = int(time.time() * 1000)
    logs.put_log_events(logGroupName=group, logStreamName=stream,
                        logEvents=[{"timestamp": now + i, "message": line} for i, line in enumerate(lines)])


def _est(account, src, play, **kw):
    src.mkdir(parents=True, exist_ok=True)
    (src / "train.py").write_text("print('hello')\n")
    args = dict(entry_point="train.py", source_dir=str(src), instance_type="ml.p4d.24xlarge", instance_count=2,
                role=account["role"], image_uri=IMAGE, output_path="s3://ty-out/jobs", backend="sagemaker",
                boto_session=play.session, hyperparameters={"lr": 0.1, "epochs": 2}, checkpoint_s3_uri="s3://ty-out/ckpt")
    return Estimator(**{**args, **kw})


def test_fit_creates_a_training_job_and_wait_follows_it_to_completed(account, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRAINYARD_PROGRESS", "plain")
    play = SageMakerPlay([("InProgress", s) for s in STEPS] + [("Completed", "Completed")])
    est = _est(account, tmp_path, play, keep_alive_period_in_seconds=1800)
    assert est.inert_arguments == ()  # the warm pool is SageMaker's own: passed, not named as without effect
    job = est.fit(job_name="sm-ok", wait=False)
    sent = boto3.client("sagemaker").describe_training_job(TrainingJobName="sm-ok")  # what moto was given
    assert sent["AlgorithmSpecification"]["TrainingImage"] == IMAGE and sent["RoleArn"] == account["role"]
    assert sent["ResourceConfig"] == {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 2, "VolumeSizeInGB": 30,
                                      "KeepAlivePeriodInSeconds": 1800}
    hps = sent["HyperParameters"]
    assert hps["lr"] == "0.1" and hps["sagemaker_program"] == '"train.py"'
    code = json.loads(hps["sagemaker_submit_directory"])
    assert code.startswith("s3://ty-out/") and code.endswith("sourcedir.tar.gz")
    spec = json.loads(boto3.client("s3").get_object(Bucket="ty-out", Key="jobs/sm-ok/trainyard/spec.json")["Body"].read())
    assert spec["job_name"] == "sm-ok" and spec["code_uri"] == code and spec["backend"] == "sagemaker"
    assert boto3.client("sagemaker").list_training_jobs()["TrainingJobSummaries"][0]["TrainingJobName"] == "sm-ok"
    _lines("sm-ok", "algo-1", ["step 1/2 loss 2.5", "step 2/2 loss 2.0"])
    _lines("sm-ok", "algo-2", ["ready"])
    d = job.wait(logs="All", poll=0.01)
    assert d["TrainingJobStatus"] == "Completed"
    assert [t["Status"] for t in d["SecondaryStatusTransitions"]] == STEPS + ["Completed"]
    out = capsys.readouterr().out
    assert "[algo-1] step 2/2 loss 2.0" in out and "[algo-2] ready" in out
    assert "[progress] Completed | step 2/2 | loss 2.0000" in out
    # one DescribeTrainingJob per tick: each status the job passed through was seen, none skipped
    assert all(f"[progress] {s}" in out for s in STEPS), out
    again = open_job("sm-ok")  # from the job folder, as another process would
    assert type(again).__name__ == "SageMakerJob" and again.region == "us-east-1"


def test_a_failed_job_raises_with_its_reason_and_stop_stops(account, tmp_path):
    play = SageMakerPlay([("InProgress", "Starting"), ("InProgress", "Training"), ("Failed", "Failed")],
                         reason="AlgorithmError: ValueError: boom on rank 3")
    job = _est(account, tmp_path / "a", play).fit(job_name="sm-failed", wait=False)
    with pytest.raises(JobFailedError, match="boom on rank 3"):
        job.wait(logs="None", poll=0.01)
    play2 = SageMakerPlay([("InProgress", "Training")])
    running = _est(account, tmp_path / "b", play2).fit(job_name="sm-stopped", wait=False)
    running.stop()
    assert play2.stopped and running.status() == "Stopped"


def test_sagemaker_refusals_name_the_field(account, tmp_path):
    play = SageMakerPlay([("Completed", "Completed")])
    with pytest.raises(ConfigError, match="^role: SageMaker needs an IAM role ARN"):
        _est(account, tmp_path, play, role="SageMakerRole").fit(job_name="by-name")  # a name, as EC2 takes
    with pytest.raises(ConfigError, match="^keep_alive_period_in_seconds: SageMaker keeps a warm pool 0 to 21600"):
        _est(account, tmp_path, play, keep_alive_period_in_seconds=86400)
    with pytest.raises(ConfigError, match="^backend: 'sagemaker' runs an ml.\\* type"):
        Estimator(entry_point="train.py", source_dir=str(tmp_path), instance_type="local", backend="sagemaker")
    assert boto3.client("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []


def test_arguments_without_effect_are_named_for_sagemaker_jobs(account, tmp_path, capsys):
    est = _est(account, tmp_path, SageMakerPlay([]), volume_kms_key="alias/mine")
    assert est.inert_arguments == ("volume_kms_key",)
    assert "accepted with no effect on SageMaker jobs: volume_kms_key" in capsys.readouterr().err
