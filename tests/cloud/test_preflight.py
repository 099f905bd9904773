"""Preflight against a moto server over HTTP: every check, and in every case nothing created.

Each test resets the server, creates what the account should hold (role, ECR image, FSx) with a
separate boto3 session, then runs `preflight` with a session whose `before-call` hook records every
operation: only Describe/Get/List may appear, and the account's EC2 state must be unchanged.
"""
import json
import urllib.request

import boto3
import pytest
from botocore.awsrequest import AWSResponse

from trainyard.sdk.backends.ec2.preflight import Plan, preflight, prices
from trainyard.errors import ConfigError
from trainyard.job.spec import build_spec

from .conftest import reachable_vpc

ACCOUNT = "123456789012"  # moto's default account
TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}
MANIFEST = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {}, "layers": []}
READ_ONLY = ("Describe", "Get", "List")
MUTATING = ("Create", "Run", "Put", "Allocate", "Authorize", "Attach")


@pytest.fixture
def account(s3_endpoint):
    """A fresh moto account holding a role that trusts EC2 and an ECR image `trainyard:v1`."""
    urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/moto-api/reset", method="POST")).read()
    iam, ecr = boto3.client("iam"), boto3.client("ecr")
    role = iam.create_role(RoleName="trainyard-job", AssumeRolePolicyDocument=json.dumps(TRUST))["Role"]["Arn"]
    repo = ecr.create_repository(repositoryName="trainyard")["repository"]["repositoryUri"]
    ecr.put_image(repositoryName="trainyard", imageManifest=json.dumps(MANIFEST), imageTag="v1")
    return {"role": role, "image_uri": f"{repo}:v1"}


def spec(account, **over):
    fields = dict(job_name="pf-job", entry_point="trainyard.engine.train", entry_kind="module",
                  instance_type="p4d.24xlarge", instance_count=2, processes_per_host=8,
                  output_path="s3://some-bucket/out", image_uri=account["image_uri"], role=account["role"],
                  channels=[{"name": "train", "uri": "s3://some-bucket/train"}])
    fields.update(over)
    return build_spec(**fields)


def state() -> dict:
    """What the account holds: compared before and after a preflight."""
    ec2, iam = boto3.client("ec2"), boto3.client("iam")
    return {
        "instances": [i["InstanceId"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]],
        "security_groups": sorted(g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]),
        "launch_templates": ec2.describe_launch_templates()["LaunchTemplates"],
        "subnets": sorted(s["SubnetId"] for s in ec2.describe_subnets()["Subnets"]),
        "vpcs": sorted(v["VpcId"] for v in ec2.describe_vpcs()["Vpcs"]),
        "network_interfaces": ec2.describe_network_interfaces()["NetworkInterfaces"],
        "instance_profiles": [p["Arn"] for p in iam.list_instance_profiles()["InstanceProfiles"]],
        "roles": sorted(r["Arn"] for r in iam.list_roles()["Roles"]),
    }


def run(job, *, region=None, hooks=None, calls=None) -> Plan:
    """preflight(job) with a recording session; asserts it only read, and changed nothing."""
    before = state()
    session = boto3.Session(region_name=region) if region else boto3.Session()
    seen = [] if calls is None else calls
    for event, hook in (hooks or {}).items():
        session.events.register(event, hook)
    session.events.register("before-call.*.*", lambda event_name, **_: seen.append(event_name.split(".", 1)[1]))
    try:
        return preflight(job, session=session)
    finally:
        ops = [s.split(".", 1)[1] for s in seen]
        assert ops, "the recording hook saw no call"
        assert not [o for o in ops if o.startswith(MUTATING)], seen
        assert all(o.startswith(READ_ONLY) for o in ops), seen
        assert state() == before


def respond(parsed: dict, status: int = 200):
    """A before-call hook answering in place of the server (a returned (http, parsed) short-circuits)."""
    return lambda **_: (AWSResponse("http://hook", status, {}, None), parsed)


def subnet_in(zone: str) -> str:
    """The default subnet of `zone`, in a default VPC that reaches S3 and ECR (conftest.reachable_vpc)."""
    reachable_vpc()
    return next(s["SubnetId"] for s in boto3.client("ec2").describe_subnets()["Subnets"]
                if s["AvailabilityZone"] == zone and s.get("DefaultForAz"))


def offered(itype: str, region: str = "us-east-1") -> list[str]:
    rows = boto3.client("ec2", region_name=region).describe_instance_type_offerings(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [itype]}])
    return sorted(o["Location"] for o in rows["InstanceTypeOfferings"])


def lustre(zone: str) -> str:
    return boto3.client("fsx").create_file_system(
        FileSystemType="LUSTRE", StorageCapacity=1200, SubnetIds=[subnet_in(zone)],
        LustreConfiguration={"DeploymentType": "PERSISTENT_2", "PerUnitStorageThroughput": 125},
    )["FileSystem"]["FileSystemId"]


def test_p4d_plan(account):
    calls = []
    plan = run(spec(account), calls=calls)
    price = prices()["on_demand"]["us-east-1"]["p4d.24xlarge"]
    assert (plan.region, plan.instance_type, plan.instance_count) == ("us-east-1", "p4d.24xlarge", 2)
    assert plan.efa_interfaces == 4 and plan.facts.gpus == 8 and plan.facts.vcpus == 96
    zones = offered("p4d.24xlarge")
    assert plan.zone == zones[0] and plan.zones_to_try == tuple(zones) and plan.zone_id.startswith("use1-az")
    assert plan.subnet_id is None and plan.subnets_to_try == ()
    assert plan.role_arn == account["role"] and plan.instance_profile_arn is None
    assert plan.image_uri == account["image_uri"] and plan.fsx == ()
    assert plan.price_per_instance_hour == price and plan.price_as_of == "2026-11-01"
    assert plan.estimated_cost_per_hour == pytest.approx(2 * price)
    assert plan.estimated_cost_max_run == pytest.approx(2 * price * 24)  # default max_run: 24 h
    assert not plan.use_spot
    # moto has no Service Quotas for EC2: not checked, and said so
    assert "not checked" in plan.quota_note and "NoSuchResourceException" in plan.quota_note
    text = plan.describe()
    for want in ("2 x p4d.24xlarge", "us-east-1", plan.zone, "16 GPUs", "4 EFA interfaces per instance",
                 "'cluster'", account["image_uri"], account["role"], "train <- s3://some-bucket/train",
                 f"${2 * price:,.2f}/hour", f"${2 * price * 24:,.2f}", "2026-11-01", "24 h"):
        assert want in text, (want, text)
    assert {"ec2.DescribeInstanceTypes", "ec2.DescribeInstanceTypeOfferings", "iam.GetRole",
            "ecr.DescribeImages", "service-quotas.GetServiceQuota"} <= set(calls)


def test_p5_interfaces_come_from_describe_instance_types(account):
    api = boto3.client("ec2").describe_instance_types(InstanceTypes=["p5.48xlarge"])["InstanceTypes"][0]
    plan = run(spec(account, instance_type="p5.48xlarge"))
    assert plan.efa_interfaces == api["NetworkInfo"]["EfaInfo"]["MaximumEfaInterfaces"] == 32
    # what the API says wins over any table: a changed answer changes the plan
    def fewer(parsed, **_):
        parsed["InstanceTypes"][0]["NetworkInfo"]["EfaInfo"]["MaximumEfaInterfaces"] = 16
    plan = run(spec(account, instance_type="p5.48xlarge"), hooks={"after-call.ec2.DescribeInstanceTypes": fewer})
    assert plan.efa_interfaces == 16 and "16 EFA interfaces" in plan.describe()


def test_existing_instance_profile_is_reused_and_names_are_accepted(account):
    iam = boto3.client("iam")
    profile = iam.create_instance_profile(InstanceProfileName="trainyard-job-profile")["InstanceProfile"]["Arn"]
    iam.add_role_to_instance_profile(InstanceProfileName="trainyard-job-profile", RoleName="trainyard-job")
    for role in ("trainyard-job", account["role"], profile):
        plan = run(spec(account, role=role))
        assert plan.role_arn == account["role"] and plan.instance_profile_arn == profile


def test_type_not_offered_in_the_region(account):
    # moto offers no p5.48xlarge in eu-west-1, and does in us-east-1
    assert offered("p5.48xlarge", "eu-west-1") == []
    with pytest.raises(ConfigError) as e:
        run(spec(account, instance_type="p5.48xlarge"), region="eu-west-1")
    assert e.value.field == "instance_type"
    assert "not offered in any zone of eu-west-1" in str(e.value) and "us-east-1" in str(e.value)


def test_type_not_offered_with_an_empty_offering_list(account):
    def none_in_zones(params, **_):
        if params["body"].get("LocationType") == "availability-zone":
            return AWSResponse("http://hook", 200, {}, None), {"InstanceTypeOfferings": []}
    with pytest.raises(ConfigError) as e:
        run(spec(account), hooks={"before-call.ec2.DescribeInstanceTypeOfferings": none_in_zones})
    assert e.value.field == "instance_type" and "not offered in any zone of us-east-1" in str(e.value)


def test_missing_role(account):
    with pytest.raises(ConfigError) as e:
        run(spec(account, role=None))
    assert e.value.field == "role" and "role=" in str(e.value)
    with pytest.raises(ConfigError) as e:
        run(spec(account, role=f"arn:aws:iam::{ACCOUNT}:role/nobody"))
    assert e.value.field == "role" and f"nobody not found in account {ACCOUNT}" in str(e.value)
    with pytest.raises(ConfigError) as e:
        run(spec(account, role=f"arn:aws:iam::{ACCOUNT}:instance-profile/nothing"))
    assert e.value.field == "role" and "instance profile nothing not found" in str(e.value)


def test_role_that_does_not_trust_ec2(account):
    trust = json.loads(json.dumps(TRUST).replace("ec2.amazonaws.com", "lambda.amazonaws.com"))
    arn = boto3.client("iam").create_role(RoleName="lambda-only", AssumeRolePolicyDocument=json.dumps(trust))
    with pytest.raises(ConfigError) as e:
        run(spec(account, role=arn["Role"]["Arn"]))
    assert e.value.field == "role" and "does not trust ec2.amazonaws.com" in str(e.value)


def test_missing_image(account):
    repo = account["image_uri"].rsplit(":", 1)[0]
    for uri, want in ((f"{repo}:v2", "push it with `trainyard image push` or fix the tag"),
                      (f"{repo}@sha256:{'0' * 64}", "not found in ECR"),
                      (repo.replace("/trainyard", "/nothing") + ":v1", "repository nothing not found")):
        with pytest.raises(ConfigError) as e:
            run(spec(account, image_uri=uri))
        assert e.value.field == "image_uri" and want in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        run(spec(account, image_uri=None))
    assert e.value.field == "image_uri" and "trainyard image push" in str(e.value)


def test_image_outside_ecr_is_a_note(account):
    plan = run(spec(account, image_uri="nvcr.io/nvidia/pytorch:24.05-py3"))
    assert any("not in ECR and cannot be checked" in n for n in plan.notes)


def test_fsx_in_another_zone_than_the_subnets(account):
    fs_id = lustre("us-east-1a")
    job = spec(account, subnets=[subnet_in("us-east-1b")],
               channels=[{"name": "data", "uri": f"fsx://{fs_id}/datasets/c4"}])
    with pytest.raises(ConfigError) as e:
        run(job)
    assert e.value.field == "inputs.data"
    assert f"FSx {fs_id} is in us-east-1a, the subnets are in us-east-1b" in str(e.value)


def test_fsx_pins_the_zone_and_is_recorded(account):
    fs_id = lustre("us-east-1c")
    plan = run(spec(account, channels=[{"name": "data", "uri": f"fsx://{fs_id}/datasets/c4"}]))
    assert plan.zone == "us-east-1c" and plan.zones_to_try == ("us-east-1c",) and plan.subnet_id is None
    (d,) = plan.fsx
    assert d["channel"] == "data" and d["file_system_id"] == fs_id and d["directory"] == "/datasets/c4"
    assert d["zone"] == "us-east-1c" and d["dns_name"] == f"{fs_id}.fsx.us-east-1.amazonaws.com"
    assert d["mount_name"] is None and any("MountName" in n for n in plan.notes)  # moto drops MountName
    assert f"data <- fsx://{fs_id}/datasets/c4 -> mount {fs_id}.fsx" in plan.describe()


def test_missing_fsx(account):
    job = spec(account, channels=[{"name": "data", "uri": "fsx://fs-0123456789abcdef0/x"}])
    with pytest.raises(ConfigError) as e:
        run(job)
    assert e.value.field == "inputs.data" and "fs-0123456789abcdef0 not found" in str(e.value)


def test_subnets_keep_the_users_order_and_drop_unoffered_zones(account):
    assert offered("p4de.24xlarge") == ["us-east-1b", "us-east-1c"]  # moto's data
    c, a, b = subnet_in("us-east-1c"), subnet_in("us-east-1a"), subnet_in("us-east-1b")
    plan = run(spec(account, instance_type="p4de.24xlarge", subnets=[c, a, b]))
    assert plan.subnets_to_try == (c, b) and plan.subnet_id == c and plan.zone == "us-east-1c"
    assert plan.zones_to_try == ("us-east-1c", "us-east-1b")
    assert any(a in n and "not offered" in n for n in plan.notes)
    with pytest.raises(ConfigError) as e:
        run(spec(account, instance_type="p4de.24xlarge", subnets=[a]))
    assert e.value.field == "subnets" and "us-east-1b, us-east-1c" in str(e.value)
    with pytest.raises(ConfigError) as e:
        run(spec(account, subnets=["subnet-0123456789abcdef0"]))
    assert e.value.field == "subnets" and "subnet-0123456789abcdef0 not found" in str(e.value)


def test_multi_node_needs_efa(account):
    with pytest.raises(ConfigError) as e:
        run(spec(account, instance_type="g5.2xlarge", processes_per_host=1))
    assert e.value.field == "instance_type" and "needs EFA" in str(e.value) and "p4d.24xlarge" in str(e.value)
    plan = run(spec(account, instance_type="g5.2xlarge", instance_count=1, processes_per_host=1))
    assert plan.efa_interfaces == 0 and "no EFA" in plan.describe()


def quota(value: float, code: str = "L-417A185B") -> dict:
    return {"Quota": {"ServiceCode": "ec2", "QuotaCode": code, "QuotaName": "Running On-Demand P instances",
                      "Value": value, "Unit": "None"}}


def test_quota_too_small(account):
    asked = []
    def small(params, **_):
        asked.append(json.loads(params["body"]))
        return AWSResponse("http://hook", 200, {}, None), quota(96.0)
    with pytest.raises(ConfigError) as e:
        run(spec(account), hooks={"before-call.service-quotas.GetServiceQuota": small})
    assert e.value.field == "instance_count"
    for want in ("192 vCPUs", "96 vCPUs", "L-417A185B", "request an increase in Service Quotas"):
        assert want in str(e.value)
    assert asked == [{"ServiceCode": "ec2", "QuotaCode": "L-417A185B"}]


def test_quota_large_enough_and_spot(account):
    plan = run(spec(account), hooks={"before-call.service-quotas.GetServiceQuota": respond(quota(384.0))})
    assert plan.quota_note.startswith("192 of 384 vCPUs")
    asked = []
    def spot(params, **_):
        asked.append(json.loads(params["body"])["QuotaCode"])
        return AWSResponse("http://hook", 200, {}, None), quota(1000.0, asked[-1])
    job = spec(account, use_spot_instances=True, max_run=7200, max_wait=10800)
    plan = run(job, hooks={"before-call.service-quotas.GetServiceQuota": spot})
    table = prices()
    per_hour = 2 * table["on_demand"]["us-east-1"]["p4d.24xlarge"] * (1 - table["spot_discount_estimate"])
    assert asked == ["L-7212CCBC"] and plan.use_spot
    assert plan.estimated_cost_per_hour == pytest.approx(per_hour)
    assert plan.estimated_cost_max_run == pytest.approx(2 * per_hour)  # max_run 2 h, not max_wait
    assert any("spot cost estimated" in n for n in plan.notes) and "Spot estimate" in plan.describe()


def test_quota_api_unavailable_is_a_note(account):
    denied = respond({"Error": {"Code": "AccessDeniedException", "Message": "no"}}, status=400)
    plan = run(spec(account), hooks={"before-call.service-quotas.GetServiceQuota": denied})
    assert plan.quota_note.startswith("not checked") and "AccessDeniedException" in plan.quota_note


def test_price_missing_and_image_in_another_region(account):
    assert offered("p4d.24xlarge", "eu-west-1")  # moto offers p4d in eu-west-1; the table has no price there
    plan = run(spec(account), region="eu-west-1")
    assert plan.region == "eu-west-1" and plan.price_per_instance_hour is None
    assert plan.estimated_cost_per_hour is None and plan.estimated_cost_max_run is None
    assert any("no price for p4d.24xlarge in eu-west-1" in n for n in plan.notes)
    assert any("image is in us-east-1 and the job in eu-west-1" in n for n in plan.notes)
    assert "cost:      unknown" in plan.describe()


def test_no_region(account, monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError) as e:
        preflight(spec(account), session=boto3.Session())
    assert e.value.field == "region" and "AWS_DEFAULT_REGION" in str(e.value)


def test_price_table_covers_the_catalog():
    from trainyard.job import catalog

    table = prices()
    assert table["as_of"] == "2026-11-01" and table["currency"] == "USD" and 0 < table["spot_discount_estimate"] < 1
    priced = set(table["on_demand"]["us-east-1"])
    ec2_types = set(catalog.known_types()) - {catalog.LOCAL, catalog.LOCAL_GPU}
    # every priced type is in the catalog; every type of the P4/P5, G5 and Trn1 families has a us-east-1 list price,
    # except p5e (Capacity Blocks only, no On-Demand price). The other SageMaker types have no verified price here:
    # hourly_price says None and the plan says "no price" rather than guessing.
    assert priced <= ec2_types
    families = ("p4d.", "p4de.", "p5.", "p5en.", "g5.", "trn1.", "trn1n.")
    assert {t for t in ec2_types if t.startswith(families)} <= priced
    assert catalog.hourly_price("ml.m5.xlarge", "us-east-1", spot=False) is None
    assert all(v > 0 for region in table["on_demand"].values() for v in region.values())


def default_vpc() -> str:
    return boto3.client("ec2").describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]


def group_in(vpc: str, name: str) -> str:
    return boto3.client("ec2").create_security_group(GroupName=name, Description="the user's", VpcId=vpc)["GroupId"]


def test_security_groups_exist_in_the_vpc_the_instances_launch_in(account):
    ec2 = boto3.client("ec2")
    mine = [group_in(default_vpc(), "corp-a"), group_in(default_vpc(), "corp-b")]
    calls = []
    plan = run(spec(account, security_group_ids=mine), calls=calls)
    assert plan.security_group_ids == tuple(mine) and "ec2.DescribeSecurityGroups" in calls
    assert f"the job's EFA group and {mine[0]}, {mine[1]} on every interface" in plan.describe()
    # one that does not exist: named, and nothing else is
    with pytest.raises(ConfigError) as e:
        run(spec(account, security_group_ids=[mine[0], "sg-0123456789abcdef0"]))
    assert e.value.field == "security_group_ids" and "sg-0123456789abcdef0 not found" in str(e.value)
    assert mine[0] not in str(e.value)
    # one of another VPC than the subnets'
    other_vpc = ec2.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
    stranger = group_in(other_vpc, "elsewhere")
    with pytest.raises(ConfigError) as e:
        run(spec(account, security_group_ids=[stranger]))
    assert e.value.field == "security_group_ids" and f"{stranger} (in {other_vpc})" in str(e.value)
    assert "default VPC" in str(e.value)
    zone = offered("p4d.24xlarge")[0]
    with pytest.raises(ConfigError) as e:
        run(spec(account, subnets=[subnet_in(zone)], security_group_ids=[stranger]))
    assert e.value.field == "security_group_ids" and default_vpc() in str(e.value)
    # subnets of the group's VPC: accepted
    theirs = ec2.create_subnet(VpcId=other_vpc, CidrBlock="10.9.0.0/20", AvailabilityZone=zone)["Subnet"]["SubnetId"]
    reachable_vpc(other_vpc)
    plan = run(spec(account, subnets=[theirs], security_group_ids=[stranger]))
    assert plan.subnets_to_try == (theirs,) and plan.security_group_ids == (stranger,)


def test_root_volume_is_volume_size_on_the_amis_root_device(account, monkeypatch):
    # no AMI to read (moto's SSM has no Deep Learning AMI parameter): the size asked for, and a note
    plan = run(spec(account))
    assert plan.volume_size == plan.root_volume_gib == 30 and plan.root_device_name is None
    assert any("root volume 30 GB not checked" in n for n in plan.notes)
    assert "30 GB gp3 root volume per instance" in plan.describe() and "60 GB in all" in plan.describe()
    monkeypatch.setenv("TRAINYARD_AMI_ID", "ami-12c6146b")  # moto's: root device /dev/sda1, a 15 GB snapshot
    calls = []
    plan = run(spec(account, volume_size=500), calls=calls)
    assert "ec2.DescribeImages" in calls
    assert (plan.ami_id, plan.root_device_name, plan.root_volume_gib) == ("ami-12c6146b", "/dev/sda1", 500)
    assert "500 GB gp3 root volume on /dev/sda1 per instance (AMI ami-12c6146b)" in plan.describe()
    # smaller than the AMI's snapshot, which EC2 would refuse: the snapshot's size, said in a note
    plan = run(spec(account, volume_size=8))
    assert plan.volume_size == 8 and plan.root_volume_gib == 15
    assert any("volume_size=8 GB is smaller than the root snapshot" in n for n in plan.notes)
    monkeypatch.setenv("TRAINYARD_AMI_ID", "ami-0123456789abcdef0")
    with pytest.raises(ConfigError) as e:
        run(spec(account))
    assert e.value.field == "TRAINYARD_AMI_ID" and "ami-0123456789abcdef0 not found" in str(e.value)


def test_tags_are_checked_and_planned(account):
    plan = run(spec(account, tags=[{"Key": "team", "Value": "ml"}, {"Key": "env", "Value": "dev"}]))
    assert plan.tags == {"team": "ml", "env": "dev"}
    assert "tags:      team=ml, env=dev (with trainyard:job) on every resource created" in plan.describe()
    # refused before any call
    with pytest.raises(ConfigError) as e:
        preflight(spec(account, tags={"trainyard:job": "someone-else"}), session=boto3.Session())
    assert e.value.field == "tags" and "'trainyard:job'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        preflight(spec(account, tags={f"k{i}": "v" for i in range(48)}), session=boto3.Session())
    assert e.value.field == "tags" and "48 tags" in str(e.value) and "50" in str(e.value)
    assert run(spec(account, tags={f"k{i}": "v" for i in range(47)})).tags["k46"] == "v"
