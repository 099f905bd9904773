"""Instance metadata (IMDSv2) for the node agent: a token-carrying client and the spot-notice watcher.

IMDS is link-local (`http://169.254.169.254`); `TRAINYARD_IMDS_ENDPOINT` points the client elsewhere (tests
run a fake one, tests/container/fake_imds.py). Nothing here imports boto3 or torch.
"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

IMDS_DEFAULT = "http://169.254.169.254"
IMDS_TOKEN_TTL_S = 21600  # the longest an IMDSv2 token may live (6 h); the client renews it before expiry
IMDS_TIMEOUT_S = 2.0  # IMDS answers in milliseconds; a longer silence means it is not there
IMDS_TRIES = 5  # connection errors are retried (1 s apart): IMDS may lag right after boot
SPOT_POLL_S = 5.0  # AWS's advice for the interruption notice, which comes ~120 s ahead


class Imds:
    """An IMDSv2 client: a session token (PUT), then GETs that carry it. `get` returns None for 404."""

    def __init__(self, base_url: str | None = None, *, timeout: float = IMDS_TIMEOUT_S, tries: int = IMDS_TRIES):
        self.base = (base_url or os.environ.get("TRAINYARD_IMDS_ENDPOINT") or IMDS_DEFAULT).rstrip("/")
        self.timeout, self.tries = timeout, tries
        self._token: str | None = None
        self._token_expiry = 0.0
        self._lock = threading.Lock()
        # never through an HTTP proxy from the environment: IMDS is link-local
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _request(self, req: urllib.request.Request) -> tuple[int, str]:
        last: Exception | None = None
        for attempt in range(self.tries):
            try:
                with self._opener.open(req, timeout=self.timeout) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode(errors="replace")
            except (urllib.error.URLError, OSError) as e:
                last = e
                if attempt + 1 < self.tries:
                    time.sleep(1.0)
        raise ConnectionError(f"instance metadata at {self.base} unreachable: {last}")

    def token(self, *, renew: bool = False) -> str:
        with self._lock:
            if renew or self._token is None or time.monotonic() > self._token_expiry:
                req = urllib.request.Request(f"{self.base}/latest/api/token", method="PUT",
                                             headers={"X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_TTL_S)})
                code, body = self._request(req)
                if code != 200 or not body:
                    raise ConnectionError(f"IMDSv2 token request to {self.base} answered HTTP {code}")
                # renew a minute before the token runs out
                self._token, self._token_expiry = body.strip(), time.monotonic() + IMDS_TOKEN_TTL_S - 60
            return self._token

    def get(self, path: str) -> str | None:
        for renew in (False, True):  # a 401 means the token expired or was revoked: one fresh try
            headers = {"X-aws-ec2-metadata-token": self.token(renew=renew)}
            req = urllib.request.Request(f"{self.base}{path}", headers=headers)
            code, body = self._request(req)
            if code == 200:
                return body
            if code == 404:
                return None
            if code != 401:
                break
        raise ConnectionError(f"IMDS {path} answered HTTP {code}")

    def require(self, path: str) -> str:
        value = self.get(path)
        if value is None:
            raise ConnectionError(f"IMDS has no {path}")
        return value.strip()


class SpotWatcher:
    """Polls IMDS for the spot interruption notice; `on_notice(notice)` is called once."""

    PATH = "/latest/meta-data/spot/instance-action"

    def __init__(self, imds: Imds, poll_s: float, on_notice: Callable[[dict], None], say: Callable[[str], None]):
        self.imds, self.poll_s, self.on_notice, self.say = imds, poll_s, on_notice, say
        self.notice: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spot-watcher", daemon=True)

    def start(self) -> "SpotWatcher":
        self._thread.start()
        return self

    def _run(self) -> None:
        errors = 0
        while not self._stop.wait(self.poll_s):
            try:
                body = self.imds.get(self.PATH)
            except Exception as e:
                errors += 1
                if errors == 1 or errors % 100 == 0:
                    self.say(f"spot notice check failed ({errors}x): {e}")
                continue
            if body is None:
                continue
            try:
                notice = json.loads(body)
            except ValueError:
                notice = {"action": "terminate", "time": body.strip()}
            self.notice = notice
            self.on_notice(notice)
            return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
