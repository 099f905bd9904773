"""What an EFA cluster is made of, as data: instance facts from DescribeInstanceTypes, the network
interfaces of a launch, the security-group rules and the instance-metadata options.

Pure functions, no boto3: the EC2 backend sends these, and the Terraform modules declare the same
(a consistency test compares them).
"""
from __future__ import annotations

from dataclasses import dataclass

TAG_KEY = "trainyard:job"
# An instance's host index (0-based: algo-<index+1>) when its AMI launch index cannot say it: Terraform
# (infra/modules/job) launches each instance with a RunInstances of its own, so all have launch index 0.
# The EC2 backend launches all N in one RunInstances and leaves the tag out: the launch index is right.
HOST_INDEX_TAG = "trainyard:host-index"
# IMDSv2 only; hop limit 1: the training container uses the host network (sdk/backends/aws/userdata.py), so no extra hop,
# and a container on a bridge network (another program on the instance) cannot reach the instance role's credentials
IMDS_OPTIONS = {"HttpTokens": "required", "HttpPutResponseHopLimit": 1, "HttpEndpoint": "enabled"}
# FSx for Lustre: its servers and clients talk on TCP 988 and 1018-1023
LUSTRE_PORTS = ((988, 988), (1018, 1023))
# torchrun's c10d rendezvous on the first host (REFERENCE: --rdzv-endpoint=<rank0 ip>:29400)
RDZV_PORT = 29400


@dataclass(frozen=True, kw_only=True, slots=True)
class InstanceFacts:
    """One instance type in one region, as DescribeInstanceTypes reports it."""

    name: str
    gpus: int
    gpu_name: str
    gpu_memory_mib: int
    vcpus: int
    memory_mib: int
    efa_supported: bool
    max_efa_interfaces: int
    network_cards: int

    @classmethod
    def from_api(cls, row: dict) -> "InstanceFacts":
        """From one `InstanceTypes` entry of DescribeInstanceTypes."""
        gpus = row.get("GpuInfo", {}).get("Gpus") or [{}]
        net = row.get("NetworkInfo", {})
        return cls(
            name=row["InstanceType"],
            gpus=sum(g.get("Count", 0) for g in gpus),
            gpu_name=" ".join(x for x in (gpus[0].get("Manufacturer"), gpus[0].get("Name")) if x),
            gpu_memory_mib=gpus[0].get("MemoryInfo", {}).get("SizeInMiB", 0),
            vcpus=row.get("VCpuInfo", {}).get("DefaultVCpus", 0),
            memory_mib=row.get("MemoryInfo", {}).get("SizeInMiB", 0),
            efa_supported=bool(net.get("EfaSupported")),
            max_efa_interfaces=(net.get("EfaInfo") or {}).get("MaximumEfaInterfaces", 0) if net.get("EfaSupported") else 0,
            network_cards=net.get("MaximumNetworkCards", 1),
        )


def network_interfaces(facts: InstanceFacts, *, subnet_id: str, security_group_id: str,
                       extra_security_group_ids: tuple[str, ...] = ()) -> list[dict]:
    """The launch's network interfaces: with EFA, `facts.max_efa_interfaces` of them, one per network
    card: card 0 device 0 an `efa` interface (EFA plus the instance's IP), device 0 of every further
    card `efa-only` (EFA without an IP, which saves addresses). Every one in the cluster's subnet and
    EFA security group (then the user's `extra_security_group_ids`, JobSpec.security_group_ids); no
    public IP (EC2 refuses one with several interfaces). Without EFA, one plain interface."""
    count = facts.max_efa_interfaces if facts.efa_supported else 0
    if count > facts.network_cards:
        raise ValueError(f"{facts.name}: {count} EFA interfaces but {facts.network_cards} network cards")
    groups = [security_group_id, *(g for g in extra_security_group_ids if g != security_group_id)]
    common = {"SubnetId": subnet_id, "Groups": groups, "DeleteOnTermination": True}
    if count == 0:
        return [{"NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "interface",
                 "AssociatePublicIpAddress": False, **common}]
    out = [{"NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "efa", "AssociatePublicIpAddress": False,
            **common}]
    out += [{"NetworkCardIndex": card, "DeviceIndex": 0, "InterfaceType": "efa-only", **common}
            for card in range(1, count)]
    return out


def security_group_rules(*, vpc_cidr: str) -> dict[str, list[dict]]:
    """The EFA security group: all traffic from and to itself (EFA's requirement), Lustre's ports from
    the VPC, all egress. `"self"` stands for the group's own id (filled in when it exists)."""
    lustre = [{"IpProtocol": "tcp", "FromPort": lo, "ToPort": hi, "IpRanges": [{"CidrIp": vpc_cidr}]}
              for lo, hi in LUSTRE_PORTS]
    return {
        "ingress": [{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": "self"}]}, *lustre],
        "egress": [{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": "self"}]},
                   {"IpProtocol": "-1", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}],
    }
