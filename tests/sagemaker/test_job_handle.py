"""(7) The job handle as SageMaker users drive it: fit(wait=False), estimator.logs() streaming to the end,
latest_training_job.name / .job_name / wait(logs="None") / describe(), hyperparameters() and
set_hyperparameters(), model_data, Estimator.attach(job_name). Also: arguments with no effect locally are
accepted and reported once.

The estimator follows aws-samples/amazon-sagemaker-local-mode
pytorch_script_mode_local_training_and_serving (LocalSession with local_code, the dummy role, a
`file://` input); the last test runs that sample's `fit('file://./data/')` as written.
"""
import os
import uuid

import pytest

from .helpers import MAX_RUN, LOCAL_ROLE, copy_scripts, decode_hp, read_tar, side_channels

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KMS = "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"
NO_EFFECT_LOCALLY = {
    "volume_kms_key": KMS,
    "output_kms_key": KMS,
    "encrypt_inter_container_traffic": True,
    "keep_alive_period_in_seconds": 600,
}


def test_job_handle(tmp_path, monkeypatch, capsys, caplog, recwarn):
    caplog.set_level("INFO")
    monkeypatch.chdir(tmp_path)
    copy_scripts(tmp_path / "code", "train_handle.py")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part-0.csv").write_text("1,2\n")

    from trainyard.estimator import Estimator
    from trainyard.local import LocalSession
    from trainyard.pytorch import PyTorch

    sagemaker_session = LocalSession()
    sagemaker_session.config = {"local": {"local_code": True}}

    # For local training a dummy role will be sufficient
    role = LOCAL_ROLE

    estimator = PyTorch(entry_point="train_handle.py",
                        source_dir="./code",
                        role=role,
                        framework_version="1.8",
                        py_version="py3",
                        instance_count=1,
                        instance_type="local",
                        hyperparameters={
                            "epochs": 1,
                        },
                        sagemaker_session=sagemaker_session,
                        max_run=MAX_RUN,
                        **NO_EFFECT_LOCALLY)
    assert decode_hp(estimator.hyperparameters()["epochs"]) == 1
    estimator.set_hyperparameters(epochs=2)
    assert decode_hp(estimator.hyperparameters()["epochs"]) == 2

    job_name = f"handle-{uuid.uuid4().hex[:8]}"
    estimator.fit(f"file://{tmp_path}/data", wait=False, job_name=job_name, experiment_config=None)
    job = estimator.latest_training_job
    assert job.name == job_name and job.job_name == job_name

    estimator.logs()  # follows the job to its end
    assert job.describe()["TrainingJobStatus"] == "Completed"
    first = capsys.readouterr()
    out = first.out
    assert "epoch 1/2 files=part-0.csv" in out and "epoch 2/2 files=part-0.csv" in out, out[-3000:]
    assert "training finished" in out

    estimator.latest_training_job.wait(logs="None")
    quiet = capsys.readouterr()
    assert quiet.out == "" and quiet.err == "", quiet

    estimator.latest_training_job.wait()  # default logs="All": returns on a finished job
    last = capsys.readouterr()

    # each argument with no effect locally was named, once, on stderr (or logging / warnings)
    said = side_channels(first, caplog, recwarn)
    said["stderr"] = "\n".join(c.err for c in (first, quiet, last))
    del said["stdout"]  # the job's own log, replayed by logs() and wait() above
    for arg in NO_EFFECT_LOCALLY:
        counts = {ch: sum(arg in line for line in text.splitlines()) for ch, text in said.items()}
        assert sum(counts.values()) >= 1, f"{arg} (no effect locally) was never reported"
        assert max(counts.values()) == 1, f"{arg} reported more than once: {counts}"

    model_data = estimator.model_data
    assert model_data.startswith("s3://") and model_data.endswith("/model.tar.gz") and job_name in model_data
    assert read_tar(model_data)["model.txt"] == b"epochs=2"

    attached = Estimator.attach(job_name)
    assert attached.latest_training_job.name == job_name
    assert attached.model_data == model_data
    assert decode_hp(attached.hyperparameters()["epochs"]) == 2

    # the helpers around the estimator (issue 34): create_model, the session's job calls, trainyard.s3
    model = estimator.create_model()
    assert type(model).__name__ == "PyTorchModel" and model.model_data == model_data and model.role == role
    with pytest.raises(NotImplementedError, match="does not host endpoints"):
        model.deploy(initial_instance_count=1, instance_type="ml.m5.xlarge")
    assert estimator.sagemaker_session is sagemaker_session
    assert sagemaker_session.describe_training_job(job_name)["TrainingJobStatus"] == "Completed"
    described = sagemaker_session.sagemaker_client.describe_training_job(TrainingJobName=job_name)
    assert described["ModelArtifacts"]["S3ModelArtifacts"] == model_data
    sagemaker_session.logs_for_job(job_name, wait=True)
    assert "epoch 2/2 files=part-0.csv" in capsys.readouterr().out

    from trainyard.s3 import S3Downloader

    assert model_data in S3Downloader.list(model_data.rsplit("/", 1)[0])
    files = S3Downloader.download(model_data, str(tmp_path / "model"))
    assert [os.path.basename(f) for f in files] == ["model.tar.gz"]


def test_local_mode_sample_as_written(tmp_path, monkeypatch, capsys):
    """aws-samples/amazon-sagemaker-local-mode pytorch_script_mode_local_training_and_serving.py, verbatim
    but for the script: a relative `file://./data/` input, a relative source_dir."""
    monkeypatch.chdir(tmp_path)
    copy_scripts(tmp_path / "code", "train_handle.py")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "batches.meta").write_text("meta")

    from trainyard.local import LocalSession
    from trainyard.pytorch import PyTorch

    sagemaker_session = LocalSession()
    sagemaker_session.config = {'local': {'local_code': True}}

    # For local training a dummy role will be sufficient
    role = 'arn:aws:iam::111111111111:role/service-role/AmazonSageMaker-ExecutionRole-20200101T000001'

    print('Starting model training')
    cifar10_estimator = PyTorch(entry_point='train_handle.py',
                                source_dir='./code',
                                role=role,
                                framework_version='1.8',
                                py_version='py3',
                                instance_count=1,
                                instance_type='local',
                                hyperparameters={
                                    'epochs': 1,
                                },
                                max_run=MAX_RUN)

    cifar10_estimator.fit('file://./data/')

    assert "epoch 1/1 files=batches.meta" in capsys.readouterr().out
