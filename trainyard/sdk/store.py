"""Where `s3://` goes for local jobs: a configured endpoint, or the embedded store.

With `AWS_ENDPOINT_URL` set, that endpoint is used as it is. Otherwise `ensure_store()` finds or starts
this user's embedded store (`store_server.py`): a moto S3 server on 127.0.0.1 that outlives any single
`fit()`, keeps its objects under `$TRAINYARD_HOME/store` (default `~/.trainyard/store`, the owner's alone) and
answers only requests signed with the owner's key (`store_auth.py`).
"""
from __future__ import annotations

import fcntl
import hmac
import json
import secrets
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from trainyard.sdk.store_auth import Credentials, credentials, private_folder, proof
from trainyard.sdk.store_server import DEFAULT_BUCKET, HEALTH_PATH

START_TIMEOUT_S = 60.0  # first start imports moto and reloads persisted objects
# The store exits after this long without a request; running local jobs ping it (see supervisor.py).
IDLE_TIMEOUT_S = float(os.environ.get("TRAINYARD_STORE_IDLE_S", "3600"))


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str | None
    """S3 endpoint URL; None means real AWS."""
    embedded: bool
    """True when it is Trainyard's own store (the only one where buckets are created: by a write to one,
    and by `fit()` for those its job writes to)."""

    def client(self):
        """A boto3 S3 client on this endpoint, signing with the embedded store's key (boto3's defaults for an
        endpoint that is not the embedded store)."""
        import boto3  # lazily: the SDK's import path stays free of boto3

        env = self.env() if self.embedded else os.environ
        # keys passed as they are now: boto3's default session keeps the first keys it resolved
        keys = {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env.get("AWS_SECRET_ACCESS_KEY"),
                "aws_session_token": env.get("AWS_SESSION_TOKEN")} if env.get("AWS_ACCESS_KEY_ID") else {}
        region = env.get("AWS_DEFAULT_REGION")
        return boto3.client("s3", endpoint_url=self.url, region_name=region, **keys)

    def env(self) -> dict[str, str]:
        """Variables that point boto3 and s3fs in a job's processes at this endpoint."""
        if not self.embedded:
            return {}
        return {"AWS_ENDPOINT_URL": self.url, "AWS_DEFAULT_REGION": "us-east-1", **credentials(store_root()).env()}


def trainyard_home() -> str:
    return os.environ.get("TRAINYARD_HOME") or os.path.join(os.path.expanduser("~"), ".trainyard")


def store_root() -> str:
    return os.path.join(trainyard_home(), "store")


def healthy(url: str, timeout: float = 2.0, creds: Credentials | None = None) -> bool:
    """Whether a store answers at `url`; with `creds`, the store of that key: it proves it holds the secret by its
    HMAC of a fresh nonce (another user's server on a reused port cannot)."""
    nonce = secrets.token_hex(16)
    try:
        with urllib.request.urlopen(f"{url}{HEALTH_PATH}?nonce={nonce}", timeout=timeout) as r:
            if r.status != 200:
                return False
            answer = json.loads(r.read())
    except (OSError, ValueError):
        return False
    return creds is None or hmac.compare_digest(str(answer.get("proof", "")), proof(creds, nonce))


def keep_alive(endpoint: Endpoint) -> None:
    """A signed request to the embedded store (only the owner's requests keep it from idling out); errors are
    left to the job's own requests to report."""
    try:
        endpoint.client().list_buckets()
    except Exception:  # noqa: BLE001 - a ping
        pass


def _running_url(root: str) -> str | None:
    try:
        with open(os.path.join(root, "server.json")) as fh:
            url = json.load(fh)["url"]
    except (OSError, ValueError, KeyError):
        return None
    return url if healthy(url, creds=credentials(root)) else None


# the embedded store's URL when this process exported it as AWS_ENDPOINT_URL for its own calls (export_env): that
# is still the embedded store, not an endpoint someone configured
_exported_url: str | None = None


def export_env() -> None:
    """The embedded store's endpoint, region and this user's credentials into this process's environment (for its
    own boto3, s3fs and `datasets` calls; sdk/session.py decides when). Kept current if the store restarts."""
    global _exported_url
    endpoint = ensure_store()
    if not endpoint.embedded:
        return
    for key, value in endpoint.env().items():
        os.environ[key] = value
    _exported_url = endpoint.url
    boto3 = sys.modules.get("boto3")
    if boto3 is not None:  # its default session keeps the credentials it resolved first: resolve them again
        boto3.DEFAULT_SESSION = None
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:  # S3FileSystem() hands back an instance made before, with the endpoint of then
        s3fs.S3FileSystem.clear_instance_cache()


def exported() -> bool:
    """Whether this process's AWS_ENDPOINT_URL is the embedded store's, set by `export_env`."""
    return _exported_url is not None and os.environ.get("AWS_ENDPOINT_URL") == _exported_url


def ensure_store() -> Endpoint:
    """The endpoint for local jobs: `AWS_ENDPOINT_URL` if set (and not the embedded store's, exported by
    `export_env`), else the embedded store (started if needed)."""
    global _exported_url
    configured = os.environ.get("AWS_ENDPOINT_URL")
    if configured and configured != _exported_url:
        return Endpoint(configured, embedded=False)
    if configured:  # ours: follow the store if it restarted on another port
        endpoint = _embedded()
        if endpoint.url != configured:
            os.environ["AWS_ENDPOINT_URL"] = _exported_url = endpoint.url
        return endpoint
    return _embedded()


def _embedded() -> Endpoint:
    root = store_root()
    private_folder(trainyard_home())  # the owner's alone from the first use, not only from the first fit()
    private_folder(root)
    url = _running_url(root)
    if url:
        return Endpoint(url, embedded=True)
    with open(os.open(os.path.join(root, "lock"), os.O_WRONLY | os.O_CREAT, 0o600), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter at a time; the others find its server
        url = _running_url(root)
        if url is None:
            url = _start(root)
    return Endpoint(url, embedded=True)


def _start(root: str) -> str:
    try:
        os.remove(os.path.join(root, "server.json"))
    except FileNotFoundError:
        pass
    log_path = os.path.join(root, "server.log")
    with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainyard.sdk.store_server", "--root", root, "--idle-timeout", str(IDLE_TIMEOUT_S)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,  # outlives this process and its Ctrl-C
            close_fds=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        url = _running_url(root)
        if url:
            return url
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    with open(log_path, errors="replace") as fh:
        last = "".join(fh.readlines()[-15:])
    raise RuntimeError(f"the embedded object store did not start (log {log_path}):\n{last}")


def stop_store() -> bool:
    """Stop the embedded store if it runs (its objects stay on disk). Returns whether one was stopped."""
    root = store_root()
    try:
        with open(os.path.join(root, "server.json")) as fh:
            info = json.load(fh)
    except (OSError, ValueError):
        return False
    if not healthy(info["url"], creds=credentials(root)):
        return False  # not running, or another store took its port: nothing of ours to stop
    os.kill(info["pid"], 15)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and healthy(info["url"], timeout=0.5):
        time.sleep(0.1)
    return True


__all__ = ["DEFAULT_BUCKET", "Endpoint", "ensure_store", "stop_store", "store_root", "trainyard_home"]
