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

The scans, uploads and retries are `folder_sync.FolderSync`'s (the TensorBoard and profiler folders are synced
the same way); files deleted locally are kept in the store: nothing the job wrote is lost.

An engine-API script saves straight to the URI (te.save_checkpoint's default location) and marks it so
(`DIRECT_CHECKPOINTS`): its step folders are not restored, since te.load_checkpoint reads them from the store.
"""
from __future__ import annotations

import json
import re

from trainyard.container.folder_sync import DEFAULT_INTERVAL_S, FolderSync
from trainyard.engine.components.contract import DIRECT_CHECKPOINTS
from trainyard.job import storage

STEP_FOLDER = re.compile(r"^step-\d+/")  # the engine's layout: <uri>/step-00000100/... (checkpoint/locations.py)

__all__ = ["DEFAULT_INTERVAL_S", "CheckpointSync"]


class CheckpointSync(FolderSync):
    """`checkpoint_local_path` mirrored to `checkpoint_s3_uri`: `restore()` before the script starts, `start()`,
    `stop()` for the final sync. Checkpoint files are written once: each is uploaded when it has settled."""

    what = "checkpoint"

    def restore_skips(self, files: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
        """The engine's step folders where the engine writes straight to the URI (its marker there says so):
        te.load_checkpoint reads them from the store, and a copy on every host would download each kept step
        once more. Steps the engine wrote into the local folder (synced here) have no such marker: restored."""
        marker = next((f for f in files if f[1] == DIRECT_CHECKPOINTS), None)
        if marker is None:
            return []
        try:
            written_to = json.loads(storage.get_bytes(marker[0])).get("written_to", "")
        except (OSError, ValueError, AttributeError) as e:
            self.say(f"checkpoint sync: {marker[0]} unreadable ({type(e).__name__}: {e}); restoring everything")
            return []
        if written_to.rstrip("/") != self.uri:
            return []
        steps = [f for f in files if STEP_FOLDER.match(f[1])]
        if steps:
            self.say(f"checkpoint sync: {len(steps)} file(s) of the engine's checkpoints at {self.uri} left there "
                     f"(te.load_checkpoint reads them from the store), not copied to {self.local_dir}")
        return [*steps, marker]
