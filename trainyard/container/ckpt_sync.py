"""SageMaker's checkpoint contract for scripts that save files themselves.

With `checkpoint_s3_uri`, every host's `checkpoint_local_path` (default `/opt/ml/checkpoints`,
`$SM_CHECKPOINT_DIR`) is

- restored before the script starts: the objects under the URI, taken as a folder (`s3://b/ckpt` never
  reads `s3://b/ckpt-old/...`: `storage.list_files` lists `ckpt/`), are copied into it;
- synced during the run: every `interval` seconds, files that are new or changed and that did not
  change since the previous scan (so a file still being written is not uploaded half-written) are
  uploaded to the same relative key; a failed upload is reported on the log and retried at the next
  scan, never dropped silently;
- synced a last time when the script ends, whatever the outcome (a file still changing then is
  uploaded as it is).

Uploads go through boto3's managed transfer (multipart above its threshold, retries with backoff).
Files deleted locally are kept in the store: nothing the job wrote is lost.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

from trainyard.job import storage
from trainyard.job.uris import join

# Seconds between scans of the local folder (SageMaker syncs continuously; a few seconds is enough for
# checkpoints written every minutes and cheap to list).
DEFAULT_INTERVAL_S = 10.0


class CheckpointSync:
    """Background upload of `local_dir` to `uri`; `stop()` runs the final sync and returns failures."""

    def __init__(self, local_dir: str, uri: str, *, interval: float = DEFAULT_INTERVAL_S,
                 say: Callable[[str], None] = print) -> None:
        self.local_dir, self.uri, self.interval, self.say = local_dir, uri.rstrip("/"), interval, say
        self.uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) uploaded
        self._seen: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) at the last scan
        self.failures: dict[str, str] = {}  # relative path -> last error, until it uploads
        self.files_uploaded = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-sync", daemon=True)

    def restore(self) -> int:
        """Copy the objects under the URI into the local folder (they count as uploaded); returns the
        number of files."""
        files = storage.list_files(self.uri)
        storage.download_tree(self.uri, self.local_dir, files)
        self.uploaded = self._scan()
        self._seen = dict(self.uploaded)
        return len(files)

    def start(self) -> CheckpointSync:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sync(final=False)

    def _scan(self) -> dict[str, tuple[int, int]]:
        found = {}
        for dirpath, _, names in os.walk(self.local_dir):
            for name in names:
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # removed while scanning
                    continue
                found[os.path.relpath(full, self.local_dir)] = (st.st_size, st.st_mtime_ns)
        return found

    def sync(self, *, final: bool) -> int:
        """Upload what is new or changed (and, unless final, unchanged since the last scan)."""
        current = self._scan()
        count = 0
        for rel, stamp in sorted(current.items()):
            if self.uploaded.get(rel) == stamp or (not final and self._seen.get(rel) != stamp):
                continue
            try:
                storage.put_file(os.path.join(self.local_dir, rel), join(self.uri, *rel.split(os.sep)))
            except Exception as e:  # reported, retried at the next scan
                if self.failures.get(rel) != str(e):
                    self.say(f"checkpoint sync: uploading {rel} to {self.uri} failed, will retry: {e}")
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
