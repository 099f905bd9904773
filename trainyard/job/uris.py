"""Storage URIs: parsing and validation. Paths stay `str` (pathlib folds `s3://` into `s3:/`)."""
from __future__ import annotations

import re

from trainyard.errors import ConfigError

# S3 bucket naming rules: 3-63 characters, lower-case letters, digits, dots and hyphens,
# starting and ending with a letter or digit.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def split_s3(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> (`bucket`, `some/key`). Assumes a validated URI."""
    rest = uri[len("s3://") :]
    bucket, _, key = rest.partition("/")
    return bucket, key


def check_s3_uri(field: str, uri: object) -> str:
    """Return `uri` if it is a well-formed `s3://bucket[/key]` URI, else raise ConfigError on `field`."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ConfigError(field, f"expected an s3:// URI such as 's3://my-bucket/prefix', got {uri!r}")
    bucket, key = split_s3(uri)
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ConfigError(
            field,
            f"{uri!r} has an invalid bucket name {bucket!r}: use 3-63 lower-case letters, digits, "
            "'.' or '-', starting and ending with a letter or digit",
        )
    if "//" in key or key.startswith("/"):
        raise ConfigError(field, f"{uri!r} contains an empty path segment ('//'); remove the extra slash")
    if any(part in (".", "..") for part in key.split("/")):
        raise ConfigError(field, f"{uri!r} has a '.' or '..' part: S3 keeps it as a name, and every download "
                                 "refuses it; write the prefix itself, without it")
    if _CONTROL.search(uri):
        raise ConfigError(field, f"{uri!r} holds a control character (a NUL, a newline); write the URI without it")
    return uri


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_storage_uri(field: str, uri: object, schemes: tuple[str, ...] = ("s3", "file")) -> str:
    """Validate an `s3://` or `file://` URI (the schemes a field accepts are named in the error)."""
    allowed = ", ".join(f"{s}://" for s in schemes)
    if not isinstance(uri, str) or "://" not in uri:
        raise ConfigError(field, f"expected a URI with one of the schemes {allowed}, got {uri!r}")
    scheme = uri.split("://", 1)[0]
    if scheme not in schemes:
        raise ConfigError(field, f"unsupported scheme {scheme}:// in {uri!r}; use one of {allowed}")
    if scheme == "s3":
        return check_s3_uri(field, uri)
    if scheme == "fsx":
        return check_fsx_uri(field, uri)
    path = uri[len("file://") :]
    if not path.startswith("/"):
        raise ConfigError(field, f"{uri!r} must be an absolute path: file:///absolute/path")
    if _CONTROL.search(uri):
        raise ConfigError(field, f"{uri!r} holds a control character (a NUL, a newline); write the URI without it")
    return uri


_FSX_ID = re.compile(r"^fs-[0-9a-f]{8,17}$")


def check_fsx_uri(field: str, uri: str) -> str:
    """`fsx://fs-0123456789abcdef0/directory`: an FSx for Lustre file system and a folder in it."""
    fs_id, _, path = uri[len("fsx://"):].partition("/")
    if not _FSX_ID.match(fs_id):
        raise ConfigError(field, f"{uri!r}: {fs_id!r} is not an FSx file system id (fs- and 8 or 17 hex digits)")
    if "//" in path or ".." in path.split("/"):
        raise ConfigError(field, f"{uri!r}: the directory must be a plain path inside the file system")
    return uri


def split_fsx(uri: str) -> tuple[str, str]:
    """`fsx://fs-0123/data/x` -> ("fs-0123", "/data/x")."""
    fs_id, _, path = uri[len("fsx://"):].partition("/")
    return fs_id, "/" + path.strip("/")


def join(uri: str, *parts: str) -> str:
    """Join URI segments with exactly one '/' between them."""
    out = uri.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out
