"""EFA and NCCL settings by detection: what this machine (or container) has, not what its instance type
is supposed to have.

`detect()` looks at sysfs and the file system; `nccl_env()` turns what it found into the NCCL/libfabric
variables that are safe to set (REFERENCE.md, "AWS facts"):

- with EFA: `FI_EFA_USE_HUGE_PAGE=0` and `NCCL_SOCKET_IFNAME=^docker,lo,veth`; `FI_PROVIDER=efa` and
  `NCCL_PROTO=simple` only when the aws-ofi-nccl plugin is 1.5 or older (newer plugins choose the
  provider and the protocol themselves, and forcing `simple` costs bandwidth);
- without EFA: only `NCCL_SOCKET_IFNAME=^docker,lo,veth`;
- never `RDMAV_FORK_SAFE`, and never a variable the job (or the image) already set.

What is read, and what it assumes:

- EFA devices: every entry of `<sysfs>/class/infiniband/` is an RDMA device; it is an EFA device when
  `<entry>/device/driver` links to a driver named `efa` (the EFA kernel module binds its PCI functions
  under that name), or, when the driver link cannot be read, when the PCI function is Amazon's
  (`device/vendor` 0x1d0f) with a device id `0xefa*` (the installer's own test, `1d0f:efa`). Other RDMA
  devices (mlx5, rxe, ...) do not count. Docker mounts the host's /sys read-only into containers, so
  this sees the instance's devices; whether the container may use them is `/dev/infiniband/uverbs*`,
  which is counted separately (user data passes them with `--device`).
- GPUs: PCI functions under `<sysfs>/bus/pci/devices/` of NVIDIA (vendor 0x10de) in a display class
  (0x03xxxx); NVSwitches and other bridges of NVIDIA are not display devices. These are the host's GPUs,
  not only those given to the container.
- aws-ofi-nccl: its library in the plugin folders (`libnccl-net-ofi.so`, `libnccl-net.so`,
  `libnccl-net-aws-ofi.so`; the EFA installer puts them in /opt/amazon/ofi-nccl/lib or its
  `<arch>-linux-gnu` subfolder, source builds often in /opt/aws-ofi-nccl/lib; LD_LIBRARY_PATH's folders
  are searched first, as dlopen does), and its version from, in order: the library's own text (the
  plugin logs `Initializing aws-ofi-nccl 1.9.1-aws` from a string compiled into it: autoconf's package
  string), then the EFA installer's record `/opt/amazon/efa_installed_packages` (package file names
  such as `libnccl-ofi_1.16.2-1_amd64`). A plugin whose version cannot be read is treated as a current
  one (no FI_PROVIDER, no NCCL_PROTO), and the driver's line says the version is unknown.
- `fi_info` (libfabric's tool) on PATH or in /opt/amazon/efa/bin: recorded, never run.

All of it is a few directory listings and small reads: cheap, and harmless where nothing exists (the
local backend runs the same driver).
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass

# NCCL's own sockets (bootstrap, and the data path when no network plugin loads) avoid docker bridges,
# loopback and veth pairs: on an instance they would pick an address no peer can reach
SOCKET_IFNAME = "^docker,lo,veth"
EFA_DRIVER = "efa"
AMAZON_PCI_VENDOR = "0x1d0f"
EFA_PCI_DEVICE_PREFIX = "0xefa"  # efa0..efa3 so far; the EFA installer matches "1d0f:efa" the same way
NVIDIA_PCI_VENDOR = "0x10de"
DISPLAY_CLASS_PREFIX = "0x03"  # PCI base class 03: display controllers (VGA 0x0300, 3D 0x0302)
# the last plugin series that needs FI_PROVIDER=efa and NCCL_PROTO=simple spelled out (REFERENCE.md)
OLD_PLUGIN_MAX = (1, 5)

INSTALLED_PACKAGES = "/opt/amazon/efa_installed_packages"
PLUGIN_DIRS = (
    "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu",
    "/opt/amazon/ofi-nccl/lib/aarch64-linux-gnu",
    "/opt/amazon/ofi-nccl/lib",
    "/opt/amazon/aws-ofi-nccl/lib",
    "/opt/aws-ofi-nccl/lib",
)
# the names NCCL loads a network plugin by: libnccl-net.so by default, libnccl-net-<NCCL_NET_PLUGIN>.so
PLUGIN_NAMES = ("libnccl-net-ofi.so", "libnccl-net.so", "libnccl-net-aws-ofi.so")
FI_INFO_FALLBACK = "/opt/amazon/efa/bin/fi_info"
_PLUGIN_SCAN_BYTES = 64 * 2**20  # the plugin is 1-3 MB; a bigger file is not it, and is not read whole

_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
# `libnccl-ofi_1.16.2-1_amd64` (deb), `libnccl-ofi-1.16.2-1.amzn2.x86_64` (rpm), older `aws-ofi-nccl...`
_PACKAGE_VERSION = re.compile(r"(?:libnccl-ofi|aws-ofi-nccl|nccl-ofi)[-_](\d+\.\d+(?:\.\d+)?)")
_LIBRARY_VERSION = re.compile(rb"aws-ofi-nccl[ -]v?(\d+\.\d+(?:\.\d+)?)")


@dataclass(frozen=True, slots=True)
class Detection:
    """What `detect` found."""

    efa_devices: tuple[str, ...]
    """RDMA devices bound to the EFA driver (`rdmap16s27`, ...), sorted."""
    other_rdma_devices: tuple[str, ...]
    """RDMA devices of other drivers (`mlx5_0`, ...): reported, never used for EFA settings."""
    uverbs_devices: tuple[str, ...]
    """`/dev/infiniband/uverbs*` visible here: without them libfabric cannot open an EFA device."""
    gpus: int
    """NVIDIA display-class PCI functions in sysfs (the host's GPUs)."""
    ofi_nccl_plugin: str | None
    """Path of the aws-ofi-nccl library found, or None."""
    ofi_nccl_version: str | None
    """Its version (`1.9.1`), or None when no plugin was found or its version could not be read."""
    fi_info: str | None
    """Path of libfabric's `fi_info`, or None."""

    @property
    def efa(self) -> bool:
        return bool(self.efa_devices)

    @property
    def old_plugin(self) -> bool:
        """aws-ofi-nccl 1.5 or older: it needs FI_PROVIDER=efa and NCCL_PROTO=simple."""
        v = parse_version(self.ofi_nccl_version)
        return v is not None and v[:2] <= OLD_PLUGIN_MAX

    def describe(self) -> str:
        """`EFA: 4 device(s), aws-ofi-nccl 1.9.1`, `EFA: none`, ... (one clause of the driver's line)."""
        if not self.efa:
            text = "EFA: none"
            if self.other_rdma_devices:
                text += f" (other RDMA devices ignored: {', '.join(self.other_rdma_devices)})"
            return text
        text = f"EFA: {len(self.efa_devices)} device(s)"
        if self.ofi_nccl_version:
            text += f", aws-ofi-nccl {self.ofi_nccl_version}"
        elif self.ofi_nccl_plugin:
            text += ", aws-ofi-nccl (version unknown)"
        else:
            text += ", no aws-ofi-nccl plugin found (NCCL will use sockets)"
        if not self.uverbs_devices:
            text += ", but no /dev/infiniband/uverbs* here (not passed to the container?)"
        return text


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """`1.9.1-aws` -> (1, 9, 1); None for None or text without a leading dotted number."""
    if not text:
        return None
    m = re.match(r"v?(\d+(?:\.\d+)*)", text.strip())
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _link_name(path: str) -> str | None:
    try:
        return os.path.basename(os.readlink(path).rstrip("/"))
    except OSError:
        return None


def _is_efa(ib_dir: str) -> bool:
    driver = _link_name(os.path.join(ib_dir, "device", "driver"))
    if driver is not None:
        return driver == EFA_DRIVER
    vendor = _read(os.path.join(ib_dir, "device", "vendor"))
    device = _read(os.path.join(ib_dir, "device", "device")) or ""
    return vendor == AMAZON_PCI_VENDOR and device.lower().startswith(EFA_PCI_DEVICE_PREFIX)


def _count_gpus(sysfs: str) -> int:
    root = os.path.join(sysfs, "bus", "pci", "devices")
    n = 0
    for name in _listdir(root):
        if not _PCI_ADDRESS.match(name):
            continue
        if _read(os.path.join(root, name, "vendor")) == NVIDIA_PCI_VENDOR and \
                (_read(os.path.join(root, name, "class")) or "").startswith(DISPLAY_CLASS_PREFIX):
            n += 1
    return n


def _version_from_packages(path: str) -> str | None:
    text = _read(path)
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _PACKAGE_VERSION.search(line)
        if m:
            return m.group(1)
    return None


def _version_from_library(path: str) -> str | None:
    try:
        if os.path.getsize(path) > _PLUGIN_SCAN_BYTES:
            return None
        with open(path, "rb") as fh:
            m = _LIBRARY_VERSION.search(fh.read())
    except OSError:
        return None
    return m.group(1).decode() if m else None


def default_plugin_dirs(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Where NCCL would find the plugin: LD_LIBRARY_PATH's folders first (dlopen's order), then the usual
    install folders."""
    env = os.environ if environ is None else environ
    dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    return tuple(dict.fromkeys([*dirs, *PLUGIN_DIRS]))


def find_plugin(plugin_dirs: Iterable[str]) -> str | None:
    """The first aws-ofi-nccl library in `plugin_dirs` (in that order), or None."""
    for d in plugin_dirs:
        for name in PLUGIN_NAMES:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return path
    return None


def detect(
    sysfs: str = "/sys",
    *,
    which: Callable[[str], str | None] = shutil.which,
    plugin_dirs: Iterable[str] | None = None,
    installed_packages: str = INSTALLED_PACKAGES,
    dev: str = "/dev",
) -> Detection:
    """Look at this machine: EFA and other RDMA devices, uverbs device files, GPUs, the aws-ofi-nccl
    plugin and its version, `fi_info`. Never raises for missing or unreadable files."""
    efa, other = [], []
    ib_root = os.path.join(sysfs, "class", "infiniband")
    for name in _listdir(ib_root):
        (efa if _is_efa(os.path.join(ib_root, name)) else other).append(name)
    uverbs = tuple(n for n in _listdir(os.path.join(dev, "infiniband")) if n.startswith("uverbs"))
    dirs = default_plugin_dirs() if plugin_dirs is None else tuple(plugin_dirs)
    plugin = find_plugin(dirs)
    version = None
    if plugin is not None:
        version = _version_from_library(plugin) or _version_from_packages(installed_packages)
    fi_info = which("fi_info") or (FI_INFO_FALLBACK if os.path.isfile(FI_INFO_FALLBACK) else None)
    return Detection(efa_devices=tuple(efa), other_rdma_devices=tuple(other), uverbs_devices=uverbs,
                     gpus=_count_gpus(sysfs), ofi_nccl_plugin=plugin, ofi_nccl_version=version, fi_info=fi_info)


def wanted_env(detection: Detection) -> dict[str, str]:
    """Every variable the detection calls for, whether or not it is set already."""
    env = {"NCCL_SOCKET_IFNAME": SOCKET_IFNAME}
    if detection.efa:
        # libfabric's EFA provider otherwise backs its internal buffers with huge pages; with data-loader
        # workers forked from a training process the system can run out of them and fork() fails with
        # "Cannot allocate memory". Ordinary pages cost a little speed and avoid that.
        env["FI_EFA_USE_HUGE_PAGE"] = "0"
        if detection.old_plugin:
            env["FI_PROVIDER"] = "efa"
            env["NCCL_PROTO"] = "simple"
    return env


def nccl_env(detection: Detection, existing_env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add: `wanted_env` less every name `existing_env` already has (set by the job,
    the image or the user: theirs win, even when empty)."""
    return {k: v for k, v in wanted_env(detection).items() if k not in existing_env}


def configure(environ: MutableMapping[str, str], detection: Detection) -> str:
    """Add the missing variables to `environ`; return the driver's one-line account of it, e.g.
    `EFA: 4 device(s), aws-ofi-nccl 1.9.1; set FI_EFA_USE_HUGE_PAGE=0 NCCL_SOCKET_IFNAME=^docker,lo,veth`."""
    added = nccl_env(detection, environ)
    kept = [k for k in wanted_env(detection) if k not in added]
    environ.update(added)
    line = detection.describe()
    if detection.gpus:
        line += f"; {detection.gpus} GPU(s)"
    line += "; set " + (" ".join(f"{k}={v}" for k, v in sorted(added.items())) if added else "nothing")
    if kept:
        line += "; kept the job's " + " ".join(f"{k}={environ[k]}" for k in sorted(kept))
    return line
