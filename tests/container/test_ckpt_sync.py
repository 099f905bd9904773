"""SageMaker's checkpoint folder contract: restore before the script, sync during and after it."""
import os

import boto3

from trainyard.container.ckpt_sync import CheckpointSync


def _keys(bucket: str, prefix: str) -> dict[str, bytes]:
    s3 = boto3.client("s3")
    out = {}
    for obj in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        out[obj["Key"]] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def test_restore_reads_the_prefix_as_a_folder_and_does_not_upload_it_again(s3_bucket, tmp_path):
    s3 = boto3.client("s3")
    s3.put_object(Bucket=s3_bucket, Key="ckpt/epoch-1.pt", Body=b"one")
    s3.put_object(Bucket=s3_bucket, Key="ckpt/sub/state.json", Body=b"{}")
    s3.put_object(Bucket=s3_bucket, Key="ckpt-old/stale.pt", Body=b"a sibling prefix: never restored")
    local = tmp_path / "checkpoints"
    sync = CheckpointSync(str(local), f"s3://{s3_bucket}/ckpt/", interval=3600)  # trailing slash on purpose
    assert sync.restore() == 2
    assert sorted(os.listdir(local)) == ["epoch-1.pt", "sub"] and (local / "epoch-1.pt").read_bytes() == b"one"
    assert sync.sync(final=True) == 0  # what was restored is already in the store


def test_sync_uploads_stable_files_and_changes_and_a_last_time_at_stop(s3_bucket, tmp_path):
    local = tmp_path / "checkpoints"
    local.mkdir()
    sync = CheckpointSync(str(local), f"s3://{s3_bucket}/run/ckpt", interval=3600)
    (local / "a.pt").write_bytes(b"v1")
    assert sync.sync(final=False) == 0  # seen once: it may still be being written
    assert sync.sync(final=False) == 1  # unchanged since the last scan: uploaded
    assert sync.sync(final=False) == 0  # and not again
    (local / "a.pt").write_bytes(b"v2 longer")
    (local / "nested").mkdir()
    (local / "nested" / "b.pt").write_bytes(b"b")
    sync.sync(final=False)
    assert sync.sync(final=False) == 2
    (local / "c.pt").write_bytes(b"written just before the end")
    assert sync.stop() == {}
    assert _keys(s3_bucket, "run/ckpt/") == {"run/ckpt/a.pt": b"v2 longer", "run/ckpt/nested/b.pt": b"b",
                                             "run/ckpt/c.pt": b"written just before the end"}
    assert sync.files_uploaded == 4


def test_failed_uploads_are_reported_and_retried(s3_bucket, tmp_path, monkeypatch):
    from trainyard.job import storage

    local = tmp_path / "checkpoints"
    local.mkdir()
    (local / "a.pt").write_bytes(b"x")
    said: list[str] = []
    sync = CheckpointSync(str(local), f"s3://{s3_bucket}/ckpt", interval=3600, say=said.append)
    real_put = storage.put_file

    def broken(path, uri):
        raise ConnectionError("connection reset")

    monkeypatch.setattr(storage, "put_file", broken)
    sync.sync(final=False)
    assert sync.sync(final=False) == 0 and sync.failures == {"a.pt": "connection reset"}
    sync.sync(final=False)
    assert len(said) == 1 and "a.pt" in said[0] and "will retry" in said[0]  # reported once, not per scan
    monkeypatch.setattr(storage, "put_file", real_put)
    assert sync.sync(final=False) == 1 and sync.failures == {}
    assert _keys(s3_bucket, "ckpt/") == {"ckpt/a.pt": b"x"}
    monkeypatch.setattr(storage, "put_file", broken)
    (local / "b.pt").write_bytes(b"y")
    assert sync.stop() == {"b.pt": "connection reset"}  # what could not be saved is returned, not dropped
