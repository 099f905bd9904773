"""The embedded object store: shared by processes, persistent across restarts, buckets made by writes (and
by fit() after its checks), never by reads."""
import subprocess
import sys

import boto3
import pytest

from trainyard.sdk import store
from tests.waiting import within


def _client(url):
    """A client on the store at `url` with this user's key."""
    ep = store.Endpoint(url, embedded=True)
    return ep.client()


@pytest.fixture
def own_home(tmp_path, monkeypatch):
    """A home of its own, so restarting the store does not disturb the session's."""
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))
    yield tmp_path
    store.stop_store()


def test_configured_endpoint_is_used_as_is(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    ep = store.ensure_store()
    assert ep.url == "http://127.0.0.1:9" and not ep.embedded and ep.env() == {}


def test_shared_between_processes_and_persistent(own_home):
    ep = store.ensure_store()
    assert ep.embedded and ep.url.startswith("http://127.0.0.1:")
    s3 = _client(ep.url)
    assert "trainyard-default" in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    s3.put_object(Bucket="made-on-first-use", Key="a/b.txt", Body=b"hello")
    big = bytes(range(256)) * (40 * 1024)  # 10 MiB: goes through multipart with boto3's transfer
    import io

    s3.upload_fileobj(io.BytesIO(big), "made-on-first-use", "big.bin",
                      Config=boto3.s3.transfer.TransferConfig(multipart_threshold=5 * 2**20))
    # another process finds the same server
    code = "from trainyard.sdk.store import ensure_store; print(ensure_store().url)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ})
    assert other.stdout.strip() == ep.url
    # a restart keeps the objects; deletes persist too
    s3.put_object(Bucket="made-on-first-use", Key="gone.txt", Body=b"x")
    s3.delete_object(Bucket="made-on-first-use", Key="gone.txt")
    assert store.stop_store()
    ep2 = store.ensure_store()
    s3 = _client(ep2.url)
    assert s3.get_object(Bucket="made-on-first-use", Key="a/b.txt")["Body"].read() == b"hello"
    assert s3.get_object(Bucket="made-on-first-use", Key="big.bin")["Body"].read() == big
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="made-on-first-use")["Contents"]]
    assert sorted(keys) == ["a/b.txt", "big.bin"]


def test_deleted_and_overwritten_objects_free_their_disk(own_home):
    import os

    s3 = _client(store.ensure_store().url)
    blobs = own_home / "store" / "objects"

    def stored() -> int:
        return len([n for n in os.listdir(blobs) if not n.endswith(".tmp")])

    s3.put_object(Bucket="scratch", Key="a", Body=b"one")
    s3.put_object(Bucket="keep", Key="same", Body=b"shared")
    s3.put_object(Bucket="scratch", Key="same", Body=b"shared")  # one blob for both objects
    assert stored() == 2
    s3.put_object(Bucket="scratch", Key="a", Body=b"two")  # overwritten: the old bytes go
    s3.delete_object(Bucket="scratch", Key="a")
    s3.delete_object(Bucket="scratch", Key="same")
    s3.delete_bucket(Bucket="scratch")
    within(lambda: stored() == 1, 10, interval=0.05)
    assert stored() == 1  # what "keep" still holds
    assert s3.get_object(Bucket="keep", Key="same")["Body"].read() == b"shared"


def _buckets(s3) -> list[str]:
    return sorted(b["Name"] for b in s3.list_buckets()["Buckets"])


def test_reads_of_a_missing_bucket_answer_like_s3_and_create_nothing():
    from botocore.exceptions import ClientError

    s3 = _client(store.ensure_store().url)
    before = _buckets(s3)
    reads = {
        "list": lambda: s3.list_objects_v2(Bucket="never-made"),
        "head bucket": lambda: s3.head_bucket(Bucket="never-made"),
        "get": lambda: s3.get_object(Bucket="never-made", Key="k"),
        "head": lambda: s3.head_object(Bucket="never-made", Key="k"),
        "delete": lambda: s3.delete_object(Bucket="never-made", Key="k"),
    }
    for what, call in reads.items():
        with pytest.raises(ClientError) as e:
            call()
        assert e.value.response["Error"]["Code"] in ("NoSuchBucket", "404"), what
    assert _buckets(s3) == before
    # a write is what creates a bucket: jobs may write to s3://any-new-bucket/...
    s3.put_object(Bucket="made-by-a-write", Key="k", Body=b"x")
    assert _buckets(s3) == sorted(before + ["made-by-a-write"])


def test_a_refused_fit_creates_no_bucket(src):
    from trainyard import Estimator
    from trainyard.errors import ConfigError

    s3 = _client(store.ensure_store().url)
    s3.put_object(Bucket="refused-fit-data", Key="train/a.txt", Body=b"1")
    before = _buckets(s3)
    est = Estimator(entry_point="train.py", source_dir=src, output_path="s3://refused-fit-out/o",
                    checkpoint_s3_uri="s3://refused-fit-ckpt/c")
    with pytest.raises(ConfigError, match="inputs.train: bucket 'no-such-bucket' of s3://no-such-bucket/data does "
                                          "not exist"):
        est.fit({"train": "s3://no-such-bucket/data"}, wait=False)
    # refused after S3 reads: channel a is listed, then b is empty
    with pytest.raises(ConfigError, match="inputs.b: nothing found"):
        est.fit({"a": "s3://refused-fit-data/train", "b": "s3://refused-fit-data/empty"}, wait=False)
    # bad arguments
    with pytest.raises(ConfigError, match="^job_name:"):
        est.fit("s3://refused-fit-data/train", wait=False, job_name="bad_name")
    with pytest.raises(ConfigError, match="^logs:"):
        est.fit("s3://refused-fit-data/train", wait=False, logs="verbose")
    assert _buckets(s3) == before


def test_launch_creates_the_buckets_the_job_writes_on_the_embedded_store_only(src, monkeypatch, s3_bucket):
    from trainyard import Estimator
    from trainyard.sdk.backends.local import backend as local

    monkeypatch.setattr(local, "launch", lambda spec, endpoint: spec)  # everything but starting the job
    est = Estimator(entry_point="trainyard.engine.train", output_path="s3://launch-out/o",
                    checkpoint_s3_uri="s3://launch-ckpt/c",
                    hyperparameters={"model": "tiny", "checkpoint_uri": "s3://launch-hp/x"})
    spec = est._job_spec(None, "launch-buckets-1")
    assert local.written_buckets(spec) == ["launch-out", "launch-ckpt", "launch-hp"]
    # a configured endpoint (here a moto server: s3_bucket sets AWS_ENDPOINT_URL): nothing is created there
    configured = _client(__import__("os").environ["AWS_ENDPOINT_URL"])
    there = _buckets(configured)
    on_it = Estimator(entry_point="trainyard.engine.train", output_path=f"s3://{s3_bucket}/o",
                      checkpoint_s3_uri=f"s3://{s3_bucket}/c", hyperparameters={"model": "tiny"})
    backend = local.LocalBackend()
    one = on_it._job_spec(None, "launch-buckets-2")
    backend.launch(one, backend.plan(one), upload_code=lambda s: None)
    with pytest.raises(local.ConfigError, match="output_path: bucket 'launch-out'"):
        backend.plan(spec)
    assert _buckets(configured) == there
    # the embedded store: created after the checks, once (a second launch finds them)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    embedded = _client(store.ensure_store().url)
    backend = local.LocalBackend()
    for _ in range(2):
        backend.launch(spec, backend.plan(spec), upload_code=lambda s: None)
    assert {"launch-out", "launch-ckpt", "launch-hp"} <= set(_buckets(embedded))
