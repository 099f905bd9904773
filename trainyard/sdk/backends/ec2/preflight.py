"""Preflight for the EC2 backend: check a JobSpec against the user's account and region, spending
nothing and creating nothing (only Describe/Get/List calls), and return the Plan that the backend
executes and `fit(dry_run=True)` prints.

Every failure is a ConfigError naming the field at fault and the fix. Checks that the account
cannot answer (a quota API without permission, an image outside ECR) become notes, not failures.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from urllib.parse import unquote

from trainyard.job import catalog
from trainyard.job.facts import InstanceFacts, network_interfaces
from trainyard.errors import ConfigError
from trainyard.sdk.backends.aws.session import check_session, new_session
from trainyard.sdk.backends.ec2 import network
from trainyard.sdk.backends.ec2.capacity import Capacity, check_capacity
from trainyard.job.uris import split_fsx
from trainyard.sdk.backends.ec2.provision import resolve_ami, resource_tags, root_device, root_volume_gib

# EC2 vCPU quotas in Service Quotas (service code "ec2"), per family: (On-Demand, Spot).
# Running instances of the same family count against them too.
QUOTA_CODES = {
    "p": ("L-417A185B", "L-7212CCBC"),    # Running On-Demand P instances / All P Spot Instance Requests
    "g": ("L-DB2E81BA", "L-3819A6DF"),    # Running On-Demand G and VT instances / All G and VT Spot
    "trn": ("L-2C3B7624", "L-6B0D517C"),  # Running On-Demand Trn instances / All Trn Spot
    # Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances / All Standard Spot Instance Requests
    **{family: ("L-1216C47A", "L-34B43A08") for family in ("c", "m", "r", "t")},
}
# Regions with most GPU capacity: asked (LocationType=region) only to suggest where an unoffered type runs
_SUGGEST_REGIONS = ("us-east-1", "us-east-2", "us-west-2", "eu-west-1", "ap-northeast-1")
# <account>.dkr.ecr.<region>.amazonaws.com[.cn]/<repo>[:tag][@sha256:<64 hex>]
_ECR = re.compile(r"^(?P<acct>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/"
                  r"(?P<repo>[a-z0-9._/-]+)(?::(?P<tag>[\w.-]+))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")
# FSx states in which a file system will never serve a mount
_FSX_DEAD = ("FAILED", "DELETING", "MISCONFIGURED")
MAX_TAGS = 50  # EC2 and IAM: tags per resource
# botocore reads AWS_DEFAULT_REGION only; Trainyard reads AWS_REGION first (as the AWS CLI v2 does)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the EC2 backend will do for one job, found by `preflight` before anything is created."""

    job_name: str | None
    region: str
    instance_type: str
    instance_count: int
    zone: str
    zone_id: str
    subnet_id: str | None
    """The first subnet to launch in; None: the backend creates a subnet in `zone`."""
    subnets_to_try: tuple[str, ...]
    """The user's subnets that can run the job, in the user's order (tried in turn on capacity errors)."""
    zones_to_try: tuple[str, ...]
    """The zones in launch order (the zones of `subnets_to_try`, or offered zones for a created subnet)."""
    facts: InstanceFacts
    efa_interfaces: int
    """EFA interfaces per instance; 0 without EFA."""
    image_uri: str
    role_arn: str
    instance_profile_arn: str | None
    """An existing instance profile holding the role; None: the backend creates one."""
    channels: tuple[tuple[str, str], ...]
    """(name, uri) of every input channel."""
    fsx: tuple[dict, ...]
    """{channel, file_system_id, dns_name, mount_name, directory, zone, vpc_id} per fsx:// channel."""
    price_per_instance_hour: float | None
    """On-Demand list price from the shipped price table; None when the table has none."""
    price_as_of: str
    estimated_cost_per_hour: float | None
    """All instances; for spot, the list price times (1 - the table's spot discount estimate)."""
    estimated_cost_max_run: float | None
    """`estimated_cost_per_hour` for max_run (not max_wait: waiting for spot capacity is not billed)."""
    max_run: int
    use_spot: bool
    quota_note: str
    notes: tuple[str, ...]
    tags: dict[str, str] = field(default_factory=dict)
    """The user's tags (JobSpec.tags), put on every resource created besides Trainyard's own."""
    security_group_ids: tuple[str, ...] = ()
    """The user's security groups, on every network interface next to the job's EFA group."""
    volume_size: int = 30
    """JobSpec.volume_size: the root volume asked for, GB."""
    root_volume_gib: int = 30
    """The root volume created: volume_size, or the AMI's root snapshot when that is larger."""
    ami_id: str | None = None
    """The AMI resolved by preflight; None: provisioning resolves it."""
    root_device_name: str | None = None
    """The AMI's root device (DescribeImages); None: provisioning reads it."""
    capacity: Capacity | None = None
    """The capacity reservation or Capacity Block the instances launch into (its zone only); None: none."""
    warnings: tuple[str, ...] = ()
    """What will go wrong if nothing changes (a Capacity Block that ends before max_run), printed before the notes."""
    internet: bool = False
    """network={"internet": True}: a created subnet also gets a NAT gateway (sdk/backends/ec2/network.py)."""
    network_lines: tuple[str, ...] = ()
    """What a created subnet comes with and what that costs per hour (empty with the user's subnets)."""

    def describe(self) -> str:
        """The plan in words: what `fit(dry_run=True)` prints."""
        f, n = self.facts, self.instance_count
        accel = f"{f.gpus} x {f.gpu_name}" if f.gpus else "no GPU"
        efa = f"{self.efa_interfaces} EFA interfaces per instance" if self.efa_interfaces else "no EFA (one interface)"
        subnets = (f"{', '.join(self.subnets_to_try)} (in this order on capacity errors)" if self.subnet_id else
                   f"a new subnet in {self.zone}; fallback zones: {', '.join(self.zones_to_try[1:]) or 'none'}")
        market = "Spot" if self.use_spot else self.capacity.kind if self.capacity else "On-Demand"
        lines = [f"Plan for job {self.job_name or '(unnamed)'}: {n} x {self.instance_type} "
                 f"({market}) in {self.region}, zone {self.zone} ({self.zone_id})",
                 f"  instances: {n} x {self.instance_type}: {accel} each ({n * f.gpus} GPUs in all), "
                 f"{f.vcpus} vCPUs, {f.memory_mib // 1024} GiB memory",
                 f"  network:   {efa}, placement group strategy 'cluster', one zone",
                 f"  subnets:   {subnets}",
                 *[f"  vpc:       {line}" for line in self.network_lines],
                 f"  image:     {self.image_uri}",
                 f"  role:      {self.role_arn}",
                 f"  profile:   {self.instance_profile_arn or 'an instance profile is created for the role'}"]
        if self.capacity is not None:
            lines.insert(2, f"  capacity:  {self.capacity.describe(self.instance_type)}")
        fsx = {d["channel"]: d for d in self.fsx}
        for name, uri in self.channels:
            d = fsx.get(name)
            mount = f" -> mount {d['dns_name']}@tcp:/{d['mount_name'] or '<MountName>'}" if d else ""
            lines.append(f"  channel:   {name} <- {uri}{mount}")
        if self.capacity is not None and self.capacity.block:
            listed = (f"; the On-Demand list price would be ${self.price_per_instance_hour:,.4f}/instance-hour as of "
                      f"{self.price_as_of}" if self.price_per_instance_hour is not None else "")
            lines.append(f"  cost:      $0.00/hour for {n} instance(s) here: the Capacity Block was paid upfront when "
                         f"it was reserved{listed}")
        elif self.price_per_instance_hour is None:
            lines.append(f"  cost:      unknown (no list price for {self.instance_type} in {self.region})")
        else:
            kind = "Spot estimate" if self.use_spot else "On-Demand list price"
            lines.append(f"  cost:      ${self.estimated_cost_per_hour:,.2f}/hour for {n} instance(s) ({kind}; list "
                         f"${self.price_per_instance_hour:,.4f}/instance-hour as of {self.price_as_of}); at most "
                         f"${self.estimated_cost_max_run:,.2f} for max_run {self.max_run / 3600:g} h")
        device = f" on {self.root_device_name}" if self.root_device_name else ""
        ami = f" (AMI {self.ami_id})" if self.ami_id else ""
        lines.append(f"  storage:   {self.root_volume_gib} GB gp3 root volume{device} per instance{ami}, encrypted, "
                     f"deleted with the instance ({n * self.root_volume_gib} GB in all)")
        if self.security_group_ids:
            groups = ", ".join(self.security_group_ids)
            lines.append(f"  security:  the job's EFA group and {groups} on every interface")
        if self.tags:
            lines.append("  tags:      " + ", ".join(f"{k}={v}" for k, v in self.tags.items())
                         + " (with trainyard:job) on every resource created")
        lines.append(f"  quota:     {self.quota_note}")
        return "\n".join(lines + [f"  WARNING:   {x}" for x in self.warnings]
                         + [f"  note:      {x}" for x in self.notes])


def prices() -> dict:
    """The shipped price table (trainyard/job/catalog/prices.json)."""
    return catalog.price_table()


def preflight(spec, *, session=None) -> Plan:
    """Check `spec` (a JobSpec for an EC2 instance type) in the session's region and return its Plan.
    `session`: a boto3.Session (default: a new one, region and credentials from the environment)."""
    if catalog.lookup(spec.instance_type).is_local:
        raise ConfigError("instance_type", "'local' runs on this machine; preflight is for EC2 instance types")
    session = session or new_session()
    check_session(session, how="pass boto_session=boto3.Session(region_name=...)")
    region = session.region_name
    ec2, notes = session.client("ec2"), []
    _check_tags(spec)
    facts = _instance_facts(ec2, spec.instance_type, region)
    _check_efa(spec, facts)
    zones = _offered_zones(session, ec2, spec.instance_type, region)
    subnets = _subnets(ec2, spec, zones, notes)
    warnings: list[str] = []
    capacity, subnets = check_capacity(ec2, spec, zones, subnets, notes, warnings)
    if spec.subnets:  # the user's own network: it must reach S3, ECR, CloudWatch Logs and EC2
        network.refuse_unreachable(ec2, ec2.describe_subnets(SubnetIds=[s for s, _ in subnets])["Subnets"])
    quota_note = _check_quota(session, spec, facts, region)
    role_arn, profile_arn = _check_role(session, spec.role, notes)
    _check_image(session, spec.image_uri, region, notes)
    fsx, subnets = _check_fsx(session, ec2, spec, zones, subnets, notes)
    _check_security_groups(ec2, spec, subnets)
    ami_id, device, root_gib = _root_volume(session, ec2, spec, notes)
    price, as_of, per_hour, max_run_cost = _cost(spec, region, notes)
    if capacity is not None and capacity.block:  # paid upfront when the block was bought
        per_hour, max_run_cost = 0.0, 0.0
    subnet_ids = tuple(s for s, _ in subnets if s)
    zone = subnets[0][1]
    internet = bool(spec.network and spec.network.internet)
    network_lines = () if subnet_ids else tuple(_created_network(ec2, region, internet))
    return Plan(
        job_name=spec.job_name, region=region, instance_type=spec.instance_type,
        instance_count=spec.instance_count, zone=zone, zone_id=zones[zone],
        subnet_id=subnet_ids[0] if subnet_ids else None, subnets_to_try=subnet_ids,
        zones_to_try=tuple(z for _, z in subnets), facts=facts,
        efa_interfaces=facts.max_efa_interfaces if facts.efa_supported else 0,
        image_uri=spec.image_uri, role_arn=role_arn, instance_profile_arn=profile_arn,
        channels=tuple((c.name, c.uri) for c in spec.channels), fsx=tuple(fsx),
        price_per_instance_hour=price, price_as_of=as_of, estimated_cost_per_hour=per_hour,
        estimated_cost_max_run=max_run_cost, max_run=spec.max_run, use_spot=spec.use_spot_instances,
        quota_note=quota_note, notes=tuple(notes), tags=dict(spec.tags), security_group_ids=spec.security_group_ids,
        volume_size=spec.volume_size, root_volume_gib=root_gib, ami_id=ami_id, root_device_name=device,
        capacity=capacity, warnings=tuple(warnings),
        internet=internet, network_lines=network_lines,
    )


def _created_network(ec2, region: str, internet: bool) -> list[str]:
    """What a created subnet comes with (sdk/backends/ec2/network.py) and its hourly price, for the plan."""
    vpcs = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
    have = network.find_endpoints(ec2, vpcs[0]["VpcId"]) if vpcs else {}
    to_create = [s for s in network.INTERFACE_SERVICES if s not in have]
    return network.describe_cost(prices(), region, internet=internet, shared_to_create=len(to_create))


def _code(e: Exception) -> str:
    return getattr(e, "response", {}).get("Error", {}).get("Code", type(e).__name__)


def _instance_facts(ec2, itype: str, region: str) -> InstanceFacts:
    from botocore.exceptions import ClientError

    try:
        rows = ec2.describe_instance_types(InstanceTypes=[itype])["InstanceTypes"]
    except ClientError as e:
        if _code(e) != "InvalidInstanceType":
            raise
        rows = []
    if not rows:
        raise ConfigError("instance_type", f"{itype} does not exist in {region}; pick another type or region")
    return InstanceFacts.from_api(rows[0])


def _check_efa(spec, facts: InstanceFacts) -> None:
    if spec.instance_count > 1 and not facts.efa_supported:
        raise ConfigError("instance_type", f"{facts.name} has no EFA, and multi-node training "
                          f"(instance_count={spec.instance_count}) needs EFA between the hosts: use an EFA type "
                          "such as p4d.24xlarge, p5.48xlarge or trn1.32xlarge, or instance_count=1")
    try:  # the interface layout the backend will request must fit the network cards
        network_interfaces(facts, subnet_id="subnet-planned", security_group_id="sg-planned")
    except ValueError as e:
        raise ConfigError("instance_type", str(e)) from None


def _offered_zones(session, ec2, itype: str, region: str) -> dict[str, str]:
    """{zone name: zone id} of the available zones that offer `itype`, in zone-name order."""
    pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [itype]}])
    offered = {o["Location"] for page in pages for o in page["InstanceTypeOfferings"]}
    azs = ec2.describe_availability_zones(Filters=[{"Name": "zone-type", "Values": ["availability-zone"]}])
    zones = {z["ZoneName"]: z["ZoneId"] for z in sorted(azs["AvailabilityZones"], key=lambda z: z["ZoneName"])
             if z["ZoneName"] in offered and z.get("State", "available") == "available"}
    if not zones:
        others = [r for r in _SUGGEST_REGIONS if r != region and _offered_in_region(session, itype, r)]
        hint = f"regions that offer it: {', '.join(others)}" if others else "try another instance type"
        raise ConfigError("instance_type", f"{itype} is not offered in any zone of {region}; {hint} "
                          "(set AWS_DEFAULT_REGION), or see `aws ec2 describe-instance-type-offerings`")
    return zones


def _offered_in_region(session, itype: str, region: str) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        rows = session.client("ec2", region_name=region).describe_instance_type_offerings(
            LocationType="region", Filters=[{"Name": "instance-type", "Values": [itype]}])
        return bool(rows["InstanceTypeOfferings"])
    except (BotoCoreError, ClientError):
        return False


def _subnets(ec2, spec, zones: dict[str, str], notes: list) -> list[tuple[str | None, str]]:
    """(subnet id or None for a created subnet, zone) to try in order."""
    if not spec.subnets:
        return [(None, z) for z in zones]
    found = ec2.describe_subnets(Filters=[{"Name": "subnet-id", "Values": list(spec.subnets)}])["Subnets"]
    by_id = {s["SubnetId"]: s for s in found}
    missing = [s for s in spec.subnets if s not in by_id]
    if missing:
        raise ConfigError("subnets", f"subnet(s) {', '.join(missing)} not found in {ec2.meta.region_name}; "
                          "pass subnets of this region's VPCs, or omit subnets to have one created")
    usable = [(s, by_id[s]["AvailabilityZone"]) for s in spec.subnets if by_id[s]["AvailabilityZone"] in zones]
    dropped = [f"{s} ({by_id[s]['AvailabilityZone']})" for s in spec.subnets if s not in dict(usable)]
    if not usable:
        raise ConfigError("subnets", f"{spec.instance_type} is not offered in the zones of {', '.join(dropped)}; "
                          f"it is offered in {', '.join(zones)}: pass a subnet there, or omit subnets")
    if dropped:
        notes.append(f"skipping subnet(s) {', '.join(dropped)}: {spec.instance_type} is not offered there")
    return usable





def _check_tags(spec) -> None:
    own = [k for k in spec.tags if k.lower().startswith("trainyard:")]
    if own:
        raise ConfigError("tags", f"{own[0]!r}: keys starting with 'trainyard:' are Trainyard's own (teardown and gc "
                          "find a job's resources by them); use another key")
    count = len(resource_tags(spec.job_name or "job", spec.tags, attempt=1))
    if count > MAX_TAGS:
        raise ConfigError("tags", f"{len(spec.tags)} tags and Trainyard's own make {count}, over EC2's {MAX_TAGS} per "
                          "resource: drop some")


def _check_security_groups(ec2, spec, subnets: list[tuple[str | None, str]]) -> None:
    """The user's security groups exist, in the VPC the instances launch in (the given subnets', or the
    default VPC where a subnet is created)."""
    wanted = list(spec.security_group_ids)
    if not wanted:
        return
    region = ec2.meta.region_name
    given = [s for s, _ in subnets if s]
    if given:
        vpcs = {s["VpcId"] for s in ec2.describe_subnets(SubnetIds=given)["Subnets"]}
        where = f"the VPC of the subnets ({', '.join(sorted(vpcs))})"
    else:
        default = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
        if not default:
            raise ConfigError("security_group_ids", f"the job's subnet would be created in the default VPC, and "
                              f"{region} has none: pass subnets=[...] of the groups' VPC")
        vpcs = {default[0]["VpcId"]}
        where = f"the default VPC ({default[0]['VpcId']}), where the job's subnet is created"
    found = {g["GroupId"]: g for g in ec2.describe_security_groups(
        Filters=[{"Name": "group-id", "Values": wanted}])["SecurityGroups"]}
    missing = [g for g in wanted if g not in found]
    if missing:
        raise ConfigError("security_group_ids", f"security group(s) {', '.join(missing)} not found in {region}; "
                          "pass groups of the job's VPC")
    elsewhere = [f"{g} (in {found[g]['VpcId']})" for g in wanted if {found[g]["VpcId"]} != vpcs]
    if elsewhere:
        raise ConfigError("security_group_ids", f"security group(s) {', '.join(elsewhere)} not in {where}, where "
                          "the instances launch: pass groups of that VPC, or subnets of the groups' VPC")


def _root_volume(session, ec2, spec, notes: list) -> tuple[str | None, str | None, int]:
    """(AMI, its root device, root volume GB): volume_size, raised to the AMI's root snapshot when that
    is larger (EC2 refuses a smaller volume). An AMI that cannot be resolved or read now is a note."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        ami = resolve_ami(session)
    except RuntimeError as e:
        notes.append(f"root volume {spec.volume_size} GB not checked against the AMI ({e})")
        return None, None, spec.volume_size
    try:
        device, snapshot = root_device(ec2, ami)
    except (ClientError, BotoCoreError, RuntimeError) as e:
        gone = isinstance(e, RuntimeError) or _code(e).startswith("InvalidAMIID")
        if gone and os.environ.get("TRAINYARD_AMI_ID"):
            raise ConfigError("TRAINYARD_AMI_ID", f"AMI {ami} not found in {ec2.meta.region_name}: set it to an AMI "
                              "of this region with the NVIDIA and EFA drivers and docker") from None
        notes.append(f"AMI {ami} could not be read ({_code(e)}); its root device is read again at launch")
        return ami, None, spec.volume_size
    size = root_volume_gib(spec.volume_size, snapshot)
    if size != spec.volume_size:
        notes.append(f"volume_size={spec.volume_size} GB is smaller than the root snapshot of AMI {ami} "
                     f"({snapshot} GB): the root volumes are {size} GB")
    return ami, device, size


def _check_quota(session, spec, facts: InstanceFacts, region: str) -> str:
    from botocore.exceptions import BotoCoreError, ClientError

    family = next((f for f in sorted(QUOTA_CODES, key=len, reverse=True) if spec.instance_type.startswith(f)), None)
    if family is None:
        return f"not checked: no EC2 vCPU quota code known for {spec.instance_type}"
    code = QUOTA_CODES[family][1 if spec.use_spot_instances else 0]
    need = spec.instance_count * facts.vcpus
    try:
        quota = session.client("service-quotas").get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
    except (ClientError, BotoCoreError) as e:
        return f"not checked: Service Quotas did not answer for {code} ({_code(e)}); {need} vCPUs are needed"
    value, name = quota.get("Value", 0.0), quota.get("QuotaName", code)
    if value < need:
        raise ConfigError("instance_count", f"{spec.instance_count} x {spec.instance_type} need {need} vCPUs, but "
                          f"the quota '{name}' ({code}) in {region} is {value:g} vCPUs: request an increase in "
                          f"Service Quotas (aws service-quotas request-service-quota-increase --service-code ec2 "
                          f"--quota-code {code} --desired-value {need}) or lower instance_count")
    return f"{need} of {value:g} vCPUs of '{name}' ({code}); instances already running count against it too"


def _check_role(session, role: str | None, notes: list) -> tuple[str, str | None]:
    """(role ARN, instance profile ARN or None) for `role`: a role ARN or name, or an instance-profile ARN."""
    from botocore.exceptions import ClientError

    if not role:
        raise ConfigError("role", "EC2 jobs need an IAM role for the instances (S3, ECR, CloudWatch Logs): pass "
                          "role='arn:aws:iam::<account>:role/<name>' whose trust policy allows ec2.amazonaws.com")
    iam, name = session.client("iam"), role.rsplit("/", 1)[-1]
    profile_arn = None
    try:
        if ":instance-profile/" in role:
            profile = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]
            if not profile.get("Roles"):
                raise ConfigError("role", f"instance profile {name} holds no role: add one with "
                                  "`aws iam add-role-to-instance-profile`, or pass a role")
            profile_arn, found = profile["Arn"], profile["Roles"][0]
        else:
            found = iam.get_role(RoleName=name)["Role"]
    except ClientError as e:
        if _code(e) != "NoSuchEntity":
            notes.append(f"role {role} could not be checked ({_code(e)}); the backend needs iam:GetRole and "
                         "iam:PassRole on it")
            return role, None
        what = "instance profile" if ":instance-profile/" in role else "role"
        where = f"account {role.split(':')[4]}" if role.startswith("arn:") else "this account"
        raise ConfigError("role", f"{what} {name} not found in {where}; create it "
                          "(trusting ec2.amazonaws.com) or pass an existing one") from None
    if not _trusts_ec2(found.get("AssumeRolePolicyDocument", {})):
        raise ConfigError("role", f"role {found['RoleName']} does not trust ec2.amazonaws.com, so instances cannot "
                          "use it: add a trust statement Allow sts:AssumeRole for Service ec2.amazonaws.com")
    if profile_arn is None:
        profiles = iam.list_instance_profiles_for_role(RoleName=found["RoleName"])["InstanceProfiles"]
        profile_arn = profiles[0]["Arn"] if profiles else None
    return found["Arn"], profile_arn


def _trusts_ec2(doc) -> bool:
    if isinstance(doc, str):  # the raw API URL-encodes it; botocore usually decodes it already
        doc = json.loads(unquote(doc))
    for st in doc.get("Statement", []):
        actions = st.get("Action", [])
        actions = [actions] if isinstance(actions, str) else actions
        services = (st.get("Principal") or {}).get("Service", []) if isinstance(st.get("Principal"), dict) else []
        services = [services] if isinstance(services, str) else services
        if (st.get("Effect") == "Allow" and any(a in ("sts:AssumeRole", "sts:*", "*") for a in actions)
                and any(s.startswith("ec2.amazonaws.com") for s in services)):
            return True
    return False


def _check_image(session, image_uri: str | None, region: str, notes: list) -> None:
    from botocore.exceptions import ClientError

    if not image_uri:
        raise ConfigError("image_uri", "EC2 jobs need a training image: push one with `trainyard image push` "
                          "and pass image_uri='<account>.dkr.ecr.<region>.amazonaws.com/<repo>:<tag>'")
    m = _ECR.match(image_uri)
    if not m:
        notes.append(f"image {image_uri} is not in ECR and cannot be checked; the instances must be able to pull it")
        return
    image_id = {"imageDigest": m["digest"]} if m["digest"] else {"imageTag": m["tag"] or "latest"}
    ecr = session.client("ecr", region_name=m["region"])
    try:
        ecr.describe_images(registryId=m["acct"], repositoryName=m["repo"], imageIds=[image_id])
    except ClientError as e:
        code = _code(e)
        if code == "RepositoryNotFoundException":
            raise ConfigError("image_uri", f"ECR repository {m['repo']} not found in account {m['acct']} "
                              f"({m['region']}): push the image with `trainyard image push` or fix the URI") from None
        if code == "ImageNotFoundException":
            raise ConfigError("image_uri", f"image {image_uri} not found in ECR ({m['repo']} has no "
                              f"{next(iter(image_id.values()))}): push it with `trainyard image push` or fix the "
                              "tag") from None
        notes.append(f"image {image_uri} could not be checked ({code})")
    if m["region"] != region:
        notes.append(f"the image is in {m['region']} and the job in {region}: every host pulls it across "
                     f"regions (slower start, transfer cost); push it to {region} to avoid that")


def _check_fsx(session, ec2, spec, zones, subnets, notes):
    """FSx channels: each must be a Lustre file system; the launch candidates shrink to its zone."""
    from botocore.exceptions import ClientError

    out = []
    for ch in (c for c in spec.channels if c.uri.startswith("fsx://")):
        field, (fs_id, directory) = f"inputs.{ch.name}", split_fsx(ch.uri)
        try:
            found = session.client("fsx").describe_file_systems(FileSystemIds=[fs_id])["FileSystems"]
        except ClientError as e:
            if _code(e) != "FileSystemNotFound":
                raise
            found = []
        if not found:  # AWS raises FileSystemNotFound; moto returns an empty list
            raise ConfigError(field, f"FSx file system {fs_id} not found in {ec2.meta.region_name}; fix the id "
                              "or create it (FSx for Lustre)")
        fs = found[0]
        if fs.get("FileSystemType") != "LUSTRE":
            raise ConfigError(field, f"{fs_id} is FSx for {fs.get('FileSystemType')}; fsx:// needs FSx for Lustre")
        if fs.get("Lifecycle") in _FSX_DEAD:
            raise ConfigError(field, f"{fs_id} is {fs['Lifecycle']}; use a healthy file system")
        sub = ec2.describe_subnets(SubnetIds=fs["SubnetIds"][:1])["Subnets"][0]
        zone = sub["AvailabilityZone"]
        here = [s for s in subnets if s[1] == zone]
        if not here:
            if spec.subnets:
                raise ConfigError(field, f"FSx {fs_id} is in {zone}, the subnets are in "
                                  f"{', '.join(sorted({z for _, z in subnets}))}; EFA and Lustre want one zone: "
                                  f"pass a subnet in {zone} (or a file system in the subnets' zone)")
            raise ConfigError(field, f"FSx {fs_id} is in {zone}, where {spec.instance_type} is not offered "
                              f"(offered in {', '.join(zones)}); use a file system in one of those zones")
        subnets = here
        mount = (fs.get("LustreConfiguration") or {}).get("MountName")
        if mount is None:
            notes.append(f"FSx {fs_id} reported no LustreConfiguration.MountName; it must be read again "
                         "before mounting")
        out.append({"channel": ch.name, "file_system_id": fs_id, "dns_name": fs.get("DNSName"),
                    "mount_name": mount, "directory": directory, "zone": zone, "vpc_id": sub["VpcId"]})
    if out and not spec.subnets and len({d["vpc_id"] for d in out}) == 1:
        notes.append(f"the instances must be in {out[0]['vpc_id']}, the FSx file system's VPC")
    return out, subnets


def _cost(spec, region: str, notes: list):
    table = prices()
    price = catalog.hourly_price(spec.instance_type, region, spot=spec.use_spot_instances)  # what describe() uses
    if price is None:
        notes.append(f"no price for {spec.instance_type} in {region} in the price table of {table['as_of']}; "
                     "cost not estimated")
        return None, table["as_of"], None, None
    if spec.use_spot_instances:
        notes.append(f"spot cost estimated at {1 - table['spot_discount_estimate']:.0%} of the On-Demand list price; "
                     "real spot prices vary by zone and hour")
    per_hour = price.per_hour * spec.instance_count
    return table["on_demand"][region][spec.instance_type], table["as_of"], per_hour, per_hour * spec.max_run / 3600
