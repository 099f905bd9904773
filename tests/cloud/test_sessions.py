"""Every AWS call of an EC2 job goes through the user's boto3 session, against the moto server of
tests/cloud/conftest.py: the environment's default is us-east-1 with no credentials at all (what falls
back to it fails), and the Estimator's session is a us-west-2 one built from keys, given as SageMaker does
(`sagemaker_session=Session(boto_session=...)`).
"""
import json

import boto3
import botocore.client
import pytest

from trainyard.sdk.jobs.jobstate import wait_for

from .conftest import IMAGE, Recorder, leftovers

WEST = {"region_name": "us-west-2", "aws_access_key_id": "west-key", "aws_secret_access_key": "west-secret",
        "aws_session_token": "west-token"}

# IAM is global, and the placement-group fake of conftest.py keeps one list for every region
GLOBAL = {"instance-profile", "placement-group"}


class WestRecorder(Recorder):
    """The Recorder's hooks, on a session in us-west-2 built from keys."""

    def __init__(self):
        super().__init__()
        self.session = boto3.Session(**WEST)
        self.session.events.register("before-call.*.*", self._before_call)


def _left(monkeypatch, region: str) -> dict:
    monkeypatch.setenv("AWS_DEFAULT_REGION", region)  # leftovers() asks the default session
    return leftovers("west")


@pytest.mark.slow
def test_every_call_of_a_job_goes_through_the_users_session(account, tmp_path, monkeypatch):
    from trainyard import Estimator, Session

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('hello')\n")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    for var in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(var, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    made: list[str] = []  # every call of any botocore client of this process
    make_api_call = botocore.client.BaseClient._make_api_call

    def spy(client, operation, params):
        made.append(operation)
        return make_api_call(client, operation, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", spy)
    rec = WestRecorder()

    job = Estimator(entry_point="train.py", source_dir=str(tmp_path / "src"), instance_type="ml.p4d.24xlarge",
                    instance_count=2, image_uri=IMAGE, role=account["role"],
                    sagemaker_session=Session(boto_session=rec.session)).fit(wait=False, job_name="west")
    names = [name for name, _ in rec.calls]
    assert sorted(made) == sorted(names)  # nothing went through another session
    assert {"CreateBucket", "PutObject", "RunInstances", "CreateLaunchTemplate"} <= set(names)
    assert job.spec.code_uri.startswith("s3://sagemaker-us-west-2-123456789012/west/source/trainyard-code/")
    assert len(rec.params("PutObject")) == 2  # the code and the job's spec

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(var, "testing")  # for the test's own look
    assert set(_left(monkeypatch, "us-east-1")) <= GLOBAL
    assert {"instance", "launch-template", "security-group", "subnet"} <= set(_left(monkeypatch, "us-west-2"))
    assert ":us-west-2:" in job.describe()["TrainingJobArn"]
    # the controller follows the job in us-west-2, with the handed keys: the nodes' status objects move it on
    s3 = rec.session.client("s3")
    for host in job.spec.hosts:
        s3.put_object(Bucket="sagemaker-us-west-2-123456789012", Key=f"west/trainyard/hosts/{host}/status.json",
                      Body=json.dumps({"host": host, "attempt": 1, "phase": "Training"}).encode())
    wait_for(lambda: job.status() != "InProgress" or job.describe()["SecondaryStatus"] == "Training", 60, 0.2)
    assert job.describe()["SecondaryStatus"] == "Training", job.describe().get("FailureReason")
    job.stop()
    assert job.describe()["TrainingJobStatus"] == "Stopped"
    assert _left(monkeypatch, "us-west-2") == {}


def test_the_controller_gets_the_sessions_profile_or_its_keys(tmp_path, monkeypatch):
    from trainyard.sdk.backends.ec2.backend import controller_session

    (tmp_path / "credentials").write_text("[team]\naws_access_key_id = team-key\naws_secret_access_key = team-secret\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    assert controller_session(boto3.Session()) == (None, {})  # it inherits the environment
    profile, env = controller_session(boto3.Session(profile_name="team"))
    assert (profile, env) == ("team", {})  # named, the profile wins over the environment's keys, as here
    assert boto3.Session(profile_name=profile).get_credentials().access_key == "team-key"
    assert controller_session(boto3.Session(**WEST)) == (None, {
        "AWS_ACCESS_KEY_ID": "west-key", "AWS_SECRET_ACCESS_KEY": "west-secret", "AWS_SESSION_TOKEN": "west-token"})
