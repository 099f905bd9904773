"""Writing when the disk is full.

A job's status and its failure report must be written whatever filled the disk: they are what tells the user
that the disk filled. So each process that writes them reserves a little space up front (`reserve(folder)`:
`<folder>/.trainyard-reserve`, RESERVE_BYTES allocated), and a write that fails with ENOSPC frees that space and
tries once more (`write_anyway`). What no longer fits after that raises as before.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import TypeVar

RESERVE = ".trainyard-reserve"
RESERVE_BYTES = 1 << 20  # a status document and a failure report are a few KiB; room for many rewrites
T = TypeVar("T")


def reserve(folder: str) -> bool:
    """Allocate the reserve in `folder` (blocks really allocated: posix_fallocate). False when there is no room
    for it already."""
    path = os.path.join(folder, RESERVE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


def release(folder: str) -> bool:
    """Free the reserve of `folder`; whether there was one."""
    try:
        os.remove(os.path.join(folder, RESERVE))
        return True
    except FileNotFoundError:
        return False


def full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def write_anyway(folder: str, write: Callable[[], T]) -> T:
    """`write()`; when it fails because the disk is full, free `folder`'s reserve and run it once more."""
    try:
        return write()
    except OSError as e:
        if not full(e) or not release(folder):
            raise
    return write()


def free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
