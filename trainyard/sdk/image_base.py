"""What the CPU variant of the training image is built on, and what a build borrows from this machine.

The base (`ensure_base`): a Debian rootfs with Python, its venv module and CA certificates, made by mmdebstrap
(Debian's tool: no daemon, no registry) and imported into the engine's image store as
`localhost/trainyard-base:<suite>-<12 hex>`. The hex is a digest of what makes it (suite, packages, mirror,
options), so the base is made once per machine and reused by every build until one of them changes: the
cache is the engine's own store. mmdebstrap's `apt` variant keeps it small (about 120 MB): no documentation,
man pages or locales, and /usr merged.

The build's view of this machine's pip (`PipMounts`): the index, extra indexes, local wheel folders, CA bundle
and settings that pip here uses (`pip config list`, PIP_* variables), rewritten into a pip.conf that points at
read-only mounts under /run/trainyard-pip, plus a constraints file that pins every package the SDK's own
environment has to the version it has (the image then holds the versions this SDK runs with, and pip does
not spend minutes backtracking through new releases). The mounts exist only while a RUN step runs; nothing of
them is written into the image (tests/image checks the history, environment and files).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from trainyard.errors import ImageError

SUITE = "bookworm"  # Debian 12: Python 3.11, which Trainyard supports
PACKAGES = ("python3", "python3-venv", "ca-certificates")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
BASE_REPOSITORY = "localhost/trainyard-base"
MOUNT = "/run/trainyard-pip"  # where the RUN steps find pip.conf (the Dockerfile reads it from there only)
# what keeps the rootfs small: documentation, manual pages and locales are not unpacked
DPKG_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
# pip settings carried into the build; values that are local paths are mounted
_PATH_KEYS = ("find-links", "cert", "client-cert", "constraint")
_URL_KEYS = ("index-url", "extra-index-url")
_PLAIN_KEYS = ("trusted-host", "timeout", "default-timeout", "retries", "no-index", "prefer-binary")


def _say(msg: str) -> None:
    print(f"trainyard image: {msg}", flush=True)


def apt_mirror(sources_dir: str = "/etc/apt") -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources), else deb.debian.org."""
    found: list[str] = []
    for root, _, names in os.walk(sources_dir):
        for name in sorted(names):
            if name.endswith((".sources", ".list")) and "security" not in name:
                try:
                    text = open(os.path.join(root, name)).read()
                except OSError:
                    continue
                found += re.findall(r"^URIs:\s*(\S+/debian)/?\s*$", text, re.M)
                found += re.findall(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)/?\s+", text, re.M)
    return found[0] if found else DEFAULT_MIRROR


def base_ref(mirror: str) -> str:
    h = hashlib.sha256("\0".join([SUITE, *PACKAGES, mirror, *DPKG_EXCLUDES, "merged-usr", "apt"]).encode())
    return f"{BASE_REPOSITORY}:{SUITE}-{h.hexdigest()[:12]}"


def mmdebstrap_command(tarball: str, mirror: str) -> list[str]:
    cmd = ["mmdebstrap", "--variant=apt", f"--include={','.join(PACKAGES)}"]
    cmd += [f"--dpkgopt=path-exclude={p}" for p in DPKG_EXCLUDES]
    hooks = "/usr/share/mmdebstrap/hooks/merged-usr"
    if os.path.isdir(hooks):
        cmd.append(f"--hook-dir={hooks}")
    return [*cmd, SUITE, tarball, mirror]


def ensure_base(engine: str, base: list[str], runner=subprocess.run, which=shutil.which, exists=None) -> str:
    """The reference of the CPU base in the engine's store, made now when it is not there (mmdebstrap, then an
    import). `exists(ref)` says whether the store has it."""
    mirror = apt_mirror()
    ref = base_ref(mirror)
    if exists is not None and exists(ref):
        return ref
    if not which("mmdebstrap"):
        raise ImageError("the CPU image's base is a Debian rootfs made by mmdebstrap, which is not installed: "
                         "`sudo apt-get install mmdebstrap` (Debian/Ubuntu)")
    with tempfile.TemporaryDirectory(prefix="trainyard-base-") as tmp:
        tarball = os.path.join(tmp, "rootfs.tar")
        _say(f"making the Debian {SUITE} base ({', '.join(PACKAGES)}) with mmdebstrap from {mirror} (about a "
             "minute or two, once per machine)")
        r = runner(mmdebstrap_command(tarball, mirror), check=False)
        if r.returncode != 0:
            raise ImageError(f"mmdebstrap failed with exit status {r.returncode} (its output is above); check that "
                             f"{mirror} can be reached")
        _say(f"importing it as {ref}")
        r = runner(import_command(engine, base, tarball, ref), check=False)
        if r.returncode != 0:
            raise ImageError(f"{engine} could not import the base ({r.returncode}); its output is above")
    return ref


def import_command(engine: str, base: list[str], tarball: str, ref: str) -> list[str]:
    if engine == "buildah":  # buildah has no import: a container from scratch with the tree, committed
        script = f'c=$({base[0]} from scratch) && {base[0]} add "$c" {tarball} / && {base[0]} commit "$c" {ref} ' \
                 f'&& {base[0]} rm "$c"'
        return ["sh", "-c", script]
    return [*base, "import", tarball, ref]


# -- this machine's pip, for the build ------------------------------------------------------------------


@dataclass
class PipMounts:
    """A folder with pip.conf (and the constraints and CA bundle it names) to mount at MOUNT, and the other
    local paths pip.conf refers to, each mounted read-only at its place under MOUNT."""

    folder: str
    volumes: list[tuple[str, str]] = field(default_factory=list)
    """(path here, path in the build) of every mount, the folder first."""
    torch_wheel_here: bool = False
    """Whether pip here finds a CPU wheel of torch in a local folder (then the build needs no PyTorch index)."""

    def args(self) -> list[str]:
        return [a for here, there in self.volumes for a in ("--volume", f"{here}:{there}:ro")]

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def pip_settings(python: str = sys.executable, runner=subprocess.run) -> dict[str, str]:
    """pip's effective settings here (`pip config list`: files, then PIP_* variables), by option name."""
    r = runner([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    out: dict[str, str] = {}
    for line in (r.stdout or "").splitlines():
        m = re.match(r"^(?:[^.]*)\.([a-z-]+)='(.*)'$", line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def pip_mounts(torch_version: str, settings: dict[str, str] | None = None, *, folder: str | None = None,
               pins: bool = True) -> PipMounts:
    """This machine's pip settings as a pip.conf for a build (or a local job's containers, whose
    requirements.txt installs as in host mode), with every local path mounted; with `pins`, the constraints of
    the SDK's environment too. `folder`: where the files go (default: a new temporary folder)."""
    settings = pip_settings() if settings is None else settings
    if folder is None:
        folder = tempfile.mkdtemp(prefix="trainyard-pip-")
    else:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    mounts = PipMounts(folder, [(folder, MOUNT)])
    lines = ["[global]"]

    def mount(path: str) -> str:
        inside = f"{MOUNT}/m{len(mounts.volumes)}"
        os.makedirs(os.path.join(folder, f"m{len(mounts.volumes)}"), exist_ok=True)  # the mount point
        mounts.volumes.append((os.path.realpath(path), inside))
        return inside

    constraints = [f"{MOUNT}/constraints.txt"] if pins else []
    for key, value in settings.items():
        if key in _PATH_KEYS:
            kept = []
            for item in value.split():
                local = item[len("file://"):] if item.startswith("file://") else item
                if "://" in item and not item.startswith("file://"):
                    kept.append(item)  # a URL (find-links may be one)
                elif os.path.exists(local):
                    if key == "find-links" and os.path.isdir(local) and any(
                            f.startswith(f"torch-{torch_version}+cpu-") for f in os.listdir(local)):
                        mounts.torch_wheel_here = True
                    if os.path.isfile(local):  # a file goes in the folder (a mount point must be a folder)
                        name = f"f{len(lines)}-{os.path.basename(local)}"
                        shutil.copyfile(local, os.path.join(folder, name))
                        kept.append(f"{MOUNT}/{name}")
                    else:
                        kept.append(mount(local))
            if key == "constraint":
                constraints += kept
            elif kept:
                lines.append(f"{key} = {' '.join(kept)}")
        elif key in _URL_KEYS:
            urls = []
            for u in value.split():
                path = u[len("file://"):].rstrip("/") if u.startswith("file://") else None
                if path is None:
                    urls.append(u)
                elif os.path.isdir(path):  # a local index's pages may point next to it (../files/...):
                    parent, leaf = os.path.split(path)  # its parent goes in, and the URL names the index within
                    urls.append(f"file://{mount(parent)}/{leaf}")
            if urls:
                lines.append(f"{key} = {' '.join(urls)}")
        elif key in _PLAIN_KEYS:
            lines.append(f"{key} = {value}")
    if pins:
        with open(os.path.join(folder, "constraints.txt"), "w") as fh:
            fh.write(environment_constraints())
    if constraints:
        lines.append(f"constraint = {' '.join(constraints)}")
    with open(os.path.join(folder, "pip.conf"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return mounts


def environment_constraints() -> str:
    """`name==version` of every distribution of the SDK's environment but Trainyard itself (the image installs
    the context's), torch (pinned by the Dockerfile, from its own index) and pip's own tools."""
    pins = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name and name not in ("trainyard", "torch", "pip", "setuptools", "wheel") and dist.version:
            pins[name] = dist.version
    return "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))
