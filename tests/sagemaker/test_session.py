"""(3) `sagemaker.Session()` as the notebooks use it: default_bucket(), upload_data(), download_data(),
get_execution_role(); locally, with no AWS credentials at all.

The cells copied are from aws/amazon-sagemaker-examples sagemaker-python-sdk/pytorch_mnist/pytorch_mnist.ipynb
and huggingface/notebooks sagemaker/06_sagemaker_metrics; the expected URIs and paths are what
sagemaker/session.py's upload_data / download_data return and write.
"""
import os


AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
            "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION")


def _files(root) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = open(p).read()
    return out


def _make_data(tmp_path):
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "a.csv").write_text("1,2\n")
    (tmp_path / "data" / "sub" / "b.csv").write_text("3,4\n")
    (tmp_path / "single.txt").write_text("just one file")


def _no_aws(tmp_path, monkeypatch):
    for var in AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    # no instance role: the metadata service is asked, as on a laptop, here on a closed local port (refused at
    # once; it used to be disabled here, which hid that the question itself failed and read as "configured")
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9/")


def _round_trip(tmp_path):
    import trainyard

    sagemaker_session = trainyard.Session()

    bucket = sagemaker_session.default_bucket()
    prefix = "sagemaker/DEMO-pytorch-mnist"

    role = trainyard.get_execution_role()

    assert isinstance(bucket, str) and bucket, bucket
    assert sagemaker_session.default_bucket() == bucket
    assert sagemaker_session.default_bucket_prefix is None
    assert isinstance(role, str) and role.startswith("arn:aws:iam::") and ":role/" in role, role

    inputs = sagemaker_session.upload_data(path="data", bucket=bucket, key_prefix=prefix)
    print("input spec (in this case, just an S3 path): {}".format(inputs))
    assert inputs == f"s3://{bucket}/{prefix}"
    # a single file, with the defaults: the default bucket, key prefix "data"
    assert sagemaker_session.upload_data(path="single.txt") == f"s3://{bucket}/data/single.txt"

    sagemaker_session.download_data(path="back", bucket=bucket, key_prefix=prefix)
    assert _files(tmp_path / "back") == {"a.csv": "1,2\n", os.path.join("sub", "b.csv"): "3,4\n"}
    sagemaker_session.download_data(path="one", bucket=bucket, key_prefix="data/single.txt")
    assert _files(tmp_path / "one") == {"single.txt": "just one file"}

    # huggingface/notebooks: sess = sagemaker.Session(default_bucket=sagemaker_session_bucket)
    sess = trainyard.Session(default_bucket=bucket)
    print(f"sagemaker bucket: {sess.default_bucket()}")
    print(f"sagemaker session region: {sess.boto_region_name}")
    assert sess.default_bucket() == bucket
    assert isinstance(sess.boto_region_name, str) and sess.boto_region_name
    return bucket


def test_session_round_trip_without_aws_credentials(tmp_path, monkeypatch):
    _no_aws(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    _make_data(tmp_path)
    _round_trip(tmp_path)


def test_session_uses_the_configured_endpoint(tmp_path, monkeypatch, s3_endpoint):
    """With AWS_ENDPOINT_URL set (here a moto server), local jobs read s3:// from that endpoint, so the
    Session must upload there too; default_bucket() creates its bucket if missing, as SageMaker's does."""
    import boto3

    monkeypatch.chdir(tmp_path)
    _make_data(tmp_path)
    bucket = _round_trip(tmp_path)
    keys = {o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]}
    assert {"sagemaker/DEMO-pytorch-mnist/a.csv", "sagemaker/DEMO-pytorch-mnist/sub/b.csv",
            "data/single.txt"} <= keys



def test_a_notebooks_own_s3_calls_reach_the_store_when_no_aws_is_configured(tmp_path, monkeypatch):
    """(issue 34) HF notebooks write to S3 themselves (`datasets.save_to_disk('s3://...')`, `boto3.client("s3")`):
    after the Session's first S3 call, this process's plain boto3 and s3fs calls reach the embedded store."""
    import boto3
    import s3fs

    import trainyard

    _no_aws(tmp_path, monkeypatch)
    bucket = trainyard.Session().default_bucket()
    assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:") and os.environ["AWS_ACCESS_KEY_ID"]
    boto3.client("s3").put_object(Bucket=bucket, Key="notebook/own.txt", Body=b"written by the notebook")
    fs = s3fs.S3FileSystem()
    assert fs.cat(f"{bucket}/notebook/own.txt") == b"written by the notebook"
    assert trainyard.Session().read_s3_file(bucket, "notebook/own.txt") == "written by the notebook"


def test_real_aws_credentials_are_never_redirected(tmp_path, monkeypatch):
    import trainyard
    from trainyard.sdk.session import export_store_env

    _no_aws(tmp_path, monkeypatch)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAREALACCOUNT00000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "real-secret")
    assert export_store_env() is False and "AWS_ENDPOINT_URL" not in os.environ
    (tmp_path / "creds").write_text("[default]\naws_access_key_id = AKIAFROMFILE0000000\naws_secret_access_key = x\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "creds"))
    trainyard.Session().default_bucket()  # the embedded store's own calls still work ...
    assert "AWS_ENDPOINT_URL" not in os.environ  # ... and the notebook's S3 stays the real one
