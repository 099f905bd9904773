"""`trainyard catalog [FILTER] [--json]`: the instance catalog (trainyard/job/catalog/), one row per type."""
from __future__ import annotations

import json
from dataclasses import asdict

from trainyard.job import catalog
from trainyard.sdk.jobs.format import print_table

HEADERS = ["type", "accelerator", "count", "accel GiB", "vCPUs", "memory GiB", "EFA", "network", "$/h us-east-1"]


def add_parser(sub, command) -> None:
    p = command(sub, "catalog", "list instance types: accelerators, memory, EFA, prices",
                "trainyard catalog\ntrainyard catalog g6e\ntrainyard catalog p5 --json",
                "Every SageMaker training instance type: accelerator, memory, EFA, network and the On-Demand list\n"
                "price in us-east-1 where the price table has one ('-' where it has none).")
    p.add_argument("filter", nargs="?", default="", help="only the types whose name contains this (a family: g6e)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def show(filter_text: str = "", as_json: bool = False) -> int:
    names = [n for n in catalog.known_types() if filter_text.removeprefix("ml.") in n and not n.startswith("local")]
    types = sorted((catalog.lookup(n) for n in names),
                   key=lambda t: (t.name.split(".")[0], t.accelerator_count, t.vcpus, t.name))
    if as_json:
        for t in types:
            price = catalog.hourly_price(t.name, "us-east-1", spot=False)
            print(json.dumps({**asdict(t), "price_per_hour_us_east_1": price.per_hour if price else None}))
        return 0
    if not types:
        print(f"no instance type contains {filter_text!r}")
        return 1
    rows = []
    for t in types:
        price = catalog.hourly_price(t.name, "us-east-1", spot=False)
        rows.append([f"ml.{t.name}", t.accelerator or "-", str(t.accelerator_count or "-"),
                     f"{t.accelerator_memory_mib / 1024:.0f}" if t.accelerator_memory_mib else "-", str(t.vcpus),
                     f"{t.memory_mib / 1024:.0f}", f"{t.max_efa_interfaces}" if t.efa_supported else "no", t.network,
                     f"{price.per_hour:.2f}" if price else "-"])
    print_table(HEADERS, rows, right=("count", "accel GiB", "vCPUs", "memory GiB", "$/h us-east-1"))
    return 0
