"""A job's `requirements.txt`, installed before its entry point runs (SageMaker's training toolkit does the
same), into an overlay: never into the Python environment that runs the job.

When `<code_dir>/requirements.txt` exists (or `pins` are given), `prepare()`:

1. names the overlay `<cache_root>/<key>`, key = sha256 of the requirements file's bytes, of the local
   files it refers to (`./wheels/x.whl`, `-r other.txt`, `--find-links ./wheels`: a file's bytes, a
   folder's listing with sizes and mtimes), of the Python (version, executable, `sys.prefix`), of what
   that Python already has installed (every distribution's name and version) and of `PYTHONPATH`; with an
   editable requirement (`-e ./pkg`) the code folder's path too, since the install points there;
2. takes `<cache_root>/<key>.lock` (fcntl, exclusive): the hosts of one job on one machine, or two jobs,
   install a given overlay once; the others wait, then reuse it;
3. reuses the overlay when its marker `<overlay>/.trainyard-complete` exists (written atomically, last, on
   success only); otherwise deletes whatever a killed install left there and runs
       python -m pip install --prefix <overlay> -r requirements.txt \
           --disable-pip-version-check --no-input --no-user --progress-bar off --no-warn-script-location
   in `code_dir` (relative paths in the file work as on SageMaker), each line of its output logged
   (`pip: ...`). pip's own variables in the environment (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_NO_INDEX,
   PIP_FIND_LINKS, ...) apply; PIP_TARGET, PIP_PREFIX, PIP_ROOT and PIP_USER do not (they would move the
   install out of the overlay).

What pip installs: a requirement that the running environment already satisfies ("Requirement already
satisfied": torch, numpy, trainyard, ...) is not installed again; the rest (and a different version of an
installed package, `numpy==1.26` next to 2.x) goes into the overlay, which comes first on the path and so
wins. pip's `--prefix` alone would also *uninstall* the environment's conflicting copy (measured, pip 23
and 26: "Attempting uninstall ... Successfully uninstalled"): pip removes only what lies under `sys.prefix`,
so pip runs with `sys.prefix` set to the overlay ("Not uninstalling numpy at ..., outside environment").

The returned `Overlay` says where the packages are: `activate(environ)` puts its site-packages first on
`PYTHONPATH` and its `bin` (console scripts, which run this same Python) first on `PATH`, so every rank that
torchrun starts sees them. A failed install raises `RequirementsError`; its message starts with pip's
`ERROR:` lines, then pip's last lines, and nothing is cached.

pip resolves the file against itself and only warns when the overlay breaks the environment's packages
(an older huggingface_hub under datasets). `check_conflicts` finds those (`pip check` with the overlay first
finds a requirement that it did not find without it); pip then runs again with the broken packages named too,
so that it resolves versions of them that fit (`_install`, up to `RESOLVE_PASSES` runs), and what still
breaks raises `RequirementsError` naming each requirement.

`pins` install with the file as if they were lines of it: `framework_pins` turns the HF estimator's
`transformers_version` into one where the environment has another major version of transformers. Overlays
are never deleted: `cache_root` is the place to clean.
"""
from __future__ import annotations

import collections
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REQUIREMENTS = "requirements.txt"
CACHE_ENV = "TRAINYARD_REQUIREMENTS_CACHE"
MARKER = ".trainyard-complete"
TAIL_LINES = 20
RESOLVE_PASSES = 4  # installs of an overlay, each naming more of the environment's packages it breaks
FRAMEWORK_PACKAGES = {"transformers_version": "transformers"}  # versions an overlay can honour (not torch's)
PLATFORM = frozenset({"trainyard", "torch"})  # never installed into an overlay to fit it: the job runs on these
# pip's settings that would send the install somewhere other than the overlay
DROPPED_PIP_ENV = ("PIP_TARGET", "PIP_PREFIX", "PIP_ROOT", "PIP_USER")
# pip in a process whose sys.prefix is the overlay (argv[1]): the running environment is then "outside
# environment" for pip, which never uninstalls from it. -P: code_dir (the cwd) is not put on sys.path.
_PIP_BOOT = ("import runpy, sys; sys.prefix = sys.argv[1]; sys.argv = ['pip', *sys.argv[2:]]; "
             "runpy.run_module('pip', run_name='__main__', alter_sys=True)")
# pip's variables for a --prefix install (pip/_internal/locations/_sysconfig.py, _HOME_KEYS)
_PREFIX_KEYS = ("installed_base", "base", "installed_platbase", "platbase", "prefix", "exec_prefix")


class RequirementsError(RuntimeError):
    """pip failed; the message carries pip's own error lines."""


@dataclass
class Overlay:
    path: str                                            # the overlay (pip's --prefix)
    site_packages: str                                   # its purelib folder, first on PYTHONPATH
    pythonpath: list[str] = field(default_factory=list)  # the folders that exist, site_packages first
    bin_dir: str | None = None                           # console scripts, when pip wrote any
    installed: list[str] = field(default_factory=list)   # "name==version" of what pip installed
    reused: bool = False

    def activate(self, environ) -> None:
        """Put the overlay first on `PYTHONPATH` and `PATH` in `environ`, keeping what is there."""
        for var, dirs in (("PYTHONPATH", self.pythonpath), ("PATH", [self.bin_dir] if self.bin_dir else [])):
            if dirs:
                environ[var] = os.pathsep.join([*dirs, *[p for p in environ.get(var, "").split(os.pathsep) if p]])

    def summary(self) -> str:
        if self.reused:
            return f"reused {self.path}"
        what = f"installed {len(self.installed)} package(s) into {self.path}"
        return what + (f" ({', '.join(self.installed)})" if self.installed else ": all already satisfied")


def default_cache_root(environ=None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get(CACHE_ENV) or os.path.expanduser("~/.cache/trainyard/requirements")


def prepare(code_dir: str, cache_root: str, say: Callable[[str], None] = print,
            python: str = sys.executable, pins: Sequence[str] = ()) -> Overlay | None:
    """Install `<code_dir>/requirements.txt` and `pins` (requirement strings: the framework versions the job
    asks for, `framework_pins`) into their overlay under `cache_root` (or reuse it). None when there is
    neither. Raises `RequirementsError` when pip fails, or when no install fits the environment's packages."""
    has_file = os.path.isfile(os.path.join(code_dir, REQUIREMENTS))
    if not has_file and not pins:
        return None
    os.makedirs(cache_root, exist_ok=True)
    key = overlay_key(code_dir, pins)
    path = os.path.join(os.path.abspath(cache_root), key)
    with open(f"{path}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"requirements.txt: waiting for another process installing the same requirements into {path}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            marker = os.path.join(path, MARKER)
            if os.path.isfile(marker):
                with open(marker) as fh:
                    done = json.load(fh)
                return _overlay(path, done["installed"], reused=True)
            if has_file:
                with open(os.path.join(code_dir, REQUIREMENTS), errors="replace") as fh:
                    changed = index_options(fh.read())
                if changed:
                    say(f"requirements.txt: pip looks for packages where the file says: {', '.join(changed)}")
            try:
                overlay = _install(python, path, code_dir, has_file, list(pins), say)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            tmp = f"{marker}.tmp"
            with open(tmp, "w") as fh:
                json.dump({"installed": overlay.installed, "created": time.time()}, fh)
            os.replace(tmp, marker)
            return overlay
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _install(python: str, path: str, code_dir: str, has_file: bool, pins: list[str],
             say: Callable[[str], None]) -> Overlay:
    """pip into a fresh overlay at `path`. When the overlay breaks packages of the environment (an older
    huggingface_hub under datasets), pip runs again from scratch with those packages named too, so that it
    resolves versions of them that fit the overlay, against the whole environment; what those break in turn
    (an older fsspec under s3fs) joins them, up to `RESOLVE_PASSES` installs. The platform (`PLATFORM`:
    trainyard, torch) is never installed again. What still breaks raises `RequirementsError`, naming first
    what the file itself broke."""
    what = " + ".join([*([REQUIREMENTS] if has_file else []), *pins])
    dependents: list[str] = []
    first: list[str] = []  # what the file's own install broke: the cause a user can act on
    installed: list[str] = []
    broken: list[str] = []
    for attempt in range(RESOLVE_PASSES):
        if os.path.lexists(path):  # a killed install, or an earlier pass: never reused
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        os.makedirs(path)
        _copy_site_config(path)
        args = [*(["-r", REQUIREMENTS] if has_file else []), *pins, *dependents]
        say(f"requirements.txt: pip install {shlex.join(args)} --prefix {path}")
        try:
            _run_pip(python, path, code_dir, say, args)
        except RequirementsError as e:
            if not attempt:
                raise
            raise RequirementsError(f"{broken_message(what, first, broken)}\nand pip found no versions of "
                                    f"{', '.join(dependents)} that fit it: {e}") from None
        overlay = _overlay(path, _distributions(_paths(path)), reused=False)
        if not overlay.installed:
            return overlay
        installed, broken = overlay.installed, check_conflicts(python, overlay)
        first = first or broken
        if not broken:
            return overlay
        ours = {_canonical(i.split("==")[0]) for i in installed}
        needing = {_canonical(line.split()[0]) for line in broken}
        more = sorted(needing - ours - set(dependents))
        if not more or needing & PLATFORM:  # nothing left to try, or it would replace the platform itself
            break
        dependents = sorted({*dependents, *more})
        say(f"requirements.txt: {', '.join(installed)} break(s) what {', '.join(more)} of the environment "
            "need(s) (pip check): installing versions of those that fit, into the overlay")
    raise RequirementsError(broken_message(what, first, broken))


def broken_message(what: str, first: list[str], last: list[str]) -> str:
    """The refusal: what the file's own install broke (the cause), then what still broke after resolving."""
    def shown(lines: list[str]) -> list[str]:
        return lines[:6] + ([f"... and {len(lines) - 6} more"] if len(lines) > 6 else [])

    text = (f"requirements.txt: what {what} installs breaks {len(first)} requirement(s) of the packages the "
            "environment has (pip check):\n" + "\n".join(shown(first)))
    if last and last != first:
        text += "\nand installing versions of those that fit it still breaks:\n" + "\n".join(shown(last))
    return text + ("\nPin versions that the environment's packages accept (or drop the line: the environment has "
                   "its own), so that nothing is shadowed by an older copy")


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def framework_pins(framework: dict, code_dir: str | None,
                   have: Callable[[str], str | None] = installed_version) -> list[str]:
    """The requirement pins that give a job the framework versions it asks for (the HF estimator's
    `transformers_version='4.26'` -> `transformers==4.26.*`) where the environment has another major version
    (`have(package)`: its version, or None); never a package that the code's requirements.txt names."""
    named = set()
    req = os.path.join(code_dir or "", REQUIREMENTS)
    if code_dir and os.path.isfile(req):
        with open(req, errors="replace") as fh:
            for line in fh:
                token = line.split("#", 1)[0].strip()
                if token and not token.startswith("-"):
                    named.add(_canonical(re.split(r"[\s\[<>=!~;@]", token, maxsplit=1)[0]))
    pins = []
    for argument, package in FRAMEWORK_PACKAGES.items():
        asked = str(framework.get(argument) or "")
        if not asked or _canonical(package) in named:
            continue
        current = have(package)
        if current is None or current.split(".")[0] != asked.split(".")[0]:
            parts = asked.split(".")
            pins.append(f"{package}=={asked}" + (".*" if len(parts) < 3 else ""))
    return pins


# options that change where pip finds packages: a package of the same name on another index can replace PyPI's
# (dependency confusion), and a trusted host is fetched without checking its certificate
INDEX_OPTIONS = ("-i", "--index-url", "--extra-index-url", "--trusted-host", "-f", "--find-links", "--no-index")


def index_options(text: str) -> list[str]:
    """The options of a requirements file that change where pip finds packages, as written (with their value)."""
    found = []
    for line in text.splitlines():
        tokens = _tokens(line)
        for i, token in enumerate(tokens):
            name = token.split("=", 1)[0]
            if name in INDEX_OPTIONS:
                value = token.split("=", 1)[1] if "=" in token else (tokens[i + 1] if i + 1 < len(tokens) and
                                                                    name != "--no-index" else "")
                found.append(f"{name} {value}".strip())
    return found


def overlay_key(code_dir: str, pins: Sequence[str] = ()) -> str:
    h = hashlib.sha256(b"trainyard-requirements-1\0")
    req = os.path.join(code_dir, REQUIREMENTS)
    editable = False
    seen: set[str] = set()
    todo = [req] if os.path.isfile(req) else []
    for pin in pins:
        h.update(f"\0pin {pin}".encode())
    while todo:  # the requirements file, and every local file or folder it (or a file it includes) names
        p = os.path.realpath(todo.pop())
        if p in seen:
            continue
        seen.add(p)
        h.update(f"\0path {os.path.relpath(p, os.path.realpath(code_dir))}\0".encode())
        if os.path.isdir(p):
            _hash_tree(h, p)
            continue
        with open(p, "rb") as fh:
            data = fh.read()
        h.update(data)
        if p.endswith(".txt") or p == os.path.realpath(req):
            for line in data.decode(errors="replace").splitlines():
                tokens = _tokens(line)
                editable = editable or any(t in ("-e", "--editable") or t.startswith("--editable=") for t in tokens)
                for t in tokens:
                    local = _local_path(t, code_dir)
                    if local:
                        todo.append(local)
    if editable:  # the install points at the code folder itself
        h.update(f"\0editable {os.path.realpath(code_dir)}".encode())
    installed = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    for part in (sys.version, sys.executable, os.path.realpath(sys.prefix), os.environ.get("PYTHONPATH", ""),
                 *installed):
        h.update(f"\0{part}".encode())
    return h.hexdigest()[:32]


def _tokens(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split("#", 1)[0].split()


def _local_path(token: str, code_dir: str) -> str | None:
    if token.startswith("-"):
        token = token.partition("=")[2]
    for scheme in ("file://", "file:"):
        if token.startswith(scheme):
            token = token[len(scheme):]
            break
    token = token.split("#", 1)[0]
    if not token:
        return None
    p = os.path.join(code_dir, token)
    return p if os.path.exists(p) else None


def _hash_tree(h, top: str) -> None:
    for d, dirs, files in os.walk(top):
        dirs[:] = sorted(x for x in dirs if x not in (".git", "__pycache__"))
        for f in sorted(files):
            try:
                st = os.stat(os.path.join(d, f))
            except OSError:
                continue
            h.update(f"\0{os.path.relpath(os.path.join(d, f), top)} {st.st_size} {st.st_mtime_ns}".encode())


def _copy_site_config(path: str) -> None:
    """pip reads a site config at `<sys.prefix>/pip.conf`; its process sees the overlay as sys.prefix."""
    conf = os.path.join(sys.prefix, "pip.conf")
    if os.path.isfile(conf):
        shutil.copy(conf, os.path.join(path, "pip.conf"))


def _run_pip(python: str, path: str, code_dir: str, say: Callable[[str], None], args: list[str]) -> None:
    cmd = [python, "-P", "-c", _PIP_BOOT, path, "install", "--prefix", path, *args,
           "--disable-pip-version-check", "--no-input", "--no-user", "--progress-bar", "off",
           "--no-warn-script-location"]
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_PIP_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    last: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    errors: list[str] = []
    proc = subprocess.Popen(cmd, cwd=code_dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    with proc:
        for line in proc.stdout:
            line = line.rstrip()
            if not line:
                continue
            say(f"pip: {line}")
            last.append(line)
            if line.startswith("ERROR:"):
                errors.append(line)
    if proc.returncode != 0:  # pip's ERROR lines first: a FailureReason keeps only its first 1024 characters
        head = errors[:3] or ["(pip wrote no ERROR line)"]
        raise RequirementsError(f"pip install {shlex.join(args)} failed (exit {proc.returncode}): "
                                + "\n".join([*head, "pip's last lines:", *last]))


def _pip_check(python: str, environ: dict) -> set[str]:
    """`pip check`'s findings (one per line: "x 1.0 has requirement y>=2, but you have y 1.5.") for the
    distributions that a process with `environ` sees."""
    env = {k: v for k, v in environ.items() if k not in DROPPED_PIP_ENV}
    proc = subprocess.run([python, "-P", "-m", "pip", "check", "--disable-pip-version-check", "--no-input"],
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace")
    return {line.strip() for line in proc.stdout.splitlines() if line.strip() and "No broken requirements" not in line}


def check_conflicts(python: str, overlay: Overlay, environ=None) -> list[str]:
    """What `pip check` finds with the overlay first on the path and not without it: each requirement of an
    installed package that the overlay breaks (a package it shadows with a version another installed package
    does not accept, or one it adds whose own requirements are not met). pip's install only warns of these
    ("pip's dependency resolver does not currently take into account...") and exits 0; the script would then
    fail at an import, far from the cause. The environment's own, older conflicts are not the overlay's."""
    environ = dict(os.environ if environ is None else environ)
    before = _pip_check(python, environ)
    with_overlay = dict(environ)
    overlay.activate(with_overlay)
    return sorted(_pip_check(python, with_overlay) - before)


def _paths(path: str) -> list[str]:
    """The folders pip's --prefix install writes modules to: pip's process sees itself in a virtual
    environment (sys.prefix != sys.base_prefix), so it takes the `venv` scheme, `posix_prefix` before 3.11;
    plus any other folder holding a distribution, should a patched Python put one elsewhere."""
    scheme = "venv" if "venv" in sysconfig.get_scheme_names() else "posix_prefix"
    vars_ = {k: path for k in _PREFIX_KEYS}
    found = [sysconfig.get_path(k, scheme, vars_) for k in ("purelib", "platlib")]
    for d, dirs, _ in os.walk(path):
        if any(x.endswith((".dist-info", ".egg-info")) for x in dirs):
            found.append(d)
        if d.count(os.sep) - path.count(os.sep) >= 4:
            dirs[:] = []
    return list(dict.fromkeys(os.path.normpath(p) for p in found))


def _distributions(paths: list[str]) -> list[str]:
    return sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions(path=paths))


def _overlay(path: str, installed: list[str], reused: bool) -> Overlay:
    paths = _paths(path)
    scripts = sysconfig.get_path("scripts", "venv" if "venv" in sysconfig.get_scheme_names() else "posix_prefix",
                                 {k: path for k in _PREFIX_KEYS})
    return Overlay(path=path, site_packages=paths[0], pythonpath=[p for p in paths if os.path.isdir(p)],
                   bin_dir=scripts if os.path.isdir(scripts) and os.listdir(scripts) else None,
                   installed=list(installed), reused=reused)
