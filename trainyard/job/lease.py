"""One writer per checkpoint location: the lease.

Two jobs that write checkpoints to one location overwrite each other's steps without a word, and a new job
then resumes the other's weights. So a job holds a lease on each location it writes checkpoints to (its
`checkpoint_s3_uri`, and the built-in trainer's `checkpoint_uri`): the object `<location>/.trainyard-lease.json`,
`{"job", "heartbeat", "host"}`.

- `fit()` takes it before anything is uploaded or started (`take`); a lease of another job that is alive, on
  the location or on a folder above or below it (`s3://b/run` and `s3://b/run/sub` overlap: the first job lists,
  restores and purges what the second writes), refuses the new job, naming the other one (`LeaseHeld`).
- While the job runs, the driver of its first host renews it every RENEW_S seconds (`Heartbeat`), and removes
  it when the job ends, if it is still the job's.
- A lease is stale, and taken over with a line that says so, when its heartbeat is older than `TRAINYARD_LEASE_TTL_S`
  (default 120 s: four missed renewals), or at once when its job is known to have ended (a local job of this
  machine whose status is final: `alive` says so).

The lease guards against accidents, not against a hostile writer: anyone who can write to the bucket can
write the lease too. The file is not a checkpoint: the checkpoint folder's sync and the engine's step listing
leave it alone.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable

from trainyard.job import storage
from trainyard.job.spec import BUILTIN_TRAINER, JobSpec
from trainyard.job.uris import join, split_s3

NAME = ".trainyard-lease.json"
RENEW_S = 30.0


def ttl_s() -> float:
    return float(os.environ.get("TRAINYARD_LEASE_TTL_S", "120"))


class LeaseHeld(Exception):
    """Another live job writes checkpoints to the location."""

    def __init__(self, location: str, job: str, age: float):
        super().__init__(f"job {job!r} is writing checkpoints to {location} (its lease was renewed {age:.0f} s ago); "
                         "two jobs on one location overwrite each other's steps: wait for it to end, stop it, or "
                         "choose another checkpoint location")
        self.location, self.job = location, job


def uri(location: str) -> str:
    return join(location, NAME)


def locations(spec: JobSpec) -> list[str]:
    """Where the job writes checkpoints: `checkpoint_s3_uri`, and the built-in trainer's `checkpoint_uri` when it
    is an `s3://` or `file://` URI (one location once)."""
    found = [spec.checkpoint_s3_uri]
    if spec.entry_kind == "module" and spec.entry_point == BUILTIN_TRAINER:
        found.append(str(spec.hyperparameters.get("checkpoint_uri") or ""))
    out: list[str] = []
    for loc in found:
        if loc and loc.startswith(("s3://", "file://")) and loc.rstrip("/") not in out:
            out.append(loc.rstrip("/"))
    return out


def read(location: str, s3=None) -> dict | None:
    """The lease on `location`, or None (none there, or not a lease: a file someone wrote by hand)."""
    try:
        if not storage.exists(uri(location), s3=s3):
            return None
        doc = json.loads(storage.get_bytes(uri(location), s3=s3))
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("job"), str) else None


def _write(location: str, job: str, s3=None) -> None:
    doc = {"job": job, "heartbeat": time.time(), "host": socket.gethostname()}
    data = json.dumps(doc).encode()
    if location.startswith("s3://"):
        bucket, key = split_s3(uri(location))
        (s3 or storage.s3_client()).put_object(Bucket=bucket, Key=key, Body=data, ContentType="application/json")
    else:
        storage.put_bytes(uri(location), data, "application/json")


def _overlapping(location: str, s3=None) -> list[str]:
    """The locations whose leases overlap `location`: the folders above it (a job there lists, restores and purges
    what is under it) and those below it that hold a lease."""
    scheme, rest = location.split("://", 1)
    root = f"{scheme}://{rest.split('/', 1)[0]}"  # s3://bucket, or file:// (a local path starts with /)
    parts = [p for p in location[len(root):].split("/") if p]
    above = [root + "".join(f"/{p}" for p in parts[:i]) for i in range(len(parts))]
    above = [a for a in above if a != "file://"]
    try:
        below = [f"{location}/{rel[: -len(NAME) - 1]}" for _, rel, _ in storage.list_files(location, s3=s3)
                 if rel.endswith(f"/{NAME}")]
    except Exception:  # noqa: BLE001 - a location nothing was written to yet (no bucket): nothing below
        below = []
    return above + below


def take(location: str, job: str, *, alive: Callable[[str], bool | None] = lambda name: None,
         say: Callable[[str], None] = print, s3=None) -> None:
    """Hold `location` for `job`: LeaseHeld when another job holds it, or a folder above or below it, and is
    alive (`alive(name)`: True, False, or None when unknown: then the heartbeat's age decides). A stale lease
    is taken over (or, overlapping, left alone), said in one line."""
    for other in [location, *_overlapping(location, s3=s3)]:
        held = read(other, s3=s3)
        if held is None or held["job"] == job:
            continue
        age = time.time() - float(held.get("heartbeat") or 0)
        state = alive(held["job"])
        if state is True or (state is None and age < ttl_s()):
            raise LeaseHeld(other, held["job"], age)
        if other == location:
            why = "it has ended" if state is False else f"no heartbeat for {age:.0f} s (more than {ttl_s():.0f} s)"
            say(f"checkpoint location {location}: taking over the lease of job {held['job']!r}: {why}")
    _write(location, job, s3=s3)
    now = read(location, s3=s3)
    if now is None or now["job"] != job:  # another fit() wrote between our read and our write
        raise LeaseHeld(location, now["job"] if now else "?", 0.0)


class Heartbeat:
    """The running job's side: renew the leases every RENEW_S seconds in a thread; `stop()` removes those that
    are still the job's."""

    def __init__(self, locations: list[str], job: str, say: Callable[[str], None] = print):
        self.locations, self.job, self.say = locations, job, say
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-lease", daemon=True)

    def start(self) -> Heartbeat:
        if self.locations:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(RENEW_S):
            for location in self.locations:
                try:
                    held = read(location)
                    if held is not None and held["job"] != self.job:
                        self.say(f"checkpoint location {location}: job {held['job']!r} took over the lease; this job "
                                 "goes on but its checkpoints there may be overwritten")
                        continue
                    _write(location, self.job)
                except Exception as e:  # noqa: BLE001 - a missed renewal is not worth a failed job
                    self.say(f"checkpoint location {location}: renewing the lease failed ({e}); retrying")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for location in self.locations:
            try:
                held = read(location)
                if held is not None and held["job"] == self.job:
                    storage.delete(uri(location))
            except Exception as e:  # noqa: BLE001 - the lease then goes stale on its own
                self.say(f"checkpoint location {location}: removing the lease failed ({e}); it expires by itself")
