"""Where checkpoints live: one prefix per step under a location (`<uri>/step-00000100/`), committed by its
`.metadata`; listing, the newest committed step, purging old ones, and `committed_steps`, the one list that rank
0 reads and broadcasts (a collective) for resume and verification. No torch but for that broadcast."""
from __future__ import annotations

import os
import re
from typing import Any

from trainyard.engine.components.formats import check_location_form  # noqa: F401 (the package's name)

STEP_PREFIX = "step-"
# Zero-padded to 8 digits so names sort in step order (100M steps is beyond any run).
STEP_DIGITS = 8
COMMIT_MARKER = ".metadata"
DEFAULT_KEEP_LAST = 2
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def step_uri(uri: str, step: int) -> str:
    """`<uri>/step-00000100`: where step `step` is saved."""
    _check_uri_type(uri)
    return f"{uri.rstrip('/')}/{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def _check_uri_type(uri: Any) -> None:
    # pathlib.Path folds "s3://b" into "s3:/b": storage locations are always str.
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"checkpoint uri must be a non-empty str, got {uri!r}")
    check_location_form(uri)


# seconds to open a connection, and to wait for the next bytes of a response, before botocore retries
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10, 20


def storage_options(uri: str) -> dict[str, Any]:
    """fsspec options for `uri`: the S3 endpoint, and the keys when the environment has them, named explicitly,
    so that fsspec's instance cache never hands out a filesystem bound to another endpoint or other keys (it
    keys instances by these options)."""
    if not uri.startswith("s3://"):
        return {}
    # botocore's "standard" retries: throttling (503 SlowDown), 5xx, dropped connections and timeouts, with
    # backoff, on top of s3fs's own retries of the errors it knows. Bounded timeouts: a request to a store that
    # stalls (an outage that accepts connections and answers nothing) is retried after READ_TIMEOUT_S, not after
    # botocore's 60 s, which an asynchronous save sat on until the hang detector ended the attempt
    options: dict[str, Any] = {"config_kwargs": {"retries": {"max_attempts": 10, "mode": "standard"},
                                                 "connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S}}
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        options.update(key=os.environ["AWS_ACCESS_KEY_ID"], secret=os.environ.get("AWS_SECRET_ACCESS_KEY"))
        if os.environ.get("AWS_SESSION_TOKEN"):
            options["token"] = os.environ["AWS_SESSION_TOKEN"]
    return options


def filesystem(uri: str):
    """The fsspec filesystem of `uri` (its S3 endpoint and keys: `storage_options`) and the path in it."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(uri, **storage_options(uri))
    return fs, path.rstrip("/")


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def validate_uri(uri: str) -> None:
    """Fail early on an unusable checkpoint location.

    For `s3://` the bucket must exist: s3fs would otherwise create it on the first write, and the
    engine must never create buckets (on real S3 that is the platform's or the user's decision).
    """
    _check_uri_type(uri)
    if uri.startswith("s3://"):
        bucket = uri[len("s3://"):].split("/", 1)[0]
        if not bucket:
            raise ValueError(f"checkpoint uri {uri!r} names no bucket")
        fs, _ = filesystem(uri)
        if not fs.exists(bucket):
            raise ValueError(
                f"checkpoint uri {uri!r}: bucket {bucket!r} does not exist or cannot be reached "
                f"(check AWS_ENDPOINT_URL and credentials)"
            )


def list_steps(uri: str) -> dict[int, bool]:
    """Every `step-*` prefix under `uri`: {step: committed (has .metadata)}."""
    _check_uri_type(uri)
    fs, root = filesystem(uri)
    fs.invalidate_cache()  # s3fs caches listings; another process may have written since
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return {}
    steps: dict[int, bool] = {}
    for entry in entries:
        match = _STEP_RE.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if match:
            steps[int(match.group(1))] = fs.exists(f"{root}/{match.group(0)}/{COMMIT_MARKER}")
    return steps


def latest_committed_step(uri: str) -> int | None:
    """The newest step under `uri` whose save completed (its `.metadata` exists), or None."""
    committed = [step for step, ok in list_steps(uri).items() if ok]
    return max(committed) if committed else None


def check_keep_last(keep_last: int) -> None:
    """Refuse a `keep_last` below 1; every save calls this before it writes anything (the purge after the commit
    would otherwise fail at every save, each step written and reported as failed)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest steps kept), got {keep_last}")


def purge(uri: str, keep_last: int, *, protect: int | None = None) -> list[int]:
    """Delete committed steps older than the newest `keep_last`, and interrupted saves older than
    the oldest step kept. Never deletes `protect` (the step just written). Returns deleted steps."""
    check_keep_last(keep_last)
    steps = list_steps(uri)
    committed = sorted((s for s, ok in steps.items() if ok), reverse=True)
    kept = set(committed[:keep_last])
    if protect is not None:
        kept.add(protect)
    oldest_kept = min(kept) if kept else None
    doomed = [s for s, ok in steps.items()
              if s not in kept and (ok or (oldest_kept is not None and s < oldest_kept))]
    fs, _ = filesystem(uri)
    for step in sorted(doomed):
        _, path = filesystem(step_uri(uri, step))
        if steps[step]:  # uncommit first: a purge cut short leaves an ignored prefix, never a damaged step
            fs.rm(f"{path}/{COMMIT_MARKER}")
        fs.rm(path, recursive=True)
    fs.invalidate_cache()
    return sorted(doomed)


def committed_steps(uri: str) -> list[int]:
    """The committed steps under `uri`, newest first: listed by rank 0 and broadcast to every rank (a collective
    when torch.distributed is up), so that all ranks walk the same steps."""
    import torch.distributed as dist

    distributed = dist.is_initialized()
    steps = sorted((s for s, ok in list_steps(uri).items() if ok), reverse=True) \
        if not distributed or dist.get_rank() == 0 else []
    if distributed:
        box = [steps]
        dist.broadcast_object_list(box, src=0)
        steps = box[0]
    return steps
