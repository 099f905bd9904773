"""A job folder mirrored to object storage while the job runs: the checkpoint folder of a user script
(ckpt_sync.py), the TensorBoard folder, the profiler's traces.

`FolderSync(local_dir, uri)` scans the folder every `interval` seconds in a thread and uploads the files that are
new or changed since their last upload, to the same relative key under `uri`; `stop()` syncs a last time, whatever
the job's outcome, and returns what could not be uploaded. Two kinds of files:

- written once, possibly over several scans (checkpoints, traces): with `settle=True` a file is uploaded only when
  it did not change since the previous scan, so a file still being written is not uploaded half-written;
- appended to as the job runs (TensorBoard event files, written record by record and flushed every step): with
  `settle=False` every scan uploads what changed, so the store follows the run (TensorBoard reads a file up to its
  last whole record), and the last sync uploads the whole file.

A file named `*.partial` is one being written beside its final name (the engine's traces, storage.put_bytes): never
uploaded; nor is a checkpoint location's lease (`job/lease.py`) restored or uploaded. A failed upload is reported on the log once per error and retried at the next scan, never dropped silently. Uploads
go through boto3's managed transfer (multipart above its threshold, retries with backoff). Files deleted locally
are kept in the store: nothing the job wrote is lost.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

from trainyard.job import lease, storage
from trainyard.job.uris import join

# Seconds between scans of the local folder (SageMaker syncs continuously; a few seconds is enough for
# checkpoints written every minutes and for a TensorBoard page refreshed by hand, and cheap to list).
DEFAULT_INTERVAL_S = 10.0
PARTIAL = ".partial"  # the suffix of a file written beside its final name, then renamed


class FolderSync:
    """Background upload of `local_dir` to `uri`; `stop()` runs the final sync and returns failures."""

    what = "folder"
    """How the log names the folder ("checkpoint sync: uploading ... failed")."""

    def __init__(self, local_dir: str, uri: str, *, interval: float = DEFAULT_INTERVAL_S, settle: bool = True,
                 say: Callable[[str], None] = print, what: str | None = None) -> None:
        self.local_dir, self.uri, self.interval, self.settle, self.say = local_dir, uri.rstrip("/"), interval, settle, say
        self.what = what or self.what
        self.uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) uploaded
        self._seen: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) at the last scan
        self.failures: dict[str, str] = {}  # relative path -> last error, until it uploads
        self.files_uploaded = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{self.what}-sync", daemon=True)

    def restore(self) -> int:
        """Copy the objects under the URI into the local folder (they count as uploaded); returns the
        number of files."""
        files = [f for f in storage.list_files(self.uri) if f[1] != lease.NAME]  # the lease is not a checkpoint
        skipped = self.restore_skips(files)
        files = [f for f in files if f not in skipped]
        storage.download_tree(self.uri, self.local_dir, files)
        self.uploaded = self._scan()
        self._seen = dict(self.uploaded)
        return len(files)

    def restore_skips(self, files: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
        """The objects `restore` leaves in the store (none here)."""
        return []

    def start(self) -> FolderSync:
        os.makedirs(self.local_dir, exist_ok=True)  # the job writes into it; the contract may name any folder
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sync(final=False)

    def _scan(self) -> dict[str, tuple[int, int]]:
        found = {}
        for dirpath, _, names in os.walk(self.local_dir):
            for name in names:
                if name.endswith(PARTIAL) or (name == lease.NAME and dirpath == self.local_dir):
                    continue
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # removed while scanning
                    continue
                found[os.path.relpath(full, self.local_dir)] = (st.st_size, st.st_mtime_ns)
        return found

    def sync(self, *, final: bool) -> int:
        """Upload what is new or changed (with `settle`, unless final: and unchanged since the last scan)."""
        current = self._scan()
        count = 0
        for rel, stamp in sorted(current.items()):
            if self.uploaded.get(rel) == stamp or (self.settle and not final and self._seen.get(rel) != stamp):
                continue
            try:
                storage.put_file(os.path.join(self.local_dir, rel), join(self.uri, *rel.split(os.sep)))
            except Exception as e:  # reported, retried at the next scan
                if self.failures.get(rel) != str(e):
                    self.say(f"{self.what} sync: uploading {rel} to {self.uri} failed, will retry: {e}")
                self.failures[rel] = str(e)
                continue
            self.uploaded[rel] = stamp
            self.failures.pop(rel, None)
            count += 1
        self._seen = current
        self.files_uploaded += count
        return count

    def stop(self) -> dict[str, str]:
        """Stop the thread, sync a last time; returns {file: error} of what could not be uploaded."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sync(final=True)
        return dict(self.failures)
