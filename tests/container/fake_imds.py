"""A tiny IMDSv2 for tests: one per emulated EC2 instance.

    with FakeImds(launch_index=0, instance_id="i-0123") as imds:
        env["TRAINYARD_IMDS_ENDPOINT"] = imds.url
        ...
        imds.interrupt()  # from now on spot/instance-action answers the notice

Serves what the node agent reads: `PUT /latest/api/token` (needs the TTL header), then with the
`X-aws-ec2-metadata-token` header `ami-launch-index`, `instance-id`, `local-ipv4` and
`spot/instance-action` (404 until `interrupt()`). A GET without a valid token answers 401, as IMDS does
when IMDSv2 is required. `requests` records (method, path, status) of every request.
"""
from __future__ import annotations

import json
import secrets
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
SPOT_PATH = "/latest/meta-data/spot/instance-action"


class FakeImds:
    def __init__(self, launch_index: int, instance_id: str, local_ipv4: str = "127.0.0.1"):
        self.launch_index, self.instance_id, self.local_ipv4 = launch_index, instance_id, local_ipv4
        self.notice: dict | None = None
        self.requests: list[tuple[str, str, int]] = []
        self._tokens: set[str] = set()
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, code: int, body: str = "") -> None:
                data = body.encode()
                with fake._lock:
                    fake.requests.append((self.command, self.path, code))
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                if self.path != TOKEN_PATH:
                    return self._answer(404)
                ttl = self.headers.get(TTL_HEADER, "")
                if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    return self._answer(400)
                token = secrets.token_urlsafe(24)
                with fake._lock:
                    fake._tokens.add(token)
                self._answer(200, token)

            def do_GET(self):
                with fake._lock:
                    ok = self.headers.get(TOKEN_HEADER) in fake._tokens
                if not ok:
                    return self._answer(401)
                body = fake._value(self.path)
                self._answer(404) if body is None else self._answer(200, body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"fake-imds-{launch_index}", daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}"

    def _value(self, path: str) -> str | None:
        meta = {
            "/latest/meta-data/ami-launch-index": str(self.launch_index),
            "/latest/meta-data/instance-id": self.instance_id,
            "/latest/meta-data/local-ipv4": self.local_ipv4,
        }
        if path == SPOT_PATH:
            return None if self.notice is None else json.dumps(self.notice)
        return meta.get(path)

    def interrupt(self, action: str = "terminate", when: datetime | None = None) -> dict:
        """Start answering the spot interruption notice (by default: terminate two minutes from now)."""
        when = when or datetime.now(timezone.utc) + timedelta(minutes=2)
        self.notice = {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
        return self.notice

    def count(self, path: str) -> int:
        """How many requests asked for `path`."""
        with self._lock:
            return sum(1 for _, p, _ in self.requests if p == path)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> "FakeImds":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
