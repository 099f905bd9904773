"""Input channels staged into a host's `<root>/input/data/<channel>`: shared by the local supervisor
(trainyard/sdk/backends/local/supervisor.py, every host's folder from one process) and the EC2 node agent
(trainyard/container/node.py, its own host).

`s3://` and `file://` channels: the objects under the prefix (`storage.list_files`), this host's share of
them (`storage.shard`: all, or every N-th with ShardedByS3Key), downloaded file by file. `fsx://fs-id/dir`
channels: a symlink to the mounted file system. Either way one line says what the host got, and a long
download says how far it is every `PROGRESS_EVERY_S`.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from trainyard.job import storage
from trainyard.job.uris import split_fsx

PROGRESS_EVERY_S = 10.0
FSX_ROOT = "/fsx"  # where the user data mounts FSx for Lustre file systems: <root>/<fs-id>


def list_channel(name: str, uri: str) -> list[tuple[str, str, int]]:
    """The objects of a channel (`storage.list_files`); an empty channel is an error."""
    files = storage.list_files(uri)
    if not files:
        raise RuntimeError(f"input channel {name!r}: nothing found at {uri}")
    return files


def link_fsx(uri: str, dest: str, fsx_root: str = FSX_ROOT) -> str:
    """`dest` becomes a symlink to `<fsx_root>/<fs-id>/<dir>` for `fsx://fs-id/dir`, which must exist (the
    user data mounted the file system). Returns the link's target."""
    fs_id, path = split_fsx(uri)
    target = f"{fsx_root.rstrip('/')}/{fs_id}{path}".rstrip("/")
    if not os.path.isdir(target):
        raise FileNotFoundError(f"{uri}: {target} does not exist (is {fs_id} mounted at "
                                f"{fsx_root.rstrip('/')}/{fs_id}, and does it hold {path}?)")
    if os.path.islink(dest):
        os.unlink(dest)
    elif os.path.isdir(dest):
        os.rmdir(dest)  # an empty folder from an earlier contract; a non-empty one is an error
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    os.symlink(target, dest)
    return target


def stage_channel(name: str, uri: str, dest: str, *, distribution: str, host_index: int, host_count: int,
                  files: list[tuple[str, str, int]] | None = None, fsx_root: str = FSX_ROOT,
                  stop: Callable[[], str | None] = lambda: None,
                  say: Callable[[str], None] = print) -> tuple[int, int]:
    """Make channel `name` appear at `dest` for host `host_index` of `host_count`; says one line about it
    and returns (files, bytes) downloaded ((0, 0) for an FSx link). `files` is the channel's listing when
    the caller has it already (the supervisor lists once for all its hosts). `stop()` returning a reason
    ends a download between two files with InterruptedError."""
    if uri.startswith("fsx://"):
        target = link_fsx(uri, dest, fsx_root)
        say(f"channel {name}: linked to {target} from {uri}")
        return 0, 0
    mine = storage.shard(list_channel(name, uri) if files is None else files, host_index, host_count, distribution)
    os.makedirs(dest, exist_ok=True)
    total, size = 0, sum(obj[2] for obj in mine)
    started = next_say = time.monotonic()
    next_say += PROGRESS_EVERY_S
    for n, obj in enumerate(mine, 1):
        why = stop()
        if why:
            raise InterruptedError(why)
        total += storage.download_tree(uri, dest, [obj])
        now = time.monotonic()
        if now >= next_say and n < len(mine):  # a long download says how far it is
            rate = total / (now - started)
            left = f", {(size - total) / rate:.0f} s left" if rate > 0 else ""
            say(f"channel {name}: {n}/{len(mine)} files, {total / 2**20:.1f} of {size / 2**20:.1f} MiB "
                f"({100 * total / max(size, 1):.0f}%), {rate / 2**20:.1f} MiB/s{left}")
            next_say = now + PROGRESS_EVERY_S
    took = time.monotonic() - started
    say(f"channel {name}: {len(mine)} files, {total / 2**20:.1f} MiB from {uri} in {took:.1f} s")
    return len(mine), total
