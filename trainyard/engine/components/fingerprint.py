"""The hardware and software a job ran on, recorded once so that its figures can be reproduced and compared.

`fingerprint(device, world_size, processes_per_host)`: device model and count, power limit, NVLink links per
GPU, EFA devices, NCCL / torch / CUDA / Python versions, CPU model and cores. GPU facts come from torch and
`nvidia-smi` (absent: None); the EFA count from the container driver's detection (`TRAINYARD_EFA_DEVICES`).
`differences(a, b)` names the fields in which two fingerprints differ: figures measured on them should not
be compared as if they were not.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess

import torch

EFA_ENV = "TRAINYARD_EFA_DEVICES"
# fields that change what a figure means; host counts and the peak's measurement noise do not
COMPARED = ("device", "device_count", "power_limit_w", "nvlink_links", "efa_devices", "cpu_model", "cpu_cores",
            "torch", "cuda", "nccl")


def _smi(*args: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(device: torch.device, *, world_size: int, processes_per_host: int) -> dict:
    gpu = device.type == "cuda"
    out = {
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "device_count": torch.cuda.device_count() if gpu else processes_per_host,
        "world_size": world_size,
        "hosts": world_size // processes_per_host,
        "power_limit_w": None,
        "nvlink_links": None,
        "efa_devices": int(os.environ[EFA_ENV]) if os.environ.get(EFA_ENV, "").isdigit() else None,
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
        "python": platform.python_version(),
    }
    if gpu:
        limit = _smi("--query-gpu=power.limit", "--format=csv,noheader,nounits", f"--id={device.index or 0}")
        if limit and re.match(r"^\s*[0-9.]+\s*$", limit.splitlines()[0]):
            out["power_limit_w"] = float(limit.splitlines()[0])
        links = _smi("nvlink", "--status", f"--id={device.index or 0}")
        if links is not None:
            out["nvlink_links"] = len(re.findall(r"Link \d+: +[0-9.]+ GB/s", links))
    return out


def differences(a: dict, b: dict) -> list[str]:
    """`field: a-value != b-value` for every compared field in which the two differ."""
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in COMPARED if a.get(k) != b.get(k)]


def this_machine() -> dict:
    """The fingerprint of the machine a benchmark runs on (its first GPU, else the CPU; one process)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return fingerprint(device, world_size=1, processes_per_host=1)
