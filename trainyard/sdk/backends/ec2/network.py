"""The network a job's instances need when Trainyard creates their subnet, and the check of a user's own.

An instance with several network interfaces (every EFA instance type) gets no public IPv4 address, so a new
subnet in the default VPC reaches nothing outside the VPC, whatever the VPC's internet gateway. What the
node agent and the user data talk to: S3 (code, data, checkpoints, status, and ECR's image layers), ECR
(`ecr.api` for the login, `ecr.dkr` for the registry), CloudWatch Logs, and EC2 (peer discovery,
DescribeInstances). The agent calls neither STS nor SSM (credentials come from IMDS, the AMI is resolved
on the user's machine), so there are no endpoints for them.

Per job (in its ledger, deleted with it):

    route table of its own, associated with the job's subnet (the VPC's main table is never changed)
    -> S3 gateway endpoint on that route table (free)
    -> with network={"internet": True}: an Elastic IP and a NAT gateway in the zone's default (public)
       subnet, and 0.0.0.0/0 -> NAT on the job's route table (pip, the Hugging Face hub, ...)

Shared by the jobs of a VPC: interface endpoints with private DNS for ecr.api, ecr.dkr, logs and ec2. A VPC
takes one endpoint per service with private DNS, so jobs cannot each have their own: Trainyard keeps them
in a small subnet of its own (`trainyard-endpoints`, a /28 in the first job's zone; the endpoints are
reachable from every zone of the VPC) behind a security group that admits HTTPS from the VPC. They are
reference-counted by tags: each job that uses an endpoint tags it `trainyard:uses:<job>` (and records the
use in its ledger); a job's teardown removes its tag, deletes the endpoints no job uses any more, and then
the shared subnet and group once they hold none. An endpoint that is not Trainyard's (the user's own, with
private DNS) is used as it is and never touched. Two jobs tearing down and starting in the same second can
race on the count; `trainyard gc` deletes what a race left unused.
"""
from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainyard.errors import ConfigError

if TYPE_CHECKING:
    from trainyard.sdk.backends.ec2.provision import Cluster

INTERFACE_SERVICES = ("ecr.api", "ecr.dkr", "logs", "ec2")
SHARED_TAG = "trainyard:shared"  # value "endpoints" on the shared subnet, group and endpoints
USES_PREFIX = "trainyard:uses:"
SHARED_NAME = "trainyard-endpoints"
SHARED_PREFIX = 28  # the shared subnet: /28, 11 usable addresses; one per endpoint (4)
HTTPS = 443


@dataclass(frozen=True)
class NetworkPrices:
    """USD list prices of one region (catalog/prices.json, `network`)."""

    interface_endpoint_hour: float
    interface_endpoint_gb: float
    nat_gateway_hour: float
    nat_gateway_gb: float
    public_ipv4_hour: float
    as_of: str


def network_prices(table: dict, region: str) -> NetworkPrices | None:
    """The region's network prices from the shipped price table (preflight.prices()); None if it has none."""
    section = table.get("network", {})
    p = section.get("regions", {}).get(region)
    return NetworkPrices(**p, as_of=section["as_of"]) if p else None


def service_name(region: str, service: str) -> str:
    return f"com.amazonaws.{region}.{service}"


def describe_cost(table: dict, region: str, *, internet: bool, shared_to_create: int) -> list[str]:
    """The plan's lines on what the created network costs beside the instances."""
    p = network_prices(table, region)
    lines = ["a route table and an S3 gateway endpoint of the job's own (free)"]
    n = len(INTERFACE_SERVICES)
    if p is None:
        lines.append(f"{n} shared interface endpoints ({', '.join(INTERFACE_SERVICES)}) and, with internet access, "
                     f"a NAT gateway: no verified price in {region}")
        return lines
    shared = f"{n} shared interface endpoints ({', '.join(INTERFACE_SERVICES)}): ${n * p.interface_endpoint_hour:.3f}" \
             f"/hour while any job of the VPC uses them, plus ${p.interface_endpoint_gb:.3f}/GB"
    lines.append(shared + ("" if shared_to_create else " (they exist already)"))
    if internet:
        lines.append(f"a NAT gateway and its Elastic IP: ${p.nat_gateway_hour + p.public_ipv4_hour:.3f}/hour, "
                     f"plus ${p.nat_gateway_gb:.3f}/GB through it")
    lines.append(f"(list prices of {region} as of {p.as_of}; data transfer not included)")
    return lines


# ---- the job's own pieces ------------------------------------------------------------------------------


def connect_job_subnet(cluster: "Cluster", subnet: str, vpc_id: str, zone: str, *, internet: bool) -> None:
    """Route table, S3 gateway endpoint, optional NAT, and the shared interface endpoints for a subnet that
    Trainyard created. Each piece enters the ledger as it is made."""
    ec2, region = cluster.ec2, cluster.ec2.meta.region_name
    table = ec2.create_route_table(VpcId=vpc_id, TagSpecifications=cluster._tags("route-table"))["RouteTable"]
    cluster.ledger.add("route-table", table["RouteTableId"])
    ec2.associate_route_table(RouteTableId=table["RouteTableId"], SubnetId=subnet)
    gateway = ec2.create_vpc_endpoint(VpcId=vpc_id, ServiceName=service_name(region, "s3"), VpcEndpointType="Gateway",
                                      RouteTableIds=[table["RouteTableId"]],
                                      TagSpecifications=cluster._tags("vpc-endpoint"))["VpcEndpoint"]["VpcEndpointId"]
    cluster.ledger.add("vpc-endpoint", gateway)
    cluster.say(f"created route table {table['RouteTableId']} for {subnet} with an S3 gateway endpoint {gateway}")
    if internet:
        _nat(cluster, vpc_id, zone, table["RouteTableId"])
    use_shared_endpoints(cluster, vpc_id, zone)


def _nat(cluster: "Cluster", vpc_id: str, zone: str, table: str) -> None:
    ec2 = cluster.ec2
    public = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc_id]},
                                           {"Name": "availability-zone", "Values": [zone]},
                                           {"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
    if not public:
        raise RuntimeError(f"network={{'internet': True}} needs the default VPC's public subnet in {zone} for its "
                           "NAT gateway, and there is none: pass subnets=[...] that have a NAT gateway")
    eip = ec2.allocate_address(Domain="vpc", TagSpecifications=cluster._tags("elastic-ip"))["AllocationId"]
    cluster.ledger.add("elastic-ip", eip)
    nat = ec2.create_nat_gateway(SubnetId=public[0]["SubnetId"], AllocationId=eip,
                                 TagSpecifications=cluster._tags("natgateway"))["NatGateway"]["NatGatewayId"]
    cluster.ledger.add("nat-gateway", nat)
    ec2.get_waiter("nat_gateway_available").wait(NatGatewayIds=[nat], WaiterConfig={"Delay": 5, "MaxAttempts": 60})
    ec2.create_route(RouteTableId=table, DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat)
    cluster.say(f"created NAT gateway {nat} in {public[0]['SubnetId']}: the job reaches the internet")


# ---- the shared interface endpoints ----------------------------------------------------------------------


def find_endpoints(ec2, vpc_id: str) -> dict[str, dict]:
    """The VPC's live interface endpoints with private DNS, by service (`ecr.api`, ...)."""
    region = ec2.meta.region_name
    found: dict[str, dict] = {}
    for e in ec2.describe_vpc_endpoints(Filters=[{"Name": "vpc-id", "Values": [vpc_id]},
                                                 {"Name": "vpc-endpoint-type", "Values": ["Interface"]}])["VpcEndpoints"]:
        if e.get("State", "").lower() in ("deleting", "deleted", "failed", "rejected") or not e.get("PrivateDnsEnabled"):
            continue
        service = e["ServiceName"].removeprefix(f"com.amazonaws.{region}.")
        if service in INTERFACE_SERVICES:
            found.setdefault(service, e)
    return found


def _is_shared(resource: dict) -> bool:
    return any(t["Key"] == SHARED_TAG for t in resource.get("Tags", []))


def use_shared_endpoints(cluster: "Cluster", vpc_id: str, zone: str) -> None:
    """Find or create the VPC's interface endpoints and count this job as a user of Trainyard's."""
    ec2, region = cluster.ec2, cluster.ec2.meta.region_name
    if vpc_id in cluster.ledger.ids("shared-network"):
        return  # a subnet in the next zone (capacity fallback): this job counts already
    existing = find_endpoints(ec2, vpc_id)
    missing = [s for s in INTERFACE_SERVICES if s not in existing]
    # in the ledger before anything shared is made: a failure from here on leaves no unused shared piece
    # (teardown releases the uses first, newest first, then this item deletes an empty shared subnet)
    cluster.ledger.add("shared-network", vpc_id)
    if missing:
        subnet, group = _shared_subnet(cluster, vpc_id, zone)
        for service in missing:
            e = ec2.create_vpc_endpoint(
                VpcId=vpc_id, ServiceName=service_name(region, service), VpcEndpointType="Interface",
                SubnetIds=[subnet], SecurityGroupIds=[group], PrivateDnsEnabled=True,
                TagSpecifications=[{"ResourceType": "vpc-endpoint", "Tags": _shared_tags(service)}])["VpcEndpoint"]
            existing[service] = {**e, "Tags": _shared_tags(service)}
            cluster.ledger.add("endpoint-use", e["VpcEndpointId"], service=service, vpc=vpc_id)
            cluster.say(f"created shared interface endpoint {e['VpcEndpointId']} for {service} in {subnet}")
    for service, e in existing.items():
        if not _is_shared(e):
            continue  # the user's own endpoint: used, never touched
        if service not in missing:  # created above: in the ledger already
            cluster.ledger.add("endpoint-use", e["VpcEndpointId"], service=service, vpc=vpc_id)
        ec2.create_tags(Resources=[e["VpcEndpointId"]], Tags=[{"Key": USES_PREFIX + cluster.job, "Value": "1"}])


def _shared_tags(service: str | None = None) -> list[dict]:
    name = f"{SHARED_NAME}-{service}" if service else SHARED_NAME
    return [{"Key": "Name", "Value": name}, {"Key": SHARED_TAG, "Value": "endpoints"}]


def _shared_subnet(cluster: "Cluster", vpc_id: str, zone: str) -> tuple[str, str]:
    """(subnet, security group) that hold the shared endpoints: found by tag, else created."""
    ec2 = cluster.ec2
    flt = [{"Name": "vpc-id", "Values": [vpc_id]}, {"Name": f"tag:{SHARED_TAG}", "Values": ["endpoints"]}]
    subnets = ec2.describe_subnets(Filters=flt)["Subnets"]
    groups = ec2.describe_security_groups(Filters=flt)["SecurityGroups"]
    vpc = ec2.describe_vpcs(VpcIds=[vpc_id])["Vpcs"][0]
    if subnets:
        subnet = subnets[0]["SubnetId"]
    else:
        cidr = free_block(ec2, vpc, SHARED_PREFIX)
        subnet = ec2.create_subnet(VpcId=vpc_id, CidrBlock=cidr, AvailabilityZone=zone, TagSpecifications=[
            {"ResourceType": "subnet", "Tags": _shared_tags()}])["Subnet"]["SubnetId"]
        cluster.say(f"created subnet {subnet} ({cidr}) for the VPC's shared endpoints")
    if groups:
        return subnet, groups[0]["GroupId"]
    group = ec2.create_security_group(
        GroupName=SHARED_NAME, VpcId=vpc_id, Description="Trainyard: HTTPS from the VPC to its interface endpoints",
        TagSpecifications=[{"ResourceType": "security-group", "Tags": _shared_tags()}])["GroupId"]
    ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=[{
        "IpProtocol": "tcp", "FromPort": HTTPS, "ToPort": HTTPS, "IpRanges": [{"CidrIp": vpc["CidrBlock"]}]}])
    return subnet, group


def free_block(ec2, vpc: dict, prefix: int) -> str:
    """The first /`prefix` of the VPC's range that no subnet overlaps."""
    taken = [ipaddress.ip_network(s["CidrBlock"]) for s in
             ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc["VpcId"]]}])["Subnets"]]
    for candidate in ipaddress.ip_network(vpc["CidrBlock"]).subnets(new_prefix=prefix):
        if not any(candidate.overlaps(t) for t in taken):
            return str(candidate)
    raise RuntimeError(f"no free /{prefix} left in {vpc['VpcId']} ({vpc['CidrBlock']}): pass subnets=[...]")


def release_endpoint(cluster: "Cluster", item: dict) -> None:
    """This job no longer uses a shared endpoint: untag it; delete it when no job does (the job's
    `shared-network` item then deletes the shared subnet and group once they hold no endpoint)."""
    ec2 = cluster.ec2
    ec2.delete_tags(Resources=[item["id"]], Tags=[{"Key": USES_PREFIX + cluster.job}])
    found = ec2.describe_vpc_endpoints(VpcEndpointIds=[item["id"]])["VpcEndpoints"]
    if not found or found[0].get("State", "").lower() in ("deleted", "deleting") or \
            any(t["Key"].startswith(USES_PREFIX) for t in found[0].get("Tags", [])):
        return
    ec2.delete_vpc_endpoints(VpcEndpointIds=[item["id"]])
    cluster.say(f"deleted shared interface endpoint {item['id']} ({item.get('service')}): no job uses it")


def release_shared_subnet(ec2, vpc_id: str, say) -> None:
    """Delete the shared subnet and group once no live Trainyard endpoint is left in the VPC."""
    live = [e for e in ec2.describe_vpc_endpoints(Filters=[
        {"Name": "vpc-id", "Values": [vpc_id]}, {"Name": f"tag:{SHARED_TAG}", "Values": ["endpoints"]}])["VpcEndpoints"]
        if e.get("State", "").lower() not in ("deleted", "deleting")]
    if live:
        return
    flt = [{"Name": "vpc-id", "Values": [vpc_id]}, {"Name": f"tag:{SHARED_TAG}", "Values": ["endpoints"]}]
    for g in ec2.describe_security_groups(Filters=flt)["SecurityGroups"]:
        retrying(lambda g=g: ec2.delete_security_group(GroupId=g["GroupId"]))
        say(f"deleted security group {g['GroupId']} of the shared endpoints")
    for s in ec2.describe_subnets(Filters=flt)["Subnets"]:
        retrying(lambda s=s: ec2.delete_subnet(SubnetId=s["SubnetId"]))
        say(f"deleted subnet {s['SubnetId']} of the shared endpoints")


def error_code(e: Exception) -> str:
    """botocore's error code of `e` ("" for any other exception)."""
    return getattr(e, "response", {}).get("Error", {}).get("Code", "") if hasattr(e, "response") else ""


def retrying(call, codes: tuple[str, ...] = ("DependencyViolation", "InvalidPlacementGroup.InUse"), wait_s=120.0):
    """Deleting right after instances terminate (or an endpoint goes) meets EC2 still releasing their network
    interfaces: retry those errors for a while."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return call()
        except Exception as e:  # noqa: BLE001
            if error_code(e) not in codes or time.monotonic() > deadline:
                raise
            time.sleep(5)



def delete_route_table(cluster: "Cluster", item: dict) -> None:
    """Detach the table from its subnets (the ledger's or gc's item alike), then delete it."""
    ec2 = cluster.ec2
    tables = ec2.describe_route_tables(RouteTableIds=[item["id"]])["RouteTables"]
    for assoc in tables[0].get("Associations", []) if tables else []:
        if not assoc.get("Main") and assoc.get("RouteTableAssociationId"):
            ec2.disassociate_route_table(AssociationId=assoc["RouteTableAssociationId"])
    retrying(lambda: ec2.delete_route_table(RouteTableId=item["id"]))


def delete_nat(cluster: "Cluster", item: dict) -> None:
    cluster.ec2.delete_nat_gateway(NatGatewayId=item["id"])
    cluster.ec2.get_waiter("nat_gateway_deleted").wait(NatGatewayIds=[item["id"]],
                                                       WaiterConfig={"Delay": 5, "MaxAttempts": 60})


# ---- a user's own subnets ------------------------------------------------------------------------------


def check_user_subnet(ec2, subnet: dict) -> list[str]:
    """What a user's subnet lacks to run a job: [] when its route table reaches S3 (a gateway endpoint, or
    a default route to a NAT gateway, transit gateway or appliance) and ECR, CloudWatch Logs and EC2 are
    reachable (interface endpoints with private DNS, or such a default route). A route to an internet
    gateway alone does not count: the instances get no public address."""
    region = ec2.meta.region_name
    tables = ec2.describe_route_tables(Filters=[{"Name": "association.subnet-id",
                                                 "Values": [subnet["SubnetId"]]}])["RouteTables"]
    if not tables:  # no table of its own: the VPC's main table
        tables = ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [subnet["VpcId"]]},
                                                    {"Name": "association.main", "Values": ["true"]}])["RouteTables"]
    routes = tables[0]["Routes"] if tables else []
    # a default route that serves instances without public addresses: a NAT gateway, a transit gateway or an
    # appliance; an internet gateway does not (Trainyard's instances get no public address: EFA, no public IP)
    default = [r for r in routes if r.get("DestinationCidrBlock") == "0.0.0.0/0" and r.get("State", "active") == "active"
               and (r.get("NatGatewayId") or r.get("TransitGatewayId") or r.get("NetworkInterfaceId"))]
    s3_lists = {p["PrefixListId"] for p in ec2.describe_prefix_lists(Filters=[
        {"Name": "prefix-list-name", "Values": [service_name(region, "s3")]}])["PrefixLists"]}
    s3_gateway = any(r.get("DestinationPrefixListId") in s3_lists and str(r.get("GatewayId", "")).startswith("vpce-")
                     for r in routes)
    missing = []
    if not (s3_gateway or default):
        missing.append("a route to S3 (an S3 gateway endpoint on its route table, or a 0.0.0.0/0 route to a NAT "
                       "gateway; an internet gateway serves only instances with public addresses, and these get "
                       "none)")
    if not default:
        endpoints = find_endpoints(ec2, subnet["VpcId"])
        lacking = [s for s in ("ecr.api", "ecr.dkr", "logs", "ec2") if s not in endpoints]
        if lacking:
            missing.append("a way to ECR, CloudWatch Logs and EC2: interface endpoints with private DNS for "
                           + ", ".join(lacking) + " (or a NAT gateway)")
    return missing


def refuse_unreachable(ec2, subnets: list[dict]) -> None:
    """ConfigError naming the first of the user's subnets that cannot reach what a job needs."""
    for s in subnets:
        missing = check_user_subnet(ec2, s)
        if missing:
            raise ConfigError("subnets", f"{s['SubnetId']} ({s['AvailabilityZone']}) lacks " + " and ".join(missing)
                              + ": its instances (no public address with EFA) could not pull the image, fetch the "
                                "code or ship logs. Add them, or leave subnets out and Trainyard creates a subnet "
                                "with what it needs")


def release_unused(ec2, say) -> list[str]:
    """For gc: delete Trainyard's shared endpoints that no job uses (a race or a crash left them), then
    the shared subnets and groups that hold none. Returns the endpoints deleted."""
    deleted = []
    endpoints = ec2.describe_vpc_endpoints(Filters=[{"Name": f"tag:{SHARED_TAG}", "Values": ["endpoints"]}])
    for e in endpoints["VpcEndpoints"]:
        if e.get("State", "").lower() in ("deleted", "deleting"):
            continue
        if not any(t["Key"].startswith(USES_PREFIX) for t in e.get("Tags", [])):
            ec2.delete_vpc_endpoints(VpcEndpointIds=[e["VpcEndpointId"]])
            say(f"deleted shared interface endpoint {e['VpcEndpointId']}: no job uses it")
            deleted.append(e["VpcEndpointId"])
    for vpc in {e["VpcId"] for e in endpoints["VpcEndpoints"]}:
        release_shared_subnet(ec2, vpc, say)
    return deleted
