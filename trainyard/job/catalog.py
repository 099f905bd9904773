"""Instance types known to Trainyard and their hourly prices, from a catalog shipped with the SDK (no network
call): `catalog/instance_types.json` (every SageMaker training instance type, written by infra/instance_catalog.py
from botocore's and moto's data files) and `catalog/prices.json`."""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources

from trainyard.errors import ConfigError

LOCAL = "local"
LOCAL_GPU = "local_gpu"  # SageMaker local mode on this machine's GPUs


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
    """Default processes per host, as SageMaker's training toolkit launches them: one per GPU or
    NeuronCore, one on a CPU host (`local`)."""
    network: str = ""
    """EC2's network performance (`Up to 10 Gigabit`, `3200 Gigabit`)."""

    @property
    def num_gpus(self) -> int:
        return self.accelerator_count if self.accelerator_kind == "gpu" else 0

    @property
    def is_local(self) -> bool:
        return self.name in (LOCAL, LOCAL_GPU)


@cache
def _document() -> dict:
    """catalog/instance_types.json, read once per process."""
    return json.loads(resources.files("trainyard.job").joinpath("catalog/instance_types.json").read_text())


def _catalog() -> dict[str, dict]:
    return _document()["instance_types"]


def performance() -> dict:
    """The catalog's `performance` section: datasheet figures per GPU kind (trainyard/job/plan reads them)."""
    return _document()["performance"]


def known_types() -> list[str]:
    return sorted(_catalog()) + [LOCAL, LOCAL_GPU]


@cache
def local_gpus() -> int:
    """GPUs torch sees on this machine (torch is imported only when `local_gpu` is asked for)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def lookup(instance_type: object) -> InstanceType:
    """Resolve `ml.p4d.24xlarge`, `p4d.24xlarge` or `local`; unknown names raise ConfigError."""
    if not isinstance(instance_type, str) or not instance_type:
        raise ConfigError("instance_type", f"expected a name such as 'ml.p4d.24xlarge' or 'local', got {instance_type!r}")
    name = instance_type.removeprefix("ml.")
    if name in (LOCAL, LOCAL_GPU):
        gpus = local_gpus() if name == LOCAL_GPU else 0
        if name == LOCAL_GPU and gpus == 0:
            raise ConfigError("instance_type", "'local_gpu' runs on this machine's GPUs and none is visible "
                                               "(torch.cuda.device_count() is 0); use 'local'")
        return InstanceType(
            name=name, accelerator="local GPU" if gpus else "", accelerator_kind="gpu" if gpus else "cpu",
            accelerator_count=gpus, accelerator_memory_mib=0, vcpus=os.cpu_count() or 1, memory_mib=0,
            efa_supported=False, max_efa_interfaces=0, network_cards=1, processes_per_host=max(1, gpus),
        )
    row = _catalog().get(name)
    if row is None:
        close = difflib.get_close_matches(name, known_types(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(
            "instance_type",
            f"unknown instance type {instance_type!r}{hint}. Known: 'local', 'local_gpu' and every SageMaker "
            "training instance type (with or without the 'ml.' prefix; `trainyard catalog` lists them)",
        )
    return InstanceType(name=name, **row)


@cache
def _capabilities() -> dict[str, tuple[int, int]]:
    """{GPU kind: CUDA compute capability}, "9.0" read as (9, 0)."""
    return {kind: tuple(int(x) for x in text.split(".")) for kind, text in performance()["compute_capability"].items()}


def compute_capability(it: InstanceType) -> tuple[int, int] | None:
    """The CUDA compute capability of `it`'s GPUs, (9, 0) for H100; None for no GPU, or one the catalog lacks
    (`local_gpu`: the engine asks the GPU itself)."""
    return _capabilities().get(it.accelerator) if it.num_gpus else None


def types_with_capability(minimum: tuple[int, int]) -> list[str]:
    """The instance families (`p5`, `g6e`) whose GPUs have at least compute capability `minimum`."""
    return sorted({name.split(".")[0] for name, row in _catalog().items()
                   if row["accelerator_kind"] == "gpu" and _capabilities().get(row["accelerator"], (0, 0)) >= minimum})


PRICES_FILE = "catalog/prices.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class HourlyPrice:
    """What one instance costs per hour, by the shipped price table."""

    per_hour: float
    """USD per instance-hour."""
    market: str
    """`on-demand` or `spot`."""
    source: str
    """Where the figure comes from: the table's file and date, and how a spot figure was estimated."""


@cache
def price_table() -> dict:
    """The shipped price table (`trainyard/job/catalog/prices.json`): On-Demand list prices per region."""
    return json.loads(resources.files("trainyard.job").joinpath(PRICES_FILE).read_text())


def hourly_price(instance_type: str, region: str, *, spot: bool) -> HourlyPrice | None:
    """The price of one `instance_type` (`ml.` prefix or not) instance-hour in `region`: the On-Demand list
    price, or for spot that times (1 - the table's `spot_discount_estimate`), since spot prices move by
    zone and hour and are not in the table. None when the table has no price for the type there."""
    table = price_table()
    on_demand = table["on_demand"].get(region, {}).get(instance_type.removeprefix("ml."))
    if on_demand is None:
        return None
    source = f"trainyard/job/{PRICES_FILE}, On-Demand list price in {region} as of {table['as_of']}"
    if not spot:
        return HourlyPrice(per_hour=on_demand, market="on-demand", source=source)
    share = 1 - table["spot_discount_estimate"]
    return HourlyPrice(per_hour=on_demand * share, market="spot",
                       source=f"{source}; spot estimated at {share:.0%} of it (spot prices are not in the table)")
