"""(8) metric_definitions: the Hugging Face SageMaker metrics notebook (huggingface/notebooks
sagemaker/06_sagemaker_metrics): the same metric_definitions regexes (two groups each: the value is group 1,
as in SageMaker), plus {"Name": "train:loss", "Regex": "loss: ([0-9\\.]+)"} from SageMaker's docs;
then describe()["FinalMetricDataList"], TrainingJobAnalytics(...).dataframe() (pandas is a dependency: the
same rows as rows()), estimator.training_job_analytics, and latest_training_job.metrics().
"""
import os

import pytest

from tests.container.wheels import make_wheel

from .helpers import MAX_RUN, LOCAL_ROLE, copy_scripts, read_tar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LOSS = [0.5, 0.3333, 0.25]
EVAL_LOSS = [0.5, 0.4, 0.3]


def _table(analytics) -> list[dict]:
    """(timestamp, metric_name, value) rows: dataframe() as SageMaker users call it, the same as rows()."""
    rows = analytics.dataframe().to_dict("records")
    assert rows == analytics.rows()
    return rows


def _values(rows, name) -> list[float]:
    return [r["value"] for r in rows if r["metric_name"] == name]


def _job_metric_values(rows, name) -> list[float]:
    """latest_training_job.metrics(): whichever row shape, the values recorded for `name`, in order."""
    out = []
    for r in rows:
        if r.get("metric_name") == name or r.get("MetricName") == name:
            out.append(float(r.get("value", r.get("Value"))))
        elif name in r:
            out.append(float(r[name]))
    return out


def test_metric_definitions_hf_notebook(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    copy_scripts(tmp_path / "scripts", "hf/train.py")
    # transformers_version="4.26" beside transformers 5: the job's overlay installs 4.26, here offline from a
    # wheel of that name (the notebook's script does not import it); pip finds what this process's variables say
    wheelhouse = tmp_path / "wheelhouse"
    make_wheel(str(wheelhouse), name="transformers", version="4.26.1")
    for name, value in {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(wheelhouse),
                        "TRAINYARD_REQUIREMENTS_CACHE": str(tmp_path / "overlays")}.items():
        monkeypatch.setenv(name, value)
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        (tmp_path / split / "dataset.arrow").write_text(f"{split} rows")

    import trainyard
    from trainyard.analytics import TrainingJobAnalytics
    from trainyard.huggingface import HuggingFace

    sess = trainyard.Session()
    s3_prefix = "samples/datasets/imdb"
    training_input_path = sess.upload_data("train", key_prefix=f"{s3_prefix}/train")
    test_input_path = sess.upload_data("test", key_prefix=f"{s3_prefix}/test")
    assert training_input_path == f"s3://{sess.default_bucket()}/{s3_prefix}/train"

    # hyperparameters, which will be passed into the training job
    hyperparameters = {
        "epochs": 3,
        "train_batch_size": 32,
        "model_name": "distilbert-base-uncased"}

    metric_definitions = [
        {"Name": "loss", "Regex": "'loss': ([0-9]+(.|e\\-)[0-9]+),?"},
        {"Name": "learning_rate", "Regex": "'learning_rate': ([0-9]+(.|e\\-)[0-9]+),?"},
        {"Name": "eval_loss", "Regex": "'eval_loss': ([0-9]+(.|e\\-)[0-9]+),?"},
        {"Name": "eval_accuracy", "Regex": "'eval_accuracy': ([0-9]+(.|e\\-)[0-9]+),?"},
        {"Name": "epoch", "Regex": "'epoch': ([0-9]+(.|e\\-)[0-9]+),?"},
        {"Name": "train:loss", "Regex": "loss: ([0-9\\.]+)"}]

    huggingface_estimator = HuggingFace(
        entry_point="train.py",
        source_dir="./scripts",
        instance_type="local",
        instance_count=1,
        transformers_version="4.26",
        pytorch_version="1.13",
        py_version="py39",
        role=LOCAL_ROLE,
        hyperparameters=hyperparameters,
        metric_definitions=metric_definitions,
        enable_sagemaker_metrics=True,
        max_run=MAX_RUN)

    # starting the train job with our uploaded datasets as input
    huggingface_estimator.fit({"train": training_input_path, "test": test_input_path})

    job = huggingface_estimator.latest_training_job
    assert "installed 1 package(s) into" in job.log_text() and "(transformers==4.26.1)" in job.log_text()
    final = {m["MetricName"]: m["Value"] for m in job.describe()["FinalMetricDataList"]}
    expected_final = {"loss": 0.25, "train:loss": 0.25, "eval_loss": 0.3, "eval_accuracy": 0.9, "epoch": 3.0}
    for name, value in expected_final.items():
        assert final.get(name) == pytest.approx(value), (name, final)

    # Captured metrics can be accessed as a Pandas dataframe
    rows = _table(TrainingJobAnalytics(training_job_name=huggingface_estimator.latest_training_job.name))
    assert _values(rows, "train:loss") == pytest.approx(LOSS)
    assert _values(rows, "loss") == pytest.approx(LOSS)
    assert _values(rows, "eval_loss") == pytest.approx(EVAL_LOSS)
    assert _values(rows, "epoch") == pytest.approx([1.0, 1.0, 2.0, 2.0, 3.0, 3.0])
    stamps = [r["timestamp"] for r in rows if r["metric_name"] == "train:loss"]
    assert stamps == sorted(stamps)

    only = _table(TrainingJobAnalytics(training_job_name=job.name, metric_names=["train:loss"]))
    assert {r["metric_name"] for r in only} == {"train:loss"} and len(only) == 3
    assert _values(_table(huggingface_estimator.training_job_analytics), "train:loss") == pytest.approx(LOSS)

    assert _job_metric_values(job.metrics(), "train:loss") == pytest.approx(LOSS)

    # the script's model and output data, where SageMaker puts them
    assert "pytorch_model.bin" in read_tar(huggingface_estimator.model_data)
    output = read_tar(huggingface_estimator.model_data.replace("model.tar.gz", "output.tar.gz"))
    assert output["eval_results.txt"].decode().startswith("epoch = 3.0\neval_accuracy = 0.9\neval_loss = 0.3")
