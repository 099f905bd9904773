"""CloudWatch Logs shipping for the node agent: `LogShipper` sends lines to one log stream.

Lines are queued and sent by one background thread, every LOG_FLUSH_S (2 s) or as soon as LOG_FLUSH_LINES
(500) are waiting; `close()` ships the tail (waiting at most LOG_CLOSE_S, 60 s). `plan_batches` splits the
events into PutLogEvents batches of at most 10,000 events and 1 MiB (1,048,576 bytes, counting 26 bytes per
event on top of its UTF-8 message), spanning at most 24 hours; `clip_message` cuts a line longer than one
event may be (256 KiB less those 26 bytes) and marks it `...[truncated]`. While CloudWatch is unreachable at
most LOG_QUEUE_MAX (200,000) lines are kept, the oldest dropped beyond; a batch is tried LOG_PUT_TRIES (3)
times on top of botocore's own retries, then counted as lost. Empty lines are skipped (CloudWatch refuses
them). The caller passes the boto3 `logs` client; nothing here imports boto3.
"""
from __future__ import annotations

import collections
import threading
import time

# CloudWatch Logs PutLogEvents limits: a batch holds at most 10,000 events and 1,048,576 bytes, counted
# as the UTF-8 message plus 26 bytes per event; one event at most 256 KiB including those 26 bytes; the
# events of one batch in time order and within 24 hours of each other
CWL_BATCH_EVENTS = 10_000
CWL_BATCH_BYTES = 1_048_576
CWL_EVENT_OVERHEAD = 26
CWL_EVENT_BYTES = 262_144 - CWL_EVENT_OVERHEAD
CWL_BATCH_SPAN_MS = 24 * 3600 * 1000
LOG_FLUSH_S = 2.0  # a line reaches CloudWatch within this time ...
LOG_FLUSH_LINES = 500  # ... or as soon as this many are waiting
LOG_QUEUE_MAX = 200_000  # lines kept while CloudWatch is unreachable; beyond, the oldest are dropped
LOG_PUT_TRIES = 3  # per batch, on top of botocore's own retries; then the batch is reported lost
LOG_CLOSE_S = 60.0  # how long the final flush may take


def plan_batches(events: list[dict]) -> list[list[dict]]:
    """Split time-ordered `{"timestamp", "message"}` events into PutLogEvents batches within the limits."""
    batches: list[list[dict]] = []
    cur: list[dict] = []
    size = 0
    for ev in events:
        n = len(ev["message"].encode()) + CWL_EVENT_OVERHEAD
        if cur and (len(cur) >= CWL_BATCH_EVENTS or size + n > CWL_BATCH_BYTES
                    or ev["timestamp"] - cur[0]["timestamp"] > CWL_BATCH_SPAN_MS):
            batches.append(cur)
            cur, size = [], 0
        cur.append(ev)
        size += n
    if cur:
        batches.append(cur)
    return batches


def clip_message(line: str) -> str:
    """One log line as a CloudWatch event message: at most CWL_EVENT_BYTES of UTF-8."""
    data = line.encode(errors="replace")
    if len(data) <= CWL_EVENT_BYTES:
        return line
    marker = " ...[truncated]"
    return data[: CWL_EVENT_BYTES - len(marker)].decode(errors="ignore") + marker


class LogShipper:
    """Lines to a CloudWatch Logs stream, batched (every LOG_FLUSH_S or LOG_FLUSH_LINES) by one thread;
    `close()` ships the tail."""

    def __init__(self, client, group: str, stream: str, *, flush_s: float = LOG_FLUSH_S,
                 flush_lines: int = LOG_FLUSH_LINES, queue_max: int = LOG_QUEUE_MAX):
        self.client, self.group, self.stream = client, group, stream
        self.flush_s, self.flush_lines = flush_s, flush_lines
        self._q: collections.deque = collections.deque(maxlen=queue_max)
        self._cv = threading.Condition()
        self._stop = False
        self._last_ts = 0
        self.dropped = 0  # lines pushed out of a full queue
        self.lost = 0  # lines whose batch CloudWatch refused
        self.shipped = 0
        self._written = self._done = 0  # lines queued, lines shipped, lost or dropped: flush() waits on these
        self._flush_now = False
        self._thread = threading.Thread(target=self._run, name="cloudwatch-logs", daemon=True)

    def ensure_stream(self) -> None:
        exists = self.client.exceptions.ResourceAlreadyExistsException
        try:
            self.client.create_log_group(logGroupName=self.group)
        except exists:
            pass
        except Exception as e:  # a role may only write streams of a group made for it (Terraform's)
            print(f"[trainyard agent] could not create log group {self.group}: {e}", flush=True)
        try:
            self.client.create_log_stream(logGroupName=self.group, logStreamName=self.stream)
        except exists:  # a second run of the same host and attempt appends to its stream
            pass

    def start(self) -> "LogShipper":
        self.ensure_stream()
        self._thread.start()
        return self

    def write(self, line: str) -> None:
        if not line:
            return  # CloudWatch refuses empty messages
        with self._cv:
            # events of a batch must be in time order: never let the clock step back
            self._last_ts = max(self._last_ts, int(time.time() * 1000))
            if len(self._q) == self._q.maxlen:
                self.dropped += 1
                self._done += 1
            self._written += 1
            self._q.append({"timestamp": self._last_ts, "message": clip_message(line)})
            if len(self._q) >= self.flush_lines:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or self._flush_now or len(self._q) >= self.flush_lines,
                                  timeout=self.flush_s)
                events = list(self._q)
                self._q.clear()
                stop, self._flush_now = self._stop, False
            if events:
                self._send(events)
            with self._cv:
                self._done += len(events)
                self._cv.notify_all()
            if stop:
                with self._cv:
                    if not self._q:
                        return

    def _send(self, events: list[dict]) -> None:
        for batch in plan_batches(events):
            err: Exception | None = None
            for _ in range(LOG_PUT_TRIES):
                try:
                    r = self.client.put_log_events(logGroupName=self.group, logStreamName=self.stream, logEvents=batch)
                    rejected = r.get("rejectedLogEventsInfo")
                    if rejected:
                        print(f"[trainyard agent] CloudWatch rejected some events: {rejected}", flush=True)
                    self.shipped += len(batch)
                    err = None
                    break
                except self.client.exceptions.ResourceNotFoundException as e:  # deleted while we ran
                    err = e
                    self.ensure_stream()
                except Exception as e:
                    err = e
                    time.sleep(1.0)
            if err is not None:
                self.lost += len(batch)
                print(f"[trainyard agent] {len(batch)} log lines not shipped to {self.group}/{self.stream}: {err}",
                      flush=True)

    def flush(self, timeout: float = LOG_CLOSE_S) -> bool:
        """Ship every line written so far now; False when `timeout` passed first."""
        if not self._thread.is_alive():
            return False
        with self._cv:
            target = self._written
            self._flush_now = True
            self._cv.notify_all()
            return self._cv.wait_for(lambda: self._done >= target, timeout=timeout)

    def close(self, timeout: float = LOG_CLOSE_S) -> None:
        if self.dropped:
            self.write(f"[trainyard agent] {self.dropped} log lines were dropped while CloudWatch was unreachable")
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
