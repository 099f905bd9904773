"""The forms of a job's data and checkpoint settings, checked by the SDK before the job starts: no numpy or torch.

- `TOKEN_DTYPES`: the token files' element types by the name a job gives them (`token_dtype`), little-endian
  unsigned integers as numpy type codes;
- `check_location_form`: whether a string is a checkpoint location at all (no I/O).
"""
from __future__ import annotations

import re

TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4"}


def check_location_form(uri: str, *, relative: bool = True) -> None:
    """ValueError unless `uri` is `s3://bucket/...`, `file:///...` or a path (no I/O): `s3:/b` (one slash),
    `http://` and other schemes are mistakes. `relative=False`: a relative path is one too (in a job it would land
    in the job's code folder)."""
    if uri.startswith(("s3://", "file:///")):
        return
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    if scheme:
        hint = " (two slashes after s3:)" if scheme[1].lower() in ("s3", "file") else ""
        raise ValueError(f"checkpoint uri {uri!r}: not a checkpoint location; use s3://bucket/prefix{hint}, "
                         "file:///absolute/path or an absolute path")
    if not relative and not uri.startswith("/"):
        raise ValueError(f"checkpoint uri {uri!r} is a relative path, which in a job lands in its code folder; use "
                         "s3://bucket/prefix, file:///absolute/path or an absolute path")
