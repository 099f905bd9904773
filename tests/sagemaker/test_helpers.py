"""(issue 34) The names around the estimator that SageMaker notebooks use: `utils.name_from_base`, long base names
cut as SageMaker cuts them, `exceptions.UnexpectedStatusException`, `trainyard.s3`, `image_uris.retrieve`, a default
`sagemaker_session`, `create_model` before any job. (create_model after a job, the Session's job calls and
S3Downloader on a model artifact: tests/sagemaker/test_job_handle.py, on its job.)"""
import os
import re

import pytest

import trainyard

from .test_session import AWS_VARS

STAMP = r"\d{4}-\d{2}-\d{2}-\d{2}-\d{2}-\d{2}-\d{3}"


def test_name_from_base_cuts_the_base_to_fit_and_base_from_name_undoes_it():
    from trainyard.utils import base_from_name, name_from_base, unique_name_from_base

    assert re.fullmatch(rf"my-experiment-{STAMP}", name_from_base("my-experiment"))
    long = name_from_base("x" * 70)
    assert len(long) == 63 and re.fullmatch(rf"x{{39}}-{STAMP}", long)
    assert len(name_from_base("a" * 50, max_length=30)) == 30
    assert re.fullmatch(r"base-\d{6}-\d{4}", name_from_base("base", short=True))
    assert re.fullmatch(r"base-\d{10}-[0-9a-f]{4}", unique_name_from_base("base"))
    assert len(unique_name_from_base("y" * 80)) == 63
    for made in (name_from_base("my-exp"), name_from_base("my-exp", short=True), unique_name_from_base("my-exp")):
        assert base_from_name(made) == "my-exp", made
    assert base_from_name("no-stamp-here") == "no-stamp-here"
    # a cut never leaves the hyphen before the stamp doubled
    assert "--" not in name_from_base("ab-" + "c" * 60, max_length=27)


def test_a_failed_job_raises_sagemakers_unexpected_status_exception():
    from trainyard.errors import JobFailedError
    from trainyard.exceptions import UnexpectedStatusException

    e = JobFailedError("job-1", "Failed", "AlgorithmError: boom")
    assert isinstance(e, UnexpectedStatusException) and isinstance(e, ValueError) and isinstance(e, RuntimeError)
    assert e.actual_status == "Failed" and e.allowed_statuses == ["Completed", "Stopped"]
    assert str(e) == "training job job-1 Failed: AlgorithmError: boom"


def test_s3_uploader_and_downloader_round_trip_on_the_embedded_store(tmp_path, monkeypatch):
    for var in AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    from trainyard import Session
    from trainyard.s3 import S3Downloader, S3Uploader, parse_s3_url, s3_path_join

    bucket = Session().default_bucket()
    base = s3_path_join(f"s3://{bucket}/", "/helpers/", "run-1")
    assert base == f"s3://{bucket}/helpers/run-1" and parse_s3_url(base) == (bucket, "helpers/run-1")
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("a")
    (tmp_path / "d" / "sub" / "b.txt").write_text("b")
    assert S3Uploader.upload(str(tmp_path / "d"), base) == base
    assert S3Uploader.upload_string_as_file_body("hello", f"{base}/s.txt") == f"{base}/s.txt"
    assert sorted(S3Downloader.list(base)) == [f"{base}/a.txt", f"{base}/s.txt", f"{base}/sub/b.txt"]
    assert S3Downloader.read_file(f"{base}/s.txt") == "hello"
    got = S3Downloader.download(base, str(tmp_path / "back"))
    assert sorted(p.removeprefix(str(tmp_path / "back")) for p in got) == ["/a.txt", "/s.txt", "/sub/b.txt"]
    assert (tmp_path / "back" / "sub" / "b.txt").read_text() == "b"
    with pytest.raises(ValueError, match="expecting an s3:// URL"):
        S3Downloader.list("/local/path")


def test_image_uris_retrieve_gives_the_trainyard_image_and_refuses_what_it_is_not():
    from trainyard.errors import ConfigError
    from trainyard.image_uris import retrieve
    from trainyard.sdk.image import image_tag

    root = os.path.dirname(os.path.dirname(os.path.abspath(trainyard.__file__)))
    assert retrieve("pytorch", region="us-east-1", version="2.5", py_version="py311",
                    instance_type="ml.g5.xlarge") == f"trainyard:{image_tag(root)}"
    assert retrieve("huggingface", image_scope="training") == f"trainyard:{image_tag(root)}"
    with pytest.raises(ConfigError, match="image_scope.*does not host endpoints"):
        retrieve("pytorch", image_scope="inference")
    with pytest.raises(ConfigError, match="framework.*'xgboost'"):
        retrieve("xgboost")


def test_estimator_defaults_a_session_cuts_long_base_names_and_create_model_needs_a_job(tmp_path):
    from trainyard import Estimator, LocalSession

    (tmp_path / "train.py").write_text("print('hi')\n")
    est = Estimator(entry_point="train.py", source_dir=str(tmp_path), instance_type="local",
                    base_job_name="a-very-long-base-job-name-from-a-notebook-cell-x")
    assert isinstance(est.sagemaker_session, LocalSession)
    name = est._job_spec(None, None).job_name
    assert len(name) <= 63 and name.startswith("a-very-long-base-job-name-from-a-notebook-c-"), name
    with pytest.raises(ValueError, match="no training job yet"):
        est.create_model()


def test_code_goes_beside_the_job_and_never_into_a_data_prefix(tmp_path):
    """SageMaker stages code at `<bucket>/<job>/source/`; a channel whose prefix would hold it is refused before
    anything is written (it used to land in channels whose prefix held `output_path`)."""
    from trainyard import Estimator
    from trainyard.errors import ConfigError
    from trainyard.sdk.estimator import code_prefix

    (tmp_path / "train.py").write_text("print('hi')\n")
    est = Estimator(entry_point="train.py", source_dir=str(tmp_path), instance_type="local",
                    output_path="s3://bkt/outputs/run")
    spec = est._job_spec({"train": "s3://bkt/outputs/"}, "job-1")
    assert code_prefix(spec, None) == "s3://bkt/job-1/source"
    assert code_prefix(spec, "s3://code-bkt/x") == "s3://code-bkt/x/job-1/source"
    for channel in ("s3://bkt/", "s3://bkt/jo"):
        with pytest.raises(ConfigError, match=rf"code_location.*inside channel 'train' \({channel}\)"):
            code_prefix(est._job_spec({"train": channel}, "job-1"), None)
    assert code_prefix(est._job_spec({"train": "s3://bkt/"}, "job-1"), "s3://other/") == "s3://other/job-1/source"


def test_source_dir_as_an_s3_tarball_as_jumpstart_passes_it(tmp_path):
    """(issue 34) `source_dir="s3://.../sourcedir.tar.gz"` was refused; it is read, extracted as a host extracts code,
    and packaged like a folder (the entry point checked inside it)."""
    import io
    import tarfile

    from trainyard import Estimator, Session
    from trainyard.errors import ConfigError

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in (("train.py", "print('hi')\n"), ("lib/util.py", "X = 1\n")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    (tmp_path / "sourcedir.tar.gz").write_bytes(buf.getvalue())
    uri = Session().upload_data(str(tmp_path / "sourcedir.tar.gz"), key_prefix="jumpstart/code")
    est = Estimator(entry_point="train.py", source_dir=uri, instance_type="local")
    assert sorted(est._package().files) == ["lib/util.py", "train.py"]
    with pytest.raises(ConfigError, match="entry_point: 'missing.py' is not a file in source_dir"):
        Estimator(entry_point="missing.py", source_dir=uri, instance_type="local")
    with pytest.raises(ConfigError, match=r"source_dir: .*could not be read"):
        Estimator(entry_point="train.py", source_dir=uri.replace("sourcedir", "nothere"), instance_type="local")
    with pytest.raises(ConfigError, match=r"source_dir: .*an s3:// source_dir is the code as a \.tar\.gz"):
        Estimator(entry_point="train.py", source_dir=uri.rsplit("/", 1)[0], instance_type="local")
