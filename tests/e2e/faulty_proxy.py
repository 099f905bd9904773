"""An HTTP proxy for tests that sits in front of an S3 endpoint and fails a share of the requests.

Each request is, with probability `rate`, answered with one of, in turn: 500 InternalError, 503 SlowDown, or a
connection closed without an answer (after the request was read); otherwise it is forwarded unchanged.
Seeded, bounded (it serves at most `max_requests` before it forwards everything), on 127.0.0.1 only.
`down(seconds)` makes it an outage for that long: every request's connection is closed unanswered. `hold`
({path substring: seconds}) delays each PUT whose path holds the substring by that long before it is forwarded:
a slow upload of one checkpoint step.
"""
from __future__ import annotations

import http.client
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_ERRORS = {
    500: b"<Error><Code>InternalError</Code><Message>injected</Message></Error>",
    503: b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>",
}


class FaultyProxy:
    def __init__(self, upstream: str, *, rate: float = 0.05, seed: int = 0, max_requests: int = 100_000,
                 hold: dict[str, float] | None = None) -> None:
        self.upstream = urlsplit(upstream)
        self.hold = hold or {}
        self.rate, self.random, self.max_requests = rate, random.Random(seed), max_requests
        self.lock = threading.Lock()
        self.counts = {"forwarded": 0, "500": 0, "503": 0, "dropped": 0}
        self.outage_until = 0.0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._draw()
                if fault == "dropped":
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault in ("500", "503"):
                    payload = _ERRORS[int(fault)]
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if self.command == "PUT":
                    time.sleep(max((s for part, s in proxy.hold.items() if part in self.path), default=0.0))
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = proxy.upstream.netloc
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # a HEAD's answer has no body but the length of the object's
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def down(self, seconds: float) -> None:
        """From now, for `seconds`, answer nothing (as a store that is down)."""
        self.outage_until = time.monotonic() + seconds

    def _draw(self) -> str | None:
        with self.lock:
            if time.monotonic() < self.outage_until:
                self.counts["dropped"] += 1
                return "dropped"
            total = sum(self.counts.values())
            if total >= self.max_requests or self.random.random() >= self.rate:
                self.counts["forwarded"] += 1
                return None
            # the kinds in turn: a few faults are enough to meet each of them
            fault = ("500", "503", "dropped")[sum(self.counts[k] for k in ("500", "503", "dropped")) % 3]
            self.counts[fault] += 1
            return fault

    def __enter__(self) -> FaultyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
