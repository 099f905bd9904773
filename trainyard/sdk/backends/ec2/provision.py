"""The EC2 cluster of one job: created step by step, every resource tagged and written to a ledger
before the next step, torn down from the ledger (or, for jobs whose ledger is gone, found by tag).

    subnet (unless given; with its route table, S3 gateway endpoint, the VPC's shared interface endpoints and,
    with network={"internet": True}, a NAT gateway: network.py) -> EFA security group -> cluster placement
    group -> instance profile (unless
    the role has one) -> launch template (network interfaces from DescribeInstanceTypes in the EFA group
    and the user's security_group_ids, IMDSv2 with hop limit 2, a root volume of volume_size GB on the
    AMI's root device, user data) -> one RunInstances of all N instances (MinCount = MaxCount = N)

Every resource created carries the job's tag (`trainyard:job`, by which gc finds it), a Name and the
user's tags (JobSpec.tags); the instances, their volumes and network interfaces (and spot requests) get
them from the launch template and from RunInstances alike.

A capacity error moves the launch to the next subnet (the user's, in order, or a subnet created in the
next zone that offers the type); when every one was tried the error says what was tried. Any other
failure, and Ctrl-C, tears down what was created so far before it propagates.
"""
from __future__ import annotations

import base64
import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from trainyard.job.facts import IMDS_OPTIONS, TAG_KEY, network_interfaces, security_group_rules
from trainyard.sdk.backends.ec2 import network
from trainyard.sdk.backends.ec2.network import error_code, retrying

ATTEMPT_TAG = "trainyard:attempt"
CAPACITY_ERRORS = ("InsufficientInstanceCapacity", "InsufficientHostCapacity", "MaxSpotInstanceCountExceeded",
                   "InsufficientCapacityOnHost", "Unsupported")
NOT_FOUND = ("NotFound", "NoSuchEntity", "InvalidGroup.NotFound", "InvalidLaunchTemplateId.NotFound",
             "InvalidLaunchTemplateName.NotFoundException", "InvalidPlacementGroup.Unknown",
             "InvalidSubnetID.NotFound", "InvalidInstanceID.NotFound")
# The Deep Learning Base AMI (GPU driver, EFA driver, docker with the NVIDIA runtime), resolved per region
AMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id"
DEFAULT_ROOT_DEVICE = "/dev/xvda"  # the root device of Amazon Linux AMIs, when DescribeImages cannot say
SUBNET_PREFIX = 20  # a created subnet: /20, 4091 addresses (EFA-only interfaces take none)
WAIT_S = 600  # longest wait for instances to terminate or a group to be released
CAPACITY_POLL_S = 15  # how often a Capacity Block past its start is asked whether it is active yet
CAPACITY_ACTIVE_WAIT_S = 900  # how long after its start a Capacity Block may take to become active


class CapacityError(RuntimeError):
    """No subnet had the capacity for all instances at once."""


@dataclass
class Ledger:
    """What was created for a job, in order, saved after every step (`path`) so that a crash leaves a
    record to tear down from."""

    path: str | None = None
    items: list[dict] = field(default_factory=list)

    def add(self, kind: str, ident: str, **extra: Any) -> None:
        self.items.append({"kind": kind, "id": ident, **extra})
        self.save()

    def ids(self, kind: str) -> list[str]:
        return [i["id"] for i in self.items if i["kind"] == kind]

    def save(self) -> None:
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as fh:
                json.dump(self.items, fh, indent=1)
            os.replace(tmp, self.path)

    @classmethod
    def load(cls, path: str) -> "Ledger":
        with open(path) as fh:
            return cls(path=path, items=json.load(fh))


def resource_tags(job: str, user_tags: dict[str, str] | None = None, attempt: int | None = None) -> dict[str, str]:
    """The tags of a job's resource: a Name (the user's wins), the user's tags, then Trainyard's own
    (which no user tag overrides: teardown and gc find the resources by them)."""
    tags = {"Name": f"trainyard-{job}", **(user_tags or {}), TAG_KEY: job}
    if attempt is not None:
        tags[ATTEMPT_TAG] = str(attempt)
    return tags


def _tag_list(tags: dict[str, str]) -> list[dict]:
    return [{"Key": k, "Value": v} for k, v in tags.items()]


class Cluster:
    """Creates and tears down one job's resources. `session` is a boto3 Session (tests register botocore
    event hooks on it); `say` reports progress."""

    def __init__(self, session, job: str, *, ledger: Ledger | None = None, say: Callable[[str], None] = print,
                 tags: dict[str, str] | None = None):
        self.session, self.job, self.say = session, job, say
        self.ledger = ledger or Ledger()
        self.tags = dict(tags or {})
        """The user's tags (JobSpec.tags); `provision` takes them from the plan."""
        self.internet = False
        """network={"internet": True}: a created subnet gets a NAT gateway; `provision` takes it from the plan."""
        self.ec2 = session.client("ec2")
        self.iam = session.client("iam")

    def _tags(self, *resources: str, attempt: int | None = None) -> list[dict]:
        """TagSpecifications: the job's tags on each of `resources` (EC2 resource types)."""
        tags = _tag_list(resource_tags(self.job, self.tags, attempt))
        return [{"ResourceType": r, "Tags": tags} for r in resources]

    def _launched(self, use_spot: bool) -> tuple[str, ...]:
        """What a RunInstances creates, by resource type."""
        return ("instance", "volume", "network-interface") + (("spot-instances-request",) if use_spot else ())

    # ---- creation -------------------------------------------------------------------------------------

    def provision(self, plan, user_data: Callable[[int], str], *, attempt: int = 1) -> list[dict]:
        """Create everything and launch the instances; returns RunInstances' instance records. On any
        failure or interrupt, what was created is torn down before the error propagates."""
        self.tags = {**self.tags, **plan.tags}
        self.internet = bool(getattr(plan, "internet", False))
        try:
            subnet = plan.subnets_to_try[0] if plan.subnets_to_try else self._create_subnet(plan.zones_to_try[0])
            self._security_group(subnet)
            self._placement_group()
            profile = plan.instance_profile_arn or self._instance_profile(plan.role_arn)
            self._launch_template(plan, profile, user_data(attempt))
            return self.launch(plan, attempt=attempt)
        except BaseException:
            self.say("provisioning failed: tearing down what was created")
            self.teardown()
            raise

    def _vpc(self, subnet_id: str) -> tuple[str, str]:
        subnet = self.ec2.describe_subnets(SubnetIds=[subnet_id])["Subnets"][0]
        vpc = self.ec2.describe_vpcs(VpcIds=[subnet["VpcId"]])["Vpcs"][0]
        return vpc["VpcId"], vpc["CidrBlock"]

    def _create_subnet(self, zone: str) -> str:
        """A subnet in `zone` of the default VPC, in the first free /20 of its range (network.free_block)."""
        vpcs = self.ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
        if not vpcs:
            raise RuntimeError("no default VPC to create a subnet in: pass subnets=[...] (private subnets with a "
                               "NAT gateway or VPC endpoints for S3, ECR and CloudWatch Logs)")
        vpc = vpcs[0]
        candidate = network.free_block(self.ec2, vpc, SUBNET_PREFIX)
        subnet = self.ec2.create_subnet(VpcId=vpc["VpcId"], CidrBlock=str(candidate), AvailabilityZone=zone,
                                        TagSpecifications=self._tags("subnet"))["Subnet"]["SubnetId"]
        self.ledger.add("subnet", subnet, zone=zone)
        self.say(f"created subnet {subnet} ({candidate}) in {zone}")
        network.connect_job_subnet(self, subnet, vpc["VpcId"], zone, internet=self.internet)
        return subnet

    def _security_group(self, subnet: str) -> str:
        vpc_id, cidr = self._vpc(subnet)
        group = self.ec2.create_security_group(
            GroupName=f"trainyard-{self.job}", Description=f"Trainyard job {self.job}: EFA (all traffic within the group)",
            VpcId=vpc_id, TagSpecifications=self._tags("security-group"))["GroupId"]
        self.ledger.add("security-group", group)
        rules = json.loads(json.dumps(security_group_rules(vpc_cidr=cidr)).replace('"self"', json.dumps(group)))
        self.ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=rules["ingress"],
                                                  TagSpecifications=self._tags("security-group-rule"))
        # a new group already allows all egress to 0.0.0.0/0; add the rest (EFA needs egress to itself)
        existing = self.ec2.describe_security_groups(GroupIds=[group])["SecurityGroups"][0]["IpPermissionsEgress"]
        missing = [r for r in rules["egress"] if not _rule_present(r, existing)]
        if missing:
            self.ec2.authorize_security_group_egress(GroupId=group, IpPermissions=missing,
                                                     TagSpecifications=self._tags("security-group-rule"))
        self.say(f"created EFA security group {group}")
        return group

    def _placement_group(self) -> str:
        name = f"trainyard-{self.job}"
        self.ec2.create_placement_group(GroupName=name, Strategy="cluster",
                                        TagSpecifications=self._tags("placement-group"))
        self.ledger.add("placement-group", name)
        self.say(f"created cluster placement group {name}")
        return name

    def _instance_profile(self, role_arn: str) -> str:
        name = f"trainyard-{self.job}"[:128]
        profile = self.iam.create_instance_profile(InstanceProfileName=name,
                                                   Tags=_tag_list(resource_tags(self.job, self.tags)))
        self.ledger.add("instance-profile", name)
        self.iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=role_arn.rsplit("/", 1)[-1])
        self.ledger.items[-1]["role"] = role_arn.rsplit("/", 1)[-1]
        self.ledger.save()
        self.say(f"created instance profile {name}")
        return profile["InstanceProfile"]["Arn"]

    def _launch_template(self, plan, profile_arn: str, user_data: str) -> str:
        ami = plan.ami_id or resolve_ami(self.session)
        device = plan.root_device_name or root_device(self.ec2, ami)[0]
        data = {
            "ImageId": ami,
            "InstanceType": plan.instance_type,
            "IamInstanceProfile": {"Arn": profile_arn},
            "MetadataOptions": dict(IMDS_OPTIONS),
            "InstanceInitiatedShutdownBehavior": "terminate",  # the user data shuts the instance down at the end
            "UserData": base64.b64encode(user_data.encode()).decode(),
            "BlockDeviceMappings": [{"DeviceName": device, "Ebs": {
                "VolumeSize": plan.root_volume_gib, "VolumeType": "gp3", "DeleteOnTermination": True,
                "Encrypted": True}}],
            "Placement": {"GroupName": f"trainyard-{self.job}"},
            "NetworkInterfaces": self._interfaces(plan, self._launch_subnets(plan)[0]),
            "TagSpecifications": self._tags(*self._launched(plan.use_spot)),
        }
        if plan.use_spot:
            data["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        capacity = getattr(plan, "capacity", None)
        if capacity is not None:  # the reservation by id (targeted and open alike); a Capacity Block its market too
            data["CapacityReservationSpecification"] = {
                "CapacityReservationTarget": {"CapacityReservationId": capacity.reservation_id}}
            if capacity.block:
                data["InstanceMarketOptions"] = {"MarketType": "capacity-block"}
        template = self.ec2.create_launch_template(
            LaunchTemplateName=f"trainyard-{self.job}", LaunchTemplateData=data,
            TagSpecifications=self._tags("launch-template"))["LaunchTemplate"]["LaunchTemplateId"]
        self.ledger.add("launch-template", template)
        self.say(f"created launch template {template}: {len(data['NetworkInterfaces'])} network interface(s) per "
                 f"instance, IMDSv2 (hop limit {IMDS_OPTIONS['HttpPutResponseHopLimit']}), a {plan.root_volume_gib} GB "
                 f"root volume on {device}")
        return template

    def _wait_for_capacity(self, plan) -> None:
        """A Capacity Block that has not begun: wait for its start, then until EC2 reports it active (a launch
        into it fails before). Ctrl-C while waiting tears down what was created, as any interrupt does."""
        capacity = getattr(plan, "capacity", None)
        if capacity is None or capacity.state == "active":
            return
        rid = capacity.reservation_id
        self.say(f"waiting for {capacity.kind} {rid} to begin at {capacity.start:%Y-%m-%d %H:%M} UTC"
                 if capacity.start else f"waiting for {capacity.kind} {rid} to become active")
        started = capacity.start or datetime.now(timezone.utc)
        while True:
            left = (started - datetime.now(timezone.utc)).total_seconds()
            if left > 0:
                time.sleep(min(left, 60))
                continue
            state = self.ec2.describe_capacity_reservations(
                CapacityReservationIds=[rid])["CapacityReservations"][0]["State"]
            if state == "active":
                self.say(f"{capacity.kind} {rid} is active")
                return
            if state != "scheduled" or -left > CAPACITY_ACTIVE_WAIT_S:
                raise RuntimeError(f"{capacity.kind} {rid} is {state}, not active, {-left / 60:.0f} minutes after "
                                   "its start; nothing was launched into it")
            time.sleep(CAPACITY_POLL_S)

    def _interfaces(self, plan, subnet: str) -> list[dict]:
        return network_interfaces(plan.facts, subnet_id=subnet, security_group_id=self.ledger.ids("security-group")[0],
                                  extra_security_group_ids=plan.security_group_ids)

    def _launch_subnets(self, plan) -> list[str]:
        return list(plan.subnets_to_try) or self.ledger.ids("subnet")

    # ---- launch ---------------------------------------------------------------------------------------

    def launch(self, plan, *, attempt: int) -> list[dict]:
        """All instances in one RunInstances, in the first subnet with the capacity. The user's subnets are
        tried in order; without them, a subnet is created in each zone that offers the type in turn. With a
        capacity reservation preflight left only its zone (no zone fallback), and a Capacity Block that has not
        begun is waited for."""
        self._wait_for_capacity(plan)
        template = self.ledger.ids("launch-template")[0]
        tried: list[str] = []
        candidates = list(plan.subnets_to_try) or [None] * len(plan.zones_to_try)
        for i, subnet in enumerate(candidates):
            if subnet is None:  # created subnets: the first exists already, the next zone gets a new one
                subnet = self.ledger.ids("subnet")[0] if i == 0 else self._create_subnet(plan.zones_to_try[i])
            version = "$Default" if i == 0 else self._template_version(template, plan, subnet)
            try:
                reply = self.ec2.run_instances(
                    MinCount=plan.instance_count, MaxCount=plan.instance_count,
                    LaunchTemplate={"LaunchTemplateId": template, "Version": version},
                    TagSpecifications=self._tags(*self._launched(plan.use_spot), attempt=attempt),
                    ClientToken=f"{self.job}-{attempt}-{i}"[:64])
            except Exception as e:  # botocore's ClientError
                if error_code(e) not in CAPACITY_ERRORS:
                    raise
                zone = self.ec2.describe_subnets(SubnetIds=[subnet])["Subnets"][0]["AvailabilityZone"]
                tried.append(f"{subnet} ({zone}): {error_code(e)}")
                self.say(f"no capacity for {plan.instance_count} x {plan.instance_type} in {zone} ({error_code(e)}); "
                         + ("trying the next subnet" if i + 1 < len(candidates) else "no subnet left"))
                continue
            instances = reply["Instances"]
            for inst in instances:
                self.ledger.add("instance", inst["InstanceId"], attempt=attempt)
            self.say(f"launched {len(instances)} x {plan.instance_type} in {subnet}: "
                     + ", ".join(i["InstanceId"] for i in instances))
            return instances
        capacity = getattr(plan, "capacity", None)
        if capacity is not None:  # no other zone can serve a reservation
            raise CapacityError(f"{capacity.kind} {capacity.reservation_id} had no room for {plan.instance_count} x "
                                f"{plan.instance_type}; tried " + "; ".join(tried) + ". Instances that ended in it "
                                "free their place after a few minutes: try again then, or lower instance_count")
        raise CapacityError(f"no capacity for {plan.instance_count} x {plan.instance_type} launched together; tried "
                            + "; ".join(tried) + ". Try again later, add subnets in other zones (subnets=[...]), "
                            "lower instance_count, or use a capacity reservation")

    def relaunch(self, user_data: str, *, attempt: int, count: int, use_spot: bool = True) -> list[dict] | None:
        """Launch all `count` instances again (a spot job's next attempt) with new user data, in the
        subnet that worked; None on a capacity error (the caller retries later)."""
        template = self.ledger.ids("launch-template")[0]
        version = self.ec2.create_launch_template_version(
            LaunchTemplateId=template, SourceVersion="$Latest",
            LaunchTemplateData={"UserData": base64.b64encode(user_data.encode()).decode()})
        try:
            reply = self.ec2.run_instances(
                MinCount=count, MaxCount=count,
                TagSpecifications=self._tags(*self._launched(use_spot), attempt=attempt),
                LaunchTemplate={"LaunchTemplateId": template,
                                "Version": str(version["LaunchTemplateVersion"]["VersionNumber"])})
        except Exception as e:  # noqa: BLE001
            if error_code(e) in CAPACITY_ERRORS:
                self.say(f"attempt {attempt}: no capacity yet ({error_code(e)}); retrying")
                return None
            raise
        for inst in reply["Instances"]:
            self.ledger.add("instance", inst["InstanceId"], attempt=attempt)
        self.say(f"attempt {attempt}: launched " + ", ".join(i["InstanceId"] for i in reply["Instances"]))
        return reply["Instances"]

    def _template_version(self, template: str, plan, subnet: str) -> str:
        version = self.ec2.create_launch_template_version(
            LaunchTemplateId=template, SourceVersion="1",
            LaunchTemplateData={"NetworkInterfaces": self._interfaces(plan, subnet)})
        return str(version["LaunchTemplateVersion"]["VersionNumber"])

    # ---- teardown -------------------------------------------------------------------------------------

    def teardown(self) -> list[str]:
        """Delete everything in the ledger, newest first; what is already gone is skipped. Returns what
        could not be deleted (also reported)."""
        left: list[dict] = []
        instances = self.ledger.ids("instance")
        if instances:
            self.terminate(instances)
        for item in reversed(self.ledger.items):
            kind, ident = item["kind"], item["id"]
            if kind == "instance":
                continue
            try:
                _DELETE[kind](self, item)
                if kind not in ("endpoint-use", "shared-network"):  # shared: they say what they delete
                    self.say(f"deleted {kind} {ident}")
            except Exception as e:  # noqa: BLE001 - keep going: the rest must still be deleted
                if any(code in error_code(e) for code in NOT_FOUND):
                    continue
                left.append({**item, "error": str(e)})
                self.say(f"WARNING: could not delete {kind} {ident} ({e}); `trainyard gc` retries")
        self.ledger.items = left
        self.ledger.save()
        return [f"{i['kind']} {i['id']}: {i['error']}" for i in left]

    def terminate(self, instance_ids: list[str], *, wait: bool = True) -> None:
        """Terminate the instances; with `wait`, until EC2 reports them terminated (their interfaces are
        released then, which the security group and placement group deletions need)."""
        alive = [i for i in instance_ids if self._state(i) not in ("terminated", None)]
        if alive:
            self.ec2.terminate_instances(InstanceIds=alive)
            self.say(f"terminating {', '.join(alive)}")
        deadline = time.monotonic() + WAIT_S
        while wait and alive and time.monotonic() < deadline:
            alive = [i for i in alive if self._state(i) not in ("terminated", None)]
            if alive:
                time.sleep(2)

    def _state(self, instance_id: str) -> str | None:
        try:
            reservations = self.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
        except Exception as e:  # noqa: BLE001
            if "NotFound" in error_code(e):
                return None
            raise
        return reservations[0]["Instances"][0]["State"]["Name"] if reservations else None


def _delete_profile(cluster: Cluster, item: dict) -> None:
    if item.get("role"):
        try:
            cluster.iam.remove_role_from_instance_profile(InstanceProfileName=item["id"], RoleName=item["role"])
        except Exception as e:  # noqa: BLE001
            if "NoSuchEntity" not in error_code(e):
                raise
    cluster.iam.delete_instance_profile(InstanceProfileName=item["id"])


_DELETE: dict[str, Callable[[Cluster, dict], Any]] = {
    "launch-template": lambda c, i: c.ec2.delete_launch_template(LaunchTemplateId=i["id"]),
    "instance-profile": _delete_profile,
    "placement-group": lambda c, i: retrying(lambda: c.ec2.delete_placement_group(GroupName=i["id"])),
    "security-group": lambda c, i: retrying(lambda: c.ec2.delete_security_group(GroupId=i["id"])),
    "endpoint-use": network.release_endpoint,
    "shared-network": lambda c, i: network.release_shared_subnet(c.ec2, i["id"], c.say),
    "nat-gateway": network.delete_nat,
    "elastic-ip": lambda c, i: retrying(lambda: c.ec2.release_address(AllocationId=i["id"]),
                                        codes=("InvalidIPAddress.InUse", "AuthFailure")),
    "vpc-endpoint": lambda c, i: c.ec2.delete_vpc_endpoints(VpcEndpointIds=[i["id"]]),
    "route-table": network.delete_route_table,
    "subnet": lambda c, i: retrying(lambda: c.ec2.delete_subnet(SubnetId=i["id"])),
}


def _rule_present(rule: dict, existing: list[dict]) -> bool:
    for have in existing:
        if have.get("IpProtocol") != rule["IpProtocol"]:
            continue
        want_groups = {p["GroupId"] for p in rule.get("UserIdGroupPairs", [])}
        want_cidrs = {r["CidrIp"] for r in rule.get("IpRanges", [])}
        if want_groups <= {p["GroupId"] for p in have.get("UserIdGroupPairs", [])} and \
                want_cidrs <= {r["CidrIp"] for r in have.get("IpRanges", [])}:
            return True
    return False


def image_root(image: dict) -> tuple[str, int | None]:
    """(root device name, size in GB of its snapshot or None) of one DescribeImages image."""
    device = image.get("RootDeviceName") or DEFAULT_ROOT_DEVICE
    size = next((m["Ebs"].get("VolumeSize") for m in image.get("BlockDeviceMappings", [])
                 if m.get("DeviceName") == device and m.get("Ebs")), None)
    return device, size


def root_device(ec2, ami: str) -> tuple[str, int | None]:
    """`image_root` of the AMI, from DescribeImages."""
    images = ec2.describe_images(ImageIds=[ami])["Images"]
    if not images:
        raise RuntimeError(f"AMI {ami} not found")
    return image_root(images[0])


def root_volume_gib(volume_size: int, snapshot_gib: int | None) -> int:
    """The root volume: volume_size, or the AMI's root snapshot when that is larger (EC2 refuses a
    volume smaller than its snapshot). infra/modules/cluster computes the same."""
    return max(volume_size, snapshot_gib or 0)


def resolve_ami(session) -> str:
    """`TRAINYARD_AMI_ID`, else the region's Deep Learning Base AMI from its public SSM parameter."""
    if os.environ.get("TRAINYARD_AMI_ID"):
        return os.environ["TRAINYARD_AMI_ID"]
    try:
        return session.client("ssm").get_parameter(Name=AMI_PARAMETER)["Parameter"]["Value"]
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"could not resolve the Deep Learning AMI from SSM {AMI_PARAMETER} ({e}); set "
                           "TRAINYARD_AMI_ID to an AMI with the NVIDIA and EFA drivers and docker") from None


def find_tagged(session, job: str | None = None) -> dict[str, list[dict]]:
    """Every Trainyard-tagged resource of `job` (or of all jobs): {kind: [{"id", "job", ...}]}, for gc."""
    ec2, iam = session.client("ec2"), session.client("iam")
    flt = [{"Name": f"tag:{TAG_KEY}", "Values": [job]}] if job else [{"Name": "tag-key", "Values": [TAG_KEY]}]

    def job_of(tags: list[dict] | None) -> str | None:
        return next((t["Value"] for t in tags or [] if t["Key"] == TAG_KEY), None)

    found: dict[str, list[dict]] = {"instance": [], "launch-template": [], "placement-group": [],
                                    "security-group": [], "subnet": [], "instance-profile": [], "route-table": [],
                                    "vpc-endpoint": [], "nat-gateway": [], "elastic-ip": [], "endpoint-use": []}
    for r in ec2.describe_instances(Filters=flt)["Reservations"]:
        for i in r["Instances"]:
            found["instance"].append({"id": i["InstanceId"], "job": job_of(i.get("Tags")), "state": i["State"]["Name"]})
    for t in ec2.describe_launch_templates(Filters=flt)["LaunchTemplates"]:
        found["launch-template"].append({"id": t["LaunchTemplateId"], "job": job_of(t.get("Tags"))})
    for g in ec2.describe_placement_groups(Filters=flt)["PlacementGroups"]:
        found["placement-group"].append({"id": g["GroupName"], "job": job_of(g.get("Tags"))})
    for g in ec2.describe_security_groups(Filters=flt)["SecurityGroups"]:
        found["security-group"].append({"id": g["GroupId"], "job": job_of(g.get("Tags"))})
    for s in ec2.describe_subnets(Filters=flt)["Subnets"]:
        found["subnet"].append({"id": s["SubnetId"], "job": job_of(s.get("Tags"))})
    for t in ec2.describe_route_tables(Filters=flt)["RouteTables"]:
        found["route-table"].append({"id": t["RouteTableId"], "job": job_of(t.get("Tags"))})
    for e in ec2.describe_vpc_endpoints(Filters=flt)["VpcEndpoints"]:
        if e.get("State", "").lower() not in ("deleted", "deleting"):
            found["vpc-endpoint"].append({"id": e["VpcEndpointId"], "job": job_of(e.get("Tags"))})
    for n in ec2.describe_nat_gateways(Filters=flt)["NatGateways"]:
        if n["State"] not in ("deleted", "deleting"):
            found["nat-gateway"].append({"id": n["NatGatewayId"], "job": job_of(n.get("Tags"))})
    for a in ec2.describe_addresses(Filters=flt)["Addresses"]:
        found["elastic-ip"].append({"id": a["AllocationId"], "job": job_of(a.get("Tags"))})
    shared = [{"Name": f"tag:{network.SHARED_TAG}", "Values": ["endpoints"]}]
    for e in ec2.describe_vpc_endpoints(Filters=shared)["VpcEndpoints"]:
        for t in e.get("Tags", []):
            user = t["Key"].removeprefix(network.USES_PREFIX)
            if t["Key"].startswith(network.USES_PREFIX) and (job is None or user == job):
                found["endpoint-use"].append({"id": e["VpcEndpointId"], "job": user, "vpc": e["VpcId"]})
    for page in iam.get_paginator("list_instance_profiles").paginate(PathPrefix="/"):
        for p in page["InstanceProfiles"]:
            if not p["InstanceProfileName"].startswith("trainyard-"):
                continue
            tags = iam.get_instance_profile(InstanceProfileName=p["InstanceProfileName"])["InstanceProfile"].get("Tags")
            owner = job_of(tags)
            if owner and (job is None or owner == job):
                roles = [r["RoleName"] for r in p.get("Roles", [])]
                found["instance-profile"].append({"id": p["InstanceProfileName"], "job": owner,
                                                  "role": roles[0] if roles else None})
    return found
