"""JSON documents written atomically (status files, job folders) and the UTC time stamps they carry."""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def write_json(path: str, data: dict) -> None:
    """Write `data` to `path` so that a reader sees the old document or the new one, never a part. The file is
    its owner's alone (0600): job documents hold environment values and endpoints."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            json.dump(data, fh, indent=1)
        os.replace(tmp, path)
    except BaseException:
        try:  # a full disk, or an interrupt: no half-written temporary left behind
            os.remove(tmp)
        except OSError:
            pass
        raise


def read_json(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)
