"""`trainyard store [ls | put | get | rm | creds]`: the object store local jobs use, from the shell.

The store is `ensure_store()`'s: `AWS_ENDPOINT_URL` when it is set, else the embedded store (started if
needed). Every call goes through `trainyard.job.storage` with the endpoint's variables set for this
process only (`storage_env`), so `s3://` means here what it means to a local job. A URI names a folder
(`s3://b/data` is `data/...`, never `data-old/...`) or one object, as for job channels.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from contextlib import contextmanager

from trainyard.job import storage
from trainyard.errors import ConfigError
from trainyard.job.uris import check_s3_uri, join, split_s3
from trainyard.sdk.jobs.format import human_size, print_table
from trainyard.sdk.backends.local.backend import storage_env
from trainyard.sdk.store import IDLE_TIMEOUT_S, Endpoint, ensure_store, healthy, stop_store, store_root

CREDENTIAL_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys


def store_command(a) -> int:
    """Dispatch `trainyard store ...` (an argparse Namespace)."""
    if a.store_cmd is None:
        if a.stop:
            print("stopped" if stop_store() else "not running")
        else:
            ep = ensure_store()
            print(f"{ep.url}\t{'embedded, objects under ' + store_root() if ep.embedded else 'AWS_ENDPOINT_URL'}")
            if ep.embedded:
                print('boto3, the AWS CLI and s3fs reach it with its keys: eval "$(trainyard store creds)"',
                      file=sys.stderr)
        return 0
    if a.store_cmd == "creds":
        return creds(a.json)
    ep = ensure_store()
    with storage_env(ep.env()):
        if a.store_cmd == "ls":
            return ls(ep, a.uri)
        if a.store_cmd == "put":
            return put(ep, a.local, a.uri)
        if a.store_cmd == "get":
            return get(ep, a.uri, a.local)
        return rm(ep, a.uri, a.recursive)


@contextmanager
def _s3_errors(field: str, uri: str):
    """botocore's errors (no such key, denied, no connection) as a one-line ConfigError on `field`."""
    try:
        yield
    except Exception as e:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code, message = err.get("Code", "?"), err.get("Message", "")
            if code in ("404", "NoSuchKey", "NotFound"):
                raise ConfigError(field, f"{uri}: no such key") from None
            if code == "NoSuchBucket":
                raise ConfigError(field, f"{uri}: no such bucket {split_s3(uri)[0]!r}") from None
            raise ConfigError(field, f"{uri}: {code}" + (f": {message}" if message else "")) from None
        if isinstance(e, BotoCoreError):
            raise ConfigError(field, f"{uri}: {e}") from None
        raise


def _buckets(ep: Endpoint) -> list[dict]:
    with _s3_errors("S3_URI", ep.url or "s3://"):
        return storage.s3_client().list_buckets().get("Buckets", [])


def _require_bucket(ep: Endpoint, field: str, uri: str, *, create: bool = False) -> tuple[str, str]:
    """(bucket, key) of `uri`, whose bucket must exist (with `create`, the embedded store makes it).

    Existence is read from ListBuckets, which works the same on any endpoint (a HEAD of a missing bucket
    answers a bare 404)."""
    check_s3_uri(field, uri)
    bucket, key = split_s3(uri)
    if bucket not in {b["Name"] for b in _buckets(ep)}:
        # AWS_ENDPOINT_URL may be the embedded store itself (`eval "$(trainyard store creds)"`)
        if not (create and (ep.embedded or healthy(ep.url))):
            raise ConfigError(field, f"{uri}: no such bucket {bucket!r} (`trainyard store ls` lists the buckets)")
        with _s3_errors(field, uri):
            storage.s3_client().create_bucket(Bucket=bucket)
    return bucket, key


def ls(ep: Endpoint, uri: str | None) -> int:
    """The buckets, or the objects under `uri` (one object: that object)."""
    if uri is None:
        rows = [[b["Name"], b["CreationDate"].astimezone().strftime("%Y-%m-%d %H:%M:%S") if b.get("CreationDate")
                 else ""] for b in _buckets(ep)]
        if not rows:
            print(f"no buckets at {ep.url}")
            return 0
        print_table(["bucket", "created"], sorted(rows))
        return 0
    bucket, key = _require_bucket(ep, "S3_URI", uri)
    with _s3_errors("S3_URI", uri):
        files = storage.list_files(uri)
    if not files:
        if key:
            raise ConfigError("S3_URI", f"{uri}: no such key or prefix")
        print(f"bucket {bucket} is empty")
        return 0
    print_table(["key", "size"], [[obj[len(f"s3://{bucket}/"):], human_size(size)] for obj, _, size in files],
                right=("size",))
    return 0


def put(ep: Endpoint, local: str, uri: str) -> int:
    """A file to `uri` (a key; a prefix when it ends with `/` or names only the bucket), or a folder's files
    under the prefix `uri`, recursively."""
    if not os.path.exists(local):
        raise ConfigError("LOCAL", f"{local}: no such file or folder")
    check_s3_uri("S3_URI", uri)
    if os.path.isdir(local):
        files = sorted(os.path.relpath(os.path.join(d, n), local) for d, _, names in os.walk(local) for n in names)
        if not files:
            print(f"nothing to upload: {local} holds no files")
            return 0
        pairs = [(os.path.join(local, rel), join(uri, rel.replace(os.sep, "/"))) for rel in files]
    else:
        key = split_s3(uri)[1]
        pairs = [(local, join(uri, os.path.basename(local)) if not key or uri.endswith("/") else uri)]
    _require_bucket(ep, "S3_URI", uri, create=True)
    total = 0
    for path, dest in pairs:
        with _s3_errors("S3_URI", dest):
            storage.put_file(path, dest)
        total += os.path.getsize(path)
        if len(pairs) == 1:
            print(f"{path} -> {dest}")
    if len(pairs) > 1:
        print(f"{len(pairs)} files ({human_size(total)}) -> {uri.rstrip('/')}/")
    return 0


def get(ep: Endpoint, uri: str, local: str) -> int:
    """One object to `local` (into it when it is a folder or ends with `/`), or the objects under the prefix
    `uri` into the folder `local`."""
    _require_bucket(ep, "S3_URI", uri)
    with _s3_errors("S3_URI", uri):
        files = storage.list_files(uri)
    if not files:
        raise ConfigError("S3_URI", f"{uri}: no such key or prefix")
    if len(files) == 1 and files[0][0] == uri:  # the URI names one object
        dest = os.path.join(local, files[0][1]) if os.path.isdir(local) or local.endswith(os.sep) else local
        with _s3_errors("S3_URI", uri):
            storage.get_file(uri, dest)
        print(f"{uri} -> {dest}")
        return 0
    with _s3_errors("S3_URI", uri):
        try:  # a key such as `a/../../x` must not write outside LOCAL (storage.inside)
            total = storage.download_tree(uri, local, files)
        except storage.UnsafeKey as e:
            raise ConfigError("S3_URI", f"{uri}: {e}") from None
    print(f"{len(files)} objects ({human_size(total)}) -> {local}")
    return 0


def rm(ep: Endpoint, uri: str, recursive: bool = False) -> int:
    """One object; with `recursive`, every object under the prefix (a bucket: its objects, then the bucket)."""
    bucket, key = _require_bucket(ep, "S3_URI", uri)
    s3 = storage.s3_client()
    with _s3_errors("S3_URI", uri):
        if key and not recursive:
            if not storage.exists(uri):
                n = len(storage.list_files(uri))
                if n:
                    raise ConfigError("S3_URI", f"{uri} is a prefix of {n} object(s): pass --recursive to delete them")
                raise ConfigError("S3_URI", f"{uri}: no such key")
            s3.delete_object(Bucket=bucket, Key=key)
            print(f"deleted {uri}")
            return 0
        keys = [obj[len(f"s3://{bucket}/"):] for obj, _, _ in storage.list_files(uri)]
        if key and key not in keys and storage.exists(uri):
            keys.append(key)  # the object at the prefix's own name goes too
        if not key and keys and not recursive:
            raise ConfigError("S3_URI", f"bucket {bucket} holds {len(keys)} object(s): pass --recursive to delete "
                                        "them and the bucket")
        if key and not keys:
            raise ConfigError("S3_URI", f"{uri}: no such key or prefix")
        for i in range(0, len(keys), DELETE_BATCH):
            s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + DELETE_BATCH]],
                                                     "Quiet": True})
        if not key:
            s3.delete_bucket(Bucket=bucket)
    if key:
        print(f"deleted {len(keys)} object(s) under {uri}")
    else:
        print(f"deleted {len(keys)} object(s) and the bucket {bucket}")
    return 0


def creds(as_json: bool = False) -> int:
    """The variables that point boto3, the AWS CLI and s3fs in a shell at the embedded store."""
    configured = os.environ.pop("AWS_ENDPOINT_URL", None)
    try:
        ep = ensure_store()  # the embedded one, whatever AWS_ENDPOINT_URL says
    finally:
        if configured is not None:
            os.environ["AWS_ENDPOINT_URL"] = configured
    env = ep.env()  # the endpoint, LOCAL_CREDENTIALS and the region
    if configured and configured != ep.url:
        print(f"note: AWS_ENDPOINT_URL is set to {configured}: local jobs use that endpoint, not the embedded "
              "store", file=sys.stderr)
    if as_json:
        print(json.dumps({k: env[k] for k in CREDENTIAL_VARS}))
    else:
        for k in CREDENTIAL_VARS:
            print(f"export {k}={shlex.quote(env[k])}")
        print(f"# the address changes when the store restarts (it stops after {IDLE_TIMEOUT_S:g}s without requests): "
              "run this again then", file=sys.stderr)
    return 0
