"""The embedded object store: a moto S3 server on 127.0.0.1 whose objects persist on disk.

    python -m trainyard.sdk.store_server --root ~/.trainyard/store [--idle-timeout 3600]

One server per machine, shared by every job and SDK process (see `store.py`, which starts it).
moto keeps objects in memory; this wrapper makes it behave like a store:
- write-through persistence: after every successful mutating request, the touched bucket's objects are
  reconciled with `<root>/objects/` (content-addressed blobs) and `<root>/buckets/<bucket>.json` (the
  index), before the response goes back; a restarted server reloads them;
- a write of an object (PUT, or a multipart upload's POST) to a missing bucket creates the bucket first,
  so jobs and scripts can write to `s3://any-new-bucket/...`; every other request (GET, HEAD, a listing,
  a DELETE) of a missing bucket is answered as S3 answers it (NoSuchBucket) and creates nothing, so a
  check that reads never leaves a bucket behind (the SDK creates the buckets a job writes to, after
  `fit()`'s checks: sdk/backends/local/backend.py);
- `GET /_trainyard/health?nonce=N` answers with the server's pid, its key's id and an HMAC of N under its
  secret, so that a client tells its own store from another user's server on a reused port (the one request
  that needs no key);
- every other request must be signed with the owner's key (`store_auth.py`), for this server's own address
  (a request signed for another port is not replayed here), its signature checked before its body is read:
  any other is answered 403, as S3 answers it (the S3 requests carry their body's hash in a header; the EC2
  and CloudWatch Logs requests the node agent sends do not, and their body, at most 4 MiB, is read to check it); only the owner's requests keep the server from idling out; moto's management API (`/moto-api/`, whose reset wipes the store) is not served, and no
  response carries CORS headers (a web page in a browser cannot use the store);
- the store folder is the owner's alone: the server runs with umask 077 (objects and indexes 0600, folders
  0700) and tightens what an older version left readable;
- it exits after `--idle-timeout` seconds without a request (jobs ping it while they run).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import signal
import sys
import threading
import time
from urllib.parse import parse_qsl
from xml.sax.saxutils import escape

from trainyard.job.jsonio import write_json
from trainyard.sdk.store_auth import (Credentials, NeedsBody, Refused, check_body, credentials, private_folder, proof,
                                      verify)

DEFAULT_BUCKET = "trainyard-default"
HEALTH_PATH = "/_trainyard/health"
REGION = "us-east-1"
MAX_HASHED_BODY = 4 << 20  # CloudWatch Logs' largest batch is 1 MiB; EC2's requests are a few KiB


def _backend():
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    return s3_backends[DEFAULT_ACCOUNT_ID]["global"]


class DiskMirror:
    """Keeps `<root>/buckets/*.json` + `<root>/objects/<sha256>` equal to moto's S3 state."""

    def __init__(self, root: str):
        self.root = root
        self.lock = threading.Lock()
        os.makedirs(f"{root}/buckets", exist_ok=True)
        os.makedirs(f"{root}/objects", exist_ok=True)
        self.index: dict[str, dict[str, dict]] = {}

    def _index_path(self, bucket: str) -> str:
        return f"{self.root}/buckets/{bucket}.json"

    def _write_index(self, bucket: str) -> None:
        write_json(self._index_path(bucket), self.index[bucket])

    def load(self) -> int:
        """Recreate every persisted bucket and object in moto. Returns the object count."""
        be, count = _backend(), 0
        for name in sorted(os.listdir(f"{self.root}/buckets")):
            if not name.endswith(".json"):
                continue
            bucket = name[: -len(".json")]
            with open(f"{self.root}/buckets/{name}") as fh:
                entries = json.load(fh)
            if bucket not in be.buckets:
                be.create_bucket(bucket, REGION)
            for key, meta in entries.items():
                blob = f"{self.root}/objects/{meta['blob']}"
                if not os.path.exists(blob):
                    continue  # lost blob: drop the entry rather than serve garbage
                with open(blob, "rb") as fh:
                    fk = be.put_object(bucket, key, fh.read())
                meta["etag"] = fk.etag
                count += 1
            self.index[bucket] = {k: v for k, v in entries.items() if os.path.exists(f"{self.root}/objects/{v['blob']}")}
            self._write_index(bucket)
        self._collect_garbage()
        return count

    def sync(self, bucket: str) -> None:
        """Reconcile one bucket: write new or changed objects, forget deleted ones."""
        with self.lock:
            be = _backend()
            if bucket not in be.buckets:
                if bucket in self.index:
                    dropped = {m["blob"] for m in self.index.pop(bucket).values()}
                    try:
                        os.remove(self._index_path(bucket))
                    except FileNotFoundError:
                        pass
                    self._drop_unreferenced(dropped)
                return
            old = self.index.get(bucket, {})
            new: dict[str, dict] = {}
            changed = bucket not in self.index
            for key, fk in list(be.buckets[bucket].keys.items()):
                prev = old.get(key)
                if prev is not None and prev["etag"] == fk.etag:
                    new[key] = prev
                    continue
                data = fk.value
                digest = hashlib.sha256(data).hexdigest()
                blob = f"{self.root}/objects/{digest}"
                if not os.path.exists(blob):
                    with open(blob + ".tmp", "wb") as fh:
                        fh.write(data)
                    os.replace(blob + ".tmp", blob)
                new[key] = {"etag": fk.etag, "blob": digest, "size": len(data)}
                changed = True
            changed = changed or len(new) != len(old)
            self.index[bucket] = new
            if changed:
                self._write_index(bucket)
                self._drop_unreferenced({m["blob"] for m in old.values()} - {m["blob"] for m in new.values()})

    def _drop_unreferenced(self, blobs: set[str]) -> None:
        """Delete the blobs of deleted or overwritten objects that no other object shares (the disk
        would otherwise keep every version until the next start)."""
        if not blobs:
            return
        live = {m["blob"] for entries in self.index.values() for m in entries.values()}
        for digest in blobs - live:
            try:
                os.remove(f"{self.root}/objects/{digest}")
            except FileNotFoundError:
                pass

    def _collect_garbage(self) -> None:
        live = {m["blob"] for entries in self.index.values() for m in entries.values()}
        for name in os.listdir(f"{self.root}/objects"):
            if name not in live:
                os.remove(f"{self.root}/objects/{name}")


def _error(start_response, status: str, code: str, message: str):
    """An S3-style XML error response."""
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{escape(message)}</Message>'
            "</Error>").encode()
    start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
    return [body]


def _no_cors(start_response):
    """start_response without moto's CORS headers (it echoes any Origin)."""
    def respond(status, headers, exc_info=None):
        return start_response(status, [(k, v) for k, v in headers if not k.lower().startswith("access-control-")],
                              exc_info)
    return respond


class StoreApp:
    """WSGI middleware around moto: health, the owner's key on every request, bucket creation on an object's
    first write, write-through persistence."""

    MUTATING = ("PUT", "POST", "DELETE")
    WRITES_OBJECT = ("PUT", "POST")  # with a key: PutObject, CopyObject, multipart uploads

    def __init__(self, app, mirror: DiskMirror, root: str, creds: Credentials):
        self.app = app
        self.mirror = mirror
        self.root = root
        self.creds = creds
        self.last_request = time.monotonic()
        self.hosts: tuple[str, ...] = ()
        """The Host headers a request may be signed for: this server's own addresses (set once it listens)."""

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "GET")
        if path == HEALTH_PATH:  # proof of the key for the caller's nonce: whose store this is (store.healthy)
            nonce = dict(parse_qsl(environ.get("QUERY_STRING", ""))).get("nonce", "")[:128]
            body = json.dumps({"pid": os.getpid(), "key": self.creds.access_key_id,
                               "proof": proof(self.creds, nonce) if nonce else ""}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path.startswith("/moto-api"):
            return _error(start_response, "404 Not Found", "NotFound", "moto's management API is not served here")
        if method == "OPTIONS":
            return _error(start_response, "403 Forbidden", "AccessDenied", "no cross-origin requests")
        from werkzeug.wsgi import get_input_stream

        try:  # the signature first: a request without the key is refused before its body is read
            try:
                signed_hash = verify(environ, None, self.creds, hosts=self.hosts)
                payload = get_input_stream(environ).read()
            except NeedsBody:  # EC2's and CloudWatch Logs' requests: a signature over a small body's hash
                if int(environ.get("CONTENT_LENGTH") or 0) > MAX_HASHED_BODY:
                    raise Refused("AccessDenied", f"a request without x-amz-content-sha256 may carry at most "
                                                  f"{MAX_HASHED_BODY} bytes") from None
                payload = get_input_stream(environ).read(MAX_HASHED_BODY + 1)
                signed_hash = verify(environ, payload, self.creds, hosts=self.hosts) and ""
            if signed_hash:
                check_body(payload, signed_hash)
        except Refused as e:
            return _error(start_response, "403 Forbidden", e.code, str(e))
        self.last_request = time.monotonic()  # only the owner's requests keep the store alive
        environ["wsgi.input"] = io.BytesIO(payload)
        environ["CONTENT_LENGTH"] = str(len(payload))
        environ.pop("HTTP_TRANSFER_ENCODING", None)
        start_response = _no_cors(start_response)
        bucket, _, key = path.lstrip("/").partition("/")
        if bucket and key and method in self.WRITES_OBJECT:
            be = _backend()
            if bucket not in be.buckets and not bucket.startswith("_") and not bucket.startswith("moto-api"):
                with self.mirror.lock:
                    if bucket not in be.buckets:
                        try:
                            be.create_bucket(bucket, REGION)
                        except Exception:
                            pass  # an invalid name: moto answers the request with the proper error
        if method not in self.MUTATING or not bucket:
            return self.app(environ, start_response)
        status: list[str] = []

        def capture(st, headers, exc_info=None):
            status.append(st)
            return start_response(st, headers, exc_info)

        body = list(self.app(environ, capture))  # finish the request before persisting
        if status and status[0][:1] == "2":
            self.mirror.sync(bucket)
        return body


def _tighten(root: str) -> None:
    """Folders 0700 and files 0600 under `root` (a store an older version wrote with 0755/0644)."""
    private_folder(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o700)
        for f in filenames:
            full = os.path.join(dirpath, f)
            if not os.path.islink(full):
                os.chmod(full, 0o600)


def serve(root: str, idle_timeout: float, port: int = 0) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class QuietHandler(MotoRequestHandler):
        def log_request(self, *args, **kwargs):  # one line per request would flood the log
            pass

    os.umask(0o077)  # everything the store writes is its owner's alone
    _tighten(root)
    creds = credentials(root)
    mirror = DiskMirror(root)
    count = mirror.load()
    if DEFAULT_BUCKET not in _backend().buckets:
        _backend().create_bucket(DEFAULT_BUCKET, REGION)
        mirror.sync(DEFAULT_BUCKET)
    app = StoreApp(DomainDispatcherApplication(create_backend_app), mirror, root, creds)
    server = make_server("127.0.0.1", port, app, threaded=True, request_handler=QuietHandler)
    url = f"http://127.0.0.1:{server.server_port}"
    app.hosts = (f"127.0.0.1:{server.server_port}", f"localhost:{server.server_port}")
    info = {"pid": os.getpid(), "url": url, "port": server.server_port, "started": time.time()}
    write_json(f"{root}/server.json", info)
    print(f"trainyard store: {url}, {count} objects reloaded from {root}", flush=True)

    def watchdog():
        while time.monotonic() - app.last_request < idle_timeout:
            time.sleep(min(5.0, idle_timeout / 4))
        print(f"trainyard store: idle for {idle_timeout:.0f}s, exiting", flush=True)
        server.shutdown()

    threading.Thread(target=watchdog, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever()
    finally:
        try:  # forget the address only if it is still ours
            with open(f"{root}/server.json") as fh:
                if json.load(fh).get("pid") == os.getpid():
                    os.remove(f"{root}/server.json")
        except (OSError, ValueError):
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainyard.sdk.store_server")
    p.add_argument("--root", required=True)
    p.add_argument("--idle-timeout", type=float, default=3600.0, help="exit after this many idle seconds")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    serve(a.root, a.idle_timeout, a.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
