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
"""
from __future__ import annotations

from trainyard.container.folder_sync import DEFAULT_INTERVAL_S, FolderSync

__all__ = ["DEFAULT_INTERVAL_S", "CheckpointSync"]


class CheckpointSync(FolderSync):
    """`checkpoint_local_path` mirrored to `checkpoint_s3_uri`: `restore()` before the script starts, `start()`,
    `stop()` for the final sync. Checkpoint files are written once: each is uploaded when it has settled."""

    what = "checkpoint"
