"""The job's code on a host: `sourcedir.tar.gz` fetched, checked against the SHA-256 its name carries
(`job/codearchive.py`), and extracted into the code folder with nothing but regular files and folders.

Python's own `data` filter is applied too where the Python has it (3.11.4 and later; the CPU image's Debian
Python 3.11.2 has none), but not relied on: in Python 3.11.7 it can be bypassed with
crafted symbolic and hard links (CVE-2025-4517), and the SDK's archives hold only regular files. So a member
that is a link, a device or a FIFO, an absolute name, a `..` part, or a name longer than the file system
takes is refused before anything is written, naming the member.
"""
from __future__ import annotations

import io
import os
import tarfile

from trainyard.job import codearchive, storage

MAX_NAME = 1024  # bytes of a member's path: the SDK's archives hold repository paths, far below PATH_MAX


class UnsafeArchive(Exception):
    """A code archive with a member the driver does not extract."""


def fetch_code(code_uri: str, code_dir: str) -> None:
    """Download, verify and extract the code archive (TamperedCode / UnsafeArchive before anything is written)."""
    codearchive.check_name(code_uri)
    data = storage.get_bytes(code_uri)
    codearchive.check(data, code_uri)
    extract(data, code_dir)


def _check_member(m: tarfile.TarInfo) -> None:
    name = m.name
    parts = name.split("/")
    if not (m.isreg() or m.isdir()):
        raise UnsafeArchive(f"the code archive's member {name!r} is not a regular file or folder (a link, device or "
                            "FIFO); not extracted")
    if name.startswith("/") or ".." in parts or "\x00" in name or len(name.encode()) > MAX_NAME or \
            any(len(p.encode()) > 255 for p in parts):
        raise UnsafeArchive(f"the code archive's member {name[:200]!r} has an absolute, '..' or over-long path; "
                            "not extracted")


def extract(data: bytes, code_dir: str) -> None:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
        for m in members:
            _check_member(m)
        files = {m.name.rstrip("/") for m in members if m.isreg()}
        for m in members:  # a name that is a file and, in another member, a folder (or a file twice)
            parts = m.name.rstrip("/").split("/")
            clash = next(("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in files), None)
            if clash is not None or (m.isdir() and m.name.rstrip("/") in files):
                raise UnsafeArchive(f"the code archive's member {clash or m.name!r} is both a file and a folder; "
                                    "not extracted")
        if len(files) != sum(1 for m in members if m.isreg()):
            raise UnsafeArchive("the code archive holds a file twice; not extracted")
        os.makedirs(code_dir, exist_ok=True)
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later (Debian 12's 3.11.2 has no filters)
            tar.extractall(code_dir, members=members, filter="data")
        else:  # the checks above admit regular files and folders with plain relative names only
            tar.extractall(code_dir, members=members)
