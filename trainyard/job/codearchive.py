"""The code archive's name and its check, shared by the SDK (which names and uploads it) and the driver (which
runs it): `<code_location>/trainyard-code/<sha256>/sourcedir.tar.gz`, named by the SHA-256 of its bytes.

So the archive carries its own check: whoever can write to the bucket cannot make a host run other code under
that name. The SDK compares an archive already there before it reuses it (`matches`), and the driver refuses
one whose bytes do not hash to its name (`check`). Names from before the full digest carry its first 24 hex
digits (96 bits), which are checked the same way.
"""
from __future__ import annotations

import hashlib
import re

PREFIX = "trainyard-code"
ARCHIVE = "sourcedir.tar.gz"
_NAME = re.compile(rf"(?:^|/){PREFIX}/([0-9a-f]{{24,64}})/{re.escape(ARCHIVE)}$")


class TamperedCode(Exception):
    """A code archive whose bytes are not the ones its name promises, or a name that promises nothing."""


def key(sha256: str) -> str:
    """The archive's key under a code location: `trainyard-code/<sha256>/sourcedir.tar.gz`."""
    return f"{PREFIX}/{sha256}/{ARCHIVE}"


def digest_of(uri: str) -> str | None:
    """The digest (or its 24-digit prefix) a code archive's URI names; None when it names none."""
    m = _NAME.search(uri)
    return m.group(1) if m else None


def matches(data: bytes, uri: str) -> bool:
    """Whether `data` is what the content-addressed `uri` names."""
    digest = digest_of(uri)
    return digest is not None and hashlib.sha256(data).hexdigest().startswith(digest)


def check_name(uri: str) -> str:
    """The digest `uri` names (TamperedCode when it names none: code that cannot be verified is not run)."""
    digest = digest_of(uri)
    if digest is None:
        raise TamperedCode(f"the code archive {uri} is not named by its SHA-256 ({PREFIX}/<sha256>/{ARCHIVE}): the "
                           "driver runs only code it can verify; upload it with the Trainyard SDK")
    return digest


def check(data: bytes, uri: str) -> None:
    """TamperedCode unless `data` hashes to the digest in `uri`."""
    digest = check_name(uri)
    actual = hashlib.sha256(data).hexdigest()
    if not actual.startswith(digest):
        raise TamperedCode(f"the code archive {uri} was changed after it was uploaded: its SHA-256 is {actual}, its "
                           f"name says {digest}; refusing to run it (fit() again uploads the right one; check who "
                           "can write to that bucket)")
