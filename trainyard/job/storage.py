"""Object-storage primitives on `s3://` and `file://` URIs, shared by the SDK and the driver.

boto3 resolves the endpoint the usual way: `AWS_ENDPOINT_URL` (set for local jobs on the embedded
store) or real S3. Transfers use boto3's managed transfer (multipart and retries built in). The client is
boto3's default one unless a call is given `s3=` (the SDK passes the user's session's, `s3_client(session)`).
"""
from __future__ import annotations

import os
import shutil
from functools import cache
from typing import Callable

from trainyard.job.uris import join, split_s3


def _config(endpoint: str | None):
    from botocore.config import Config

    # "standard" retry mode retries throttling, 5xx and dropped connections with backoff
    return Config(retries={"max_attempts": 8, "mode": "standard"}, s3={"addressing_style": "path"} if endpoint else {})


@cache
def _s3(endpoint: str | None, key_id: str | None):
    import boto3

    # keys in the environment are passed as they are now: boto3's default session keeps the first credentials
    # it resolved, and a process that used it before (with AWS keys) would sign the store's requests with those
    keys = {"aws_access_key_id": key_id, "aws_secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY"),
            "aws_session_token": os.environ.get("AWS_SESSION_TOKEN")} if key_id else {}
    return boto3.client("s3", endpoint_url=endpoint, config=_config(endpoint), **keys)


def s3_client(session=None):
    """An S3 client on AWS_ENDPOINT_URL (or real S3): boto3's default one, or one of the boto3 `session`
    (its credentials and region). The default one is made once per endpoint and access key (another store on a
    reused port, or another key, gets its own)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or None
    if session is None:
        return _s3(endpoint, os.environ.get("AWS_ACCESS_KEY_ID"))
    return session.client("s3", endpoint_url=endpoint, config=_config(endpoint))


def _local(uri: str) -> str:
    return uri[len("file://") :]


def put_bytes(uri: str, data: bytes, content_type: str = "application/octet-stream") -> None:
    """Write `data` as one object (`s3://`), or as a file that appears whole (`file://`: written beside it,
    then renamed)."""
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        s3_client().put_object(Bucket=bucket, Key=key, Body=data, ContentType=content_type)
    else:
        path = _local(uri)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".partial", "wb") as fh:
            fh.write(data)
        os.replace(path + ".partial", path)


def put_file(local_path: str, uri: str, s3=None, progress: Callable[[int], None] | None = None) -> None:
    """Copy a file to `uri`; `s3`: the client for an `s3://` URI (default: `s3_client()`); `progress` is
    called with the bytes sent since its last call."""
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        (s3 or s3_client()).upload_file(local_path, bucket, key, Callback=progress)
    else:
        dest = _local(uri)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(local_path, dest + ".partial")
        os.replace(dest + ".partial", dest)
        if progress is not None:
            progress(os.path.getsize(dest))


def get_file(uri: str, local_path: str) -> None:
    os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        s3_client().download_file(bucket, key, local_path)
    else:
        shutil.copyfile(_local(uri), local_path)


def get_bytes(uri: str, s3=None) -> bytes:
    """The whole object (`s3://`) or file (`file://`) at `uri`; `s3`: the client (default: `s3_client()`)."""
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        return (s3 or s3_client()).get_object(Bucket=bucket, Key=key)["Body"].read()
    with open(_local(uri), "rb") as fh:
        return fh.read()


def delete(uri: str, s3=None) -> None:
    """Remove one object (`s3://`) or file (`file://`); a missing one is not an error."""
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        (s3 or s3_client()).delete_object(Bucket=bucket, Key=key)
    else:
        try:
            os.remove(_local(uri))
        except FileNotFoundError:
            pass


def exists(uri: str, s3=None) -> bool:
    if uri.startswith("s3://"):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        try:
            (s3 or s3_client()).head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
                return False
            raise
    return os.path.exists(_local(uri))


def list_files(uri: str, s3=None) -> list[tuple[str, str, int]]:
    """Every object under the prefix `uri` as (uri, path relative to the prefix, size), sorted; `s3`: the client
    for an `s3://` URI (default: `s3_client()`).

    A prefix is a folder: `s3://b/data` lists `data/...`, never a sibling `data-old/...`.
    """
    out: list[tuple[str, str, int]] = []
    if uri.startswith("s3://"):
        s3 = s3 or s3_client()
        bucket, key = split_s3(uri)
        prefix = key.rstrip("/") + "/" if key else ""
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
                if rel and not rel.endswith("/"):
                    out.append((f"s3://{bucket}/{obj['Key']}", rel, obj["Size"]))
        if not out and key and exists(uri, s3=s3):  # the URI names one object
            size = s3.head_object(Bucket=bucket, Key=key)["ContentLength"]
            out.append((uri, os.path.basename(key), size))
    else:
        path = _local(uri)
        if os.path.isfile(path):
            return [(uri, os.path.basename(path), os.path.getsize(path))]
        for dirpath, _, names in os.walk(path):
            for n in names:
                full = os.path.join(dirpath, n)
                out.append(("file://" + full, os.path.relpath(full, path), os.path.getsize(full)))
    return sorted(out, key=lambda t: t[1])


def shard(files: list, host_index: int, host_count: int, distribution: str) -> list:
    """The objects of a channel (`list_files` order) that one host gets: all, or with ShardedByS3Key every
    N-th in key order. Shared by the local backend's supervisor and the EC2 node agent."""
    return files[host_index::host_count] if distribution == "ShardedByS3Key" else list(files)


class UnsafeKey(ValueError):
    """An object key that would be written outside the folder it is downloaded into."""


def inside(dest: str, rel: str) -> str:
    """`dest/rel` for an object's path `rel` relative to its prefix, refused (UnsafeKey, naming it) when it
    could land outside `dest`: an absolute path, an empty part (`a//b`), a `.` or `..` part, a NUL, or a part
    that is a symbolic link in `dest` leading elsewhere. The one join every download uses."""
    parts = rel.split("/")
    if not rel or "\x00" in rel or any(p in ("", ".", "..") for p in parts) or \
            (os.sep != "/" and os.sep in rel):
        raise UnsafeKey(f"the object key part {rel!r} would be written outside {dest} ('..', '.', '//' or an "
                        "absolute path); rename the object (nothing was downloaded)")
    path = os.path.join(dest, *parts)
    top = os.path.realpath(dest)
    if not os.path.realpath(path).startswith(top.rstrip(os.sep) + os.sep):
        raise UnsafeKey(f"the object key part {rel!r} leads outside {dest} through a symbolic link; nothing was "
                        "downloaded")
    return path


def download_tree(uri: str, dest: str, files: list[tuple[str, str, int]] | None = None) -> int:
    """Copy the objects under `uri` (or the given subset of `list_files(uri)`) into `dest`; returns bytes. Every
    key is checked (`inside`, and no key is a folder of another) before anything is written, and every write is
    made through folder descriptors that follow no symbolic link (`_write_inside`): a link planted in `dest`
    while the download runs cannot lead a write out of it."""
    files = files if files is not None else list_files(uri)
    for _, rel, _ in files:
        inside(dest, rel)
    names = {rel for _, rel, _ in files}
    for rel in names:
        parts = rel.split("/")
        clash = next(("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in names), None)
        if clash is not None:
            raise UnsafeKey(f"the object keys {clash!r} and {rel!r} cannot both be written: {clash!r} would be a file "
                            "and a folder; rename one (nothing was downloaded)")
    os.makedirs(dest, exist_ok=True)
    total = 0
    for obj_uri, rel, size in files:
        _write_inside(obj_uri, dest, rel)
        total += size
    return total


def _write_inside(obj_uri: str, dest: str, rel: str) -> None:
    """The object at `obj_uri` written to `dest/rel`: each folder opened (made when missing) relative to its
    parent's descriptor with O_NOFOLLOW, the file written beside its name and renamed in that folder."""
    parts = rel.split("/")
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            try:
                os.mkdir(part, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                raise UnsafeKey(f"the object key part {rel!r}: {part!r} in {dest} is a symbolic link or not a "
                                "folder; not written") from None
            os.close(fd)
            fd = sub
        name, tmp = parts[-1], f".{parts[-1]}.partial"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666, dir_fd=fd)
        try:
            with os.fdopen(out, "wb") as fh:
                if obj_uri.startswith("s3://"):
                    bucket, key = split_s3(obj_uri)
                    s3_client().download_fileobj(bucket, key, fh)
                else:
                    with open(_local(obj_uri), "rb") as src:
                        shutil.copyfileobj(src, fh)
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)  # over a link, the link itself is replaced
        except BaseException:
            try:
                os.remove(tmp, dir_fd=fd)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


def output_prefix(output_path: str, job_name: str) -> str:
    """Where a job's artifacts go: `<output_path>/<job>/output/` (model.tar.gz, output.tar.gz)."""
    return join(output_path, job_name, "output")
