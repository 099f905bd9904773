"""Shipping the first host's `metrics.jsonl` to S3, so that `metrics()` of an EC2 job has its rows.

Rank 0 of algo-1 appends one JSON line per step to `$SM_OUTPUT_DATA_DIR/metrics.jsonl` (the built-in
trainer does). On EC2 that file is on the instance: the node agent of the first host ships its complete
lines as numbered parts next to its status object,

    <state_uri>/hosts/algo-1/metrics/attempt-0001/part-00000001.jsonl
    <state_uri>/hosts/algo-1/metrics/attempt-0001/part-00000002.jsonl   ...

and the controller (trainyard/sdk/backends/ec2/controller.py) appends the parts it has not read yet, in key order,
to its copy in the job folder (`read_parts`: ListObjectsV2 after the last key it read).

`MetricsShipper` runs one thread that every METRICS_SHIP_S reads what was appended since the last part, up
to its last newline (a line being written waits for the next round), and puts it as the next part;
`close()` ships the rest a last time (with a final line that lacks its newline: its writer has exited),
before the agent writes its final status. No file, or nothing new: nothing is put. A failed put is said
once (and once more when shipping works again) and the same bytes are tried at the next round; training
never waits on it.

Numbered parts rather than one object rewritten whole: a round costs what was appended since the last
one (a step's line is a few hundred bytes), not the whole file (a 100,000-step run's is tens of MB), on the
instance and on the controller alike. The attempt in the key keeps the rows of a spot job's next attempt
(a fresh file on a new instance) after the earlier attempt's instead of over them. Numbers are zero-padded
so that key order is write order. Nothing here imports boto3.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from trainyard.job import storage
from trainyard.job.uris import join, split_s3

METRICS_FILE = "metrics.jsonl"
METRICS_SHIP_S = 5.0  # the agent's polling cadence (the spot notice's): a step's row reaches S3 within this
METRICS_CLOSE_TRIES = 3  # the final round, before the final status: tries, 1 s apart, on top of botocore's


def metrics_prefix(state_uri: str, host: str) -> str:
    """Where a host's parts are: `<state_uri>/hosts/<host>/metrics/`."""
    return join(state_uri, "hosts", host, "metrics") + "/"


def part_uri(state_uri: str, host: str, attempt: int, part: int) -> str:
    return metrics_prefix(state_uri, host) + f"attempt-{attempt:04d}/part-{part:08d}.jsonl"


def put_bytes(uri: str, data: bytes) -> None:
    storage.put_bytes(uri, data, "application/x-ndjson")


def read_parts(s3, state_uri: str, host: str, after: str | None) -> tuple[bytes, str | None]:
    """The parts of `host` whose keys come after `after` (every part when None), joined in key order, and
    the last key read (`after` when there is none). `s3` is a boto3 S3 client; errors propagate."""
    bucket, prefix = split_s3(metrics_prefix(state_uri, host))
    keys: list[str] = []
    kwargs = {"Bucket": bucket, "Prefix": prefix, **({"StartAfter": after} if after else {})}
    while True:
        reply = s3.list_objects_v2(**kwargs)
        keys += [o["Key"] for o in reply.get("Contents", [])]
        if not reply.get("IsTruncated"):
            break
        kwargs["ContinuationToken"] = reply["NextContinuationToken"]
    data = b"".join(s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in sorted(keys))
    return data, (max(keys) if keys else after)


class MetricsShipper:
    """The complete lines appended to `path`, as numbered parts under `metrics_prefix(state_uri, host)`."""

    def __init__(self, path: str, state_uri: str, host: str, attempt: int, say: Callable[[str], None], *,
                 interval: float = METRICS_SHIP_S, put: Callable[[str, bytes], None] = put_bytes):
        self.path, self.state_uri, self.host, self.attempt = path, state_uri, host, attempt
        self.say, self.interval, self.put = say, interval, put
        self.offset = 0  # bytes of the file shipped so far
        self.parts = 0
        self.lines = 0
        self.failing = False
        self._lock = threading.Lock()  # a round of the thread and the final one of close() never overlap
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-shipper", daemon=True)

    def start(self) -> "MetricsShipper":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.ship()

    def ship(self, final: bool = False) -> bool:
        """One round: put what was appended since the last part. False when it could not (said once)."""
        with self._lock:
            try:
                with open(self.path, "rb") as fh:
                    fh.seek(self.offset)
                    data = fh.read()
            except FileNotFoundError:
                return True  # not written (yet): nothing to ship
            except OSError as e:
                return self._failed(f"could not read {self.path}: {e}")
            size = len(data) if final else data.rfind(b"\n") + 1  # complete lines; all of it at the end
            if size == 0:
                return True
            body = data[:size] if data[size - 1:size] == b"\n" else data[:size] + b"\n"
            uri = part_uri(self.state_uri, self.host, self.attempt, self.parts + 1)
            try:
                self.put(uri, body)
            except Exception as e:  # noqa: BLE001 - S3 unreachable, throttled, ...: the next round tries again
                return self._failed(f"could not ship metrics to {uri}: {type(e).__name__}: {e}")
            if self.failing:
                self.say(f"metrics shipping works again ({uri})")
                self.failing = False
            self.offset += size
            self.parts += 1
            self.lines += body.count(b"\n")
            return True

    def _failed(self, msg: str) -> bool:
        if not self.failing:
            self.say(f"{msg}; trying again every {self.interval:g} s")
            self.failing = True
        return False

    def close(self) -> bool:
        """Stop the thread and ship what is left. False when some of the file could not be shipped."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for i in range(METRICS_CLOSE_TRIES):
            if self.ship(final=True):
                return True
            if i + 1 < METRICS_CLOSE_TRIES:
                time.sleep(1.0)
        self.say(f"{self.path}: metrics from byte {self.offset} on were not shipped")
        return False
