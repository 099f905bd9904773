"""Regenerates trainyard/job/catalog/instance_types.json's `instance_types`: every SageMaker training instance type.

    python infra/instance_catalog.py            # rewrite the file (its `performance` section is kept)
    python infra/instance_catalog.py --check    # exit 1 when the file differs from what would be written

Sources, both files shipped in installed packages (no network):
- which types: botocore's SageMaker service model (`botocore/data/sagemaker/*/service-2.json`), the enum
  `TrainingInstanceType` of CreateTrainingJob's ResourceConfig;
- their facts: moto's copy of EC2 DescribeInstanceTypes (`moto/ec2/resources/instance_types.json`): GpuInfo,
  NeuronInfo, VCpuInfo, MemoryInfo, NetworkInfo (EFA, network cards, bandwidth).
Types the EC2 data lacks (retired from EC2's current list, or too new) and one figure the EC2 data has wrong come
from AWS's instance type documentation (`FROM_DOCS`, `CORRECTIONS`); a SageMaker type in neither is left out, and
the run says so.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

CATALOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainyard", "job", "catalog",
                       "instance_types.json")
GIB = 1024

# AWS's Accelerated Computing instance pages (P2, P3): the EC2 data no longer lists them
FROM_DOCS = {
    "p2.xlarge": dict(accelerator="NVIDIA K80", accelerator_count=1, accelerator_memory_mib=12 * GIB, vcpus=4,
                      memory_mib=61 * GIB, network="High"),
    "p2.8xlarge": dict(accelerator="NVIDIA K80", accelerator_count=8, accelerator_memory_mib=12 * GIB, vcpus=32,
                       memory_mib=488 * GIB, network="10 Gigabit"),
    "p2.16xlarge": dict(accelerator="NVIDIA K80", accelerator_count=16, accelerator_memory_mib=12 * GIB, vcpus=64,
                        memory_mib=732 * GIB, network="25 Gigabit"),
    "p3.2xlarge": dict(accelerator="NVIDIA V100", accelerator_count=1, accelerator_memory_mib=16 * GIB, vcpus=8,
                       memory_mib=61 * GIB, network="Up to 10 Gigabit"),
    "p3.8xlarge": dict(accelerator="NVIDIA V100", accelerator_count=4, accelerator_memory_mib=16 * GIB, vcpus=32,
                       memory_mib=244 * GIB, network="10 Gigabit"),
    "p3.16xlarge": dict(accelerator="NVIDIA V100", accelerator_count=8, accelerator_memory_mib=16 * GIB, vcpus=64,
                        memory_mib=488 * GIB, network="25 Gigabit"),
}
# Trainium2: 96 GiB of HBM per chip (1.5 TB for trn2.48xlarge's 16, AWS's Trn2 page); the EC2 data says 512 GiB
CORRECTIONS = {"Trainium2": {"accelerator_memory_mib": 96 * GIB}}


def training_types() -> list[str]:
    import botocore.loaders

    model = botocore.loaders.Loader().load_service_model("sagemaker", "service-2")
    return [t.removeprefix("ml.") for t in model["shapes"]["TrainingInstanceType"]["enum"]]


def ec2_types() -> dict[str, dict]:
    import moto

    with gzip.open(os.path.join(os.path.dirname(moto.__file__), "ec2", "resources", "instance_types.json.gz")) as fh:
        return json.loads(fh.read())


def row(api: dict) -> dict:
    """The catalog's fields from one DescribeInstanceTypes entry."""
    net = api.get("NetworkInfo") or {}
    out = dict(accelerator="", accelerator_count=0, accelerator_kind="cpu", accelerator_memory_mib=0, processes_per_host=1)
    gpus = (api.get("GpuInfo") or {}).get("Gpus") or []
    neuron = (api.get("NeuronInfo") or {}).get("NeuronDevices") or []
    if gpus:
        g = gpus[0]
        out.update(accelerator=f"{g['Manufacturer']} {g['Name']}", accelerator_kind="gpu",
                   accelerator_count=sum(x["Count"] for x in gpus), accelerator_memory_mib=g["MemoryInfo"]["SizeInMiB"])
        out["processes_per_host"] = out["accelerator_count"]
    elif neuron:
        n = neuron[0]
        name = "AWS " + n["Name"]
        out.update(accelerator=name, accelerator_kind="neuron", accelerator_count=n["Count"],
                   accelerator_memory_mib=CORRECTIONS.get(n["Name"], {}).get("accelerator_memory_mib",
                                                                               n["MemoryInfo"]["SizeInMiB"]),
                   processes_per_host=n["Count"] * (n.get("CoreInfo") or {}).get("Count", 1))
    efa = bool(net.get("EfaSupported"))
    out.update(vcpus=api["VCpuInfo"]["DefaultVCpus"], memory_mib=api["MemoryInfo"]["SizeInMiB"], efa_supported=efa,
               max_efa_interfaces=(net.get("EfaInfo") or {}).get("MaximumEfaInterfaces", 0) if efa else 0,
               network_cards=net.get("MaximumNetworkCards", 1), network=net.get("NetworkPerformance", ""))
    return dict(sorted(out.items()))


def from_docs(name: str) -> dict:
    d = FROM_DOCS[name]
    return dict(sorted(dict(accelerator_kind="gpu", efa_supported=False, max_efa_interfaces=0, network_cards=1,
                            processes_per_host=d["accelerator_count"], **d).items()))


def build() -> tuple[dict, list[str]]:
    """(the instance_types section, the SageMaker types left out)."""
    ec2 = ec2_types()
    types, missing = {}, []
    for name in training_types():
        if name in ec2:
            types[name] = row(ec2[name])
        elif name in FROM_DOCS:
            types[name] = from_docs(name)
        else:
            missing.append(name)
    return dict(sorted(types.items())), missing


SOURCE = ("Every SageMaker training instance type: botocore's SageMaker service model (enum TrainingInstanceType); "
          "facts from moto's copy of Amazon EC2 DescribeInstanceTypes (GpuInfo, NeuronInfo, VCpuInfo, MemoryInfo, "
          "NetworkInfo), and AWS's instance type documentation for P2 and P3 and Trainium2's memory "
          "(infra/instance_catalog.py writes this section). processes_per_host is the GPU count, the NeuronCore count "
          "for Trainium, 1 on a CPU instance.")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    with open(CATALOG) as fh:
        current = json.load(fh)
    types, missing = build()
    new = {**current, "_source": SOURCE, "instance_types": types}
    text = json.dumps(new, indent=1, sort_keys=False) + "\n"
    if missing:
        print(f"left out (no facts in either source): {', '.join(missing)}", file=sys.stderr)
    if args.check:
        with open(CATALOG) as fh:
            same = fh.read() == text
        print("up to date" if same else f"{CATALOG} differs: run python infra/instance_catalog.py")
        return 0 if same else 1
    with open(CATALOG, "w") as fh:
        fh.write(text)
    print(f"{len(types)} instance types written to {os.path.relpath(CATALOG)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
