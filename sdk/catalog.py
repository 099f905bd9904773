"""Instance types known to Trainyard, from a catalog shipped with the SDK (no network call)."""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources

from trainyard.sdk.errors import ConfigError

LOCAL = "local"


@dataclass(frozen=True, kw_only=True, slots=True)
class InstanceType:
    name: str
    """EC2 name without the `ml.` prefix (`p4d.24xlarge`), or `local`."""
    accelerator: str
    """Accelerator model (`NVIDIA A100`), empty for `local`."""
    accelerator_kind: str
    """`gpu`, `neuron` or `cpu`."""
    accelerator_count: int
    accelerator_memory_mib: int
    vcpus: int
    memory_mib: int
    efa_supported: bool
    max_efa_interfaces: int
    network_cards: int
    processes_per_host: int
    """Default processes per host: GPUs, NeuronCores, or 2 for `local`."""

    @property
    def num_gpus(self) -> int:
        return self.accelerator_count if self.accelerator_kind == "gpu" else 0


@cache
def _catalog() -> dict[str, dict]:
    text = resources.files("trainyard.sdk").joinpath("catalog/instance_types.json").read_text()
    return json.loads(text)["instance_types"]


def known_types() -> list[str]:
    return sorted(_catalog()) + [LOCAL]


def lookup(instance_type: object) -> InstanceType:
    """Resolve `ml.p4d.24xlarge`, `p4d.24xlarge` or `local`; unknown names raise ConfigError."""
    if not isinstance(instance_type, str) or not instance_type:
        raise ConfigError("instance_type", f"expected a name such as 'ml.p4d.24xlarge' or 'local', got {instance_type!r}")
    name = instance_type.removeprefix("ml.")
    if name == LOCAL:
        cpus = os.cpu_count() or 1
        return InstanceType(
            name=LOCAL, accelerator="", accelerator_kind="cpu", accelerator_count=0,
            accelerator_memory_mib=0, vcpus=cpus, memory_mib=0, efa_supported=False,
            max_efa_interfaces=0, network_cards=1, processes_per_host=2,
        )
    row = _catalog().get(name)
    if row is None:
        close = difflib.get_close_matches(name, known_types(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(
            "instance_type",
            f"unknown instance type {instance_type!r}{hint}. Known: 'local' and the "
            "p4d, p4de, p5, p5e, p5en, g5 and trn1 families (with or without the 'ml.' prefix)",
        )
    return InstanceType(name=name, **row)
