"""The embedded object store: shared by processes, persistent across restarts, buckets on first use."""
import subprocess
import sys

import boto3
import pytest

from trainyard.sdk import store


def _client(url):
    return boto3.client("s3", endpoint_url=url, aws_access_key_id="x", aws_secret_access_key="x",
                        region_name="us-east-1")


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
    import time

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
    deadline = time.monotonic() + 10
    while stored() != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stored() == 1  # what "keep" still holds
    assert s3.get_object(Bucket="keep", Key="same")["Body"].read() == b"shared"
