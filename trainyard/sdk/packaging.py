"""Code packaging: `sourcedir.tar.gz`, honouring ignore rules, content-addressed.

The archive is byte-for-byte reproducible (sorted entries, zero times and owners), so its SHA-256 names
it (`job/codearchive.py`): the same code gets the same key and is not uploaded twice, and an archive already
under that key is reused only when its bytes hash to the name (anyone who can write to the bucket could have
replaced it); the driver checks it again before it extracts it.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import sys
import tarfile
import tempfile
from dataclasses import dataclass

import pathspec

from trainyard.container import requirements
from trainyard.job import codearchive, storage
from trainyard.job.uris import join
from trainyard.sdk.jobs.live import Transfer, size_text

log = logging.getLogger("trainyard")

IGNORE_FILES = (".gitignore", ".trainyardignore")
# Never uploaded, whatever the ignore files say: VCS data, caches, virtualenvs and secrets.
DEFAULT_IGNORES = (".git/", "__pycache__/", "*.pyc", ".venv/", "venv/", ".env", ".env.*", ".ipynb_checkpoints/",
                   ".pytest_cache/", ".mypy_cache/", ".DS_Store")
WARN_BYTES = 50 * 1024 * 1024  # above this a warning names the largest files


@dataclass(frozen=True, slots=True)
class Package:
    data: bytes
    sha256: str
    files: tuple[str, ...]

    @property
    def key(self) -> str:
        """Content-addressed name: `trainyard-code/<sha256>/sourcedir.tar.gz`."""
        return codearchive.key(self.sha256)


def _spec_for(directory: str) -> pathspec.PathSpec | None:
    lines: list[str] = []
    for name in IGNORE_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, errors="replace") as fh:
                lines += fh.read().splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines) if lines else None


def collect_files(source_dir: str) -> list[str]:
    """Relative paths of the files to package, sorted. Ignore files apply to their folder and below."""
    source_dir = os.path.abspath(source_dir)
    defaults = pathspec.GitIgnoreSpec.from_lines(DEFAULT_IGNORES)
    scoped: list[tuple[str, pathspec.PathSpec]] = []  # (folder relative to source_dir, its rules)
    out: list[str] = []

    def ignored(rel: str, is_dir: bool) -> bool:
        probe = rel + "/" if is_dir else rel
        if defaults.match_file(probe):
            return True
        for base, spec in scoped:
            if base == "" or rel.startswith(base + "/"):
                sub = probe if base == "" else probe[len(base) + 1 :]
                if spec.match_file(sub):
                    return True
        return False

    for dirpath, dirnames, filenames in os.walk(source_dir):
        rel_dir = os.path.relpath(dirpath, source_dir)
        rel_dir = "" if rel_dir == "." else rel_dir
        spec = _spec_for(dirpath)
        if spec is not None:
            scoped.append((rel_dir, spec))
        dirnames[:] = sorted(d for d in dirnames if not ignored(os.path.join(rel_dir, d) if rel_dir else d, True))
        for f in sorted(filenames):
            rel = os.path.join(rel_dir, f) if rel_dir else f
            if not ignored(rel, False) and not os.path.islink(os.path.join(dirpath, f)):
                out.append(rel)
    return sorted(out)


def package(source_dir: str | None, entry_file: str | None = None, dependencies: tuple[str, ...] = ()) -> Package:
    """Archive `source_dir` (or the single `entry_file` when there is no source_dir), with each of
    `dependencies` (folders or files, SageMaker's argument) at the top of the archive under its own name."""
    sources: dict[str, str] = {}  # path in the archive -> file on this machine
    if source_dir is not None:
        root = os.path.abspath(source_dir)
        sources.update({rel: os.path.join(root, rel) for rel in collect_files(source_dir)})
    elif entry_file is not None:
        sources[os.path.basename(entry_file)] = os.path.abspath(entry_file)
    elif not dependencies:
        raise ValueError("nothing to package")
    for dep in dependencies:
        name = os.path.basename(os.path.normpath(dep))
        if os.path.isdir(dep):
            sources.update({f"{name}/{rel}": os.path.join(os.path.abspath(dep), rel) for rel in collect_files(dep)})
        else:
            sources[name] = os.path.abspath(dep)
    files = sorted(sources)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in files:
            full = sources[rel]
            info = tarfile.TarInfo(rel)
            st = os.stat(full)
            info.size = st.st_size
            info.mode = 0o755 if st.st_mode & 0o111 else 0o644
            info.mtime = 0
            with open(full, "rb") as fh:
                tar.addfile(info, fh)
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, compresslevel=6) as g:
        g.write(raw.getvalue())
    data = gz.getvalue()
    if len(data) > WARN_BYTES:
        sizes = sorted(((os.path.getsize(sources[f]), f) for f in files), reverse=True)[:5]
        biggest = ", ".join(f"{f} ({s / 2**20:.1f} MiB)" for s, f in sizes)
        log.warning("the code package is %.0f MiB; largest files: %s. Add them to .trainyardignore "
                    "and pass data as inputs instead.", len(data) / 2**20, biggest)
    if "requirements.txt" in sources:
        with open(sources["requirements.txt"], errors="replace") as fh:
            changed = requirements.index_options(fh.read())
        if changed:  # said before anything ships: another index can serve a package of PyPI's name
            print(f"[trainyard] requirements.txt changes where pip finds packages: {', '.join(changed)}; the job's "
                  "hosts install from there", file=sys.stderr)
    return Package(data=data, sha256=hashlib.sha256(data).hexdigest(), files=tuple(files))


def upload(pkg: Package, code_location: str, s3=None) -> str:
    """Put the package under `code_location` unless the same content is already there; returns its URI.
    `s3`: the S3 client to use (EC2 jobs: the user's session's; default: `storage.s3_client()`). Says on
    stderr what it shipped (a bar while it uploads, on a terminal)."""
    uri = join(code_location, pkg.key)
    what = f"code: {len(pkg.files)} file(s), {size_text(len(pkg.data))} packaged"
    if storage.exists(uri, s3=s3):
        if codearchive.matches(storage.get_bytes(uri, s3=s3), uri):
            print(f"[trainyard] {what}; {uri} has the same content already, not uploaded", file=sys.stderr)
            return uri
        print(f"[trainyard] {uri} does not hold the code its name says (it was replaced after it was uploaded): "
              "uploading it again; check who can write to that bucket", file=sys.stderr)
    with tempfile.NamedTemporaryFile(suffix=".tar.gz") as tmp:
        tmp.write(pkg.data)
        tmp.flush()
        with Transfer(f"{what}, uploaded to {uri}", len(pkg.data)) as t:
            storage.put_file(tmp.name, uri, s3=s3, progress=t.advance)
    return uri
