"""The network of an EC2 job (trainyard/sdk/backends/ec2/network.py), against the moto server: a created subnet gets
its own route table with an S3 gateway endpoint, the VPC's shared interface endpoints (ecr.api, ecr.dkr,
logs, ec2; reference-counted by tags) and, when asked, a NAT gateway; a user's subnet that cannot reach S3
or ECR is refused before anything is created. moto serves all of these APIs; the EFA interfaces it drops
are checked in test_ec2_backend.py."""
import boto3
import pytest

from trainyard.errors import ConfigError, JobFailedError
from trainyard.sdk.backends.ec2 import network

from .conftest import IMAGE, Recorder, leftovers

SERVICES = {f"com.amazonaws.us-east-1.{s}" for s in network.INTERFACE_SERVICES}


def _estimator(account, rec: Recorder, **kw):
    from trainyard import Estimator

    return Estimator(entry_point="trainyard.engine.train", instance_type="ml.p4d.24xlarge", instance_count=2,
                     hyperparameters={"steps": 2, "global_batch_size": 32, "micro_batch_size": 1},
                     output_path="s3://ty-out/jobs", image_uri=IMAGE, role=account["role"],
                     boto_session=rec.session, **kw)


def _shared():
    """Trainyard's shared pieces still there: endpoints (by service), subnets, groups."""
    ec2 = boto3.client("ec2")
    flt = [{"Name": f"tag:{network.SHARED_TAG}", "Values": ["endpoints"]}]
    endpoints = [e for e in ec2.describe_vpc_endpoints(Filters=flt)["VpcEndpoints"]
                 if e["State"].lower() not in ("deleted", "deleting")]
    return ({e["ServiceName"]: e for e in endpoints}, ec2.describe_subnets(Filters=flt)["Subnets"],
            ec2.describe_security_groups(Filters=flt)["SecurityGroups"])


def _job_routes(job: str) -> list[dict]:
    ec2 = boto3.client("ec2")
    (table,) = ec2.describe_route_tables(Filters=[{"Name": "tag:trainyard:job", "Values": [job]}])["RouteTables"]
    (subnet,) = ec2.describe_subnets(Filters=[{"Name": "tag:trainyard:job", "Values": [job]}])["Subnets"]
    assert [a["SubnetId"] for a in table["Associations"]] == [subnet["SubnetId"]]
    return table["Routes"]


@pytest.mark.slow
def test_a_created_subnet_reaches_s3_and_the_shared_endpoints_counted_over_two_jobs(account):
    rec = Recorder()
    first = _estimator(account, rec).fit(wait=False, job_name="net-one")
    ec2 = boto3.client("ec2")
    # the job's own route table: the local route and S3 through its gateway endpoint, nothing to the internet
    routes = _job_routes("net-one")
    (s3,) = [r for r in routes if r.get("DestinationPrefixListId")]
    gateway = ec2.describe_vpc_endpoints(VpcEndpointIds=[s3["GatewayId"]])["VpcEndpoints"][0]
    assert gateway["ServiceName"] == "com.amazonaws.us-east-1.s3" and gateway["VpcEndpointType"] == "Gateway"
    assert not [r for r in routes if r.get("DestinationCidrBlock") == "0.0.0.0/0"]
    endpoints, subnets, groups = _shared()
    assert set(endpoints) == SERVICES and all(e["PrivateDnsEnabled"] for e in endpoints.values())
    assert len(subnets) == 1 and len(groups) == 1
    assert {p["FromPort"] for p in groups[0]["IpPermissions"]} == {443}
    users = {t["Key"] for e in endpoints.values() for t in e["Tags"] if t["Key"].startswith(network.USES_PREFIX)}
    assert users == {network.USES_PREFIX + "net-one"}
    assert set(leftovers("net-one")) >= {"subnet", "route-table", "vpc-endpoint", "endpoint-use"}

    # a second job in the VPC uses the same endpoints: none is created
    rec2 = Recorder()
    second = _estimator(account, rec2).fit(wait=False, job_name="net-two")
    assert not [p for p in rec2.params("CreateVpcEndpoint") if p.get("VpcEndpointType") == "Interface"]
    assert len(rec2.params("CreateVpcEndpoint")) == 1  # its own S3 gateway endpoint
    first.stop()
    assert leftovers("net-one") == {}
    endpoints, subnets, _ = _shared()
    assert set(endpoints) == SERVICES and len(subnets) == 1  # the second job still uses them
    users = {t["Key"] for e in endpoints.values() for t in e["Tags"] if t["Key"].startswith(network.USES_PREFIX)}
    assert users == {network.USES_PREFIX + "net-two"}
    second.stop()
    assert leftovers("net-two") == {}
    assert _shared() == ({}, [], [])  # the last user gone: endpoints, their subnet and group too


@pytest.mark.slow
def test_internet_access_adds_a_nat_gateway_that_goes_with_the_job(account):
    rec = Recorder()
    job = _estimator(account, rec, network={"internet": True}).fit(wait=False, job_name="net-nat")
    ec2 = boto3.client("ec2")
    (nat,) = ec2.describe_nat_gateways(Filters=[{"Name": "tag:trainyard:job", "Values": ["net-nat"]}])["NatGateways"]
    public = ec2.describe_subnets(SubnetIds=[nat["SubnetId"]])["Subnets"][0]
    assert public["DefaultForAz"]  # the zone's public subnet of the default VPC
    assert any(r.get("NatGatewayId") == nat["NatGatewayId"] and r["DestinationCidrBlock"] == "0.0.0.0/0"
               for r in _job_routes("net-nat"))
    (eip,) = ec2.describe_addresses(Filters=[{"Name": "tag:trainyard:job", "Values": ["net-nat"]}])["Addresses"]
    assert nat["NatGatewayAddresses"][0]["AllocationId"] == eip["AllocationId"]
    job.stop()
    assert leftovers("net-nat") == {}
    assert not ec2.describe_addresses()["Addresses"]


@pytest.mark.parametrize("operation", ["CreateRouteTable", "CreateVpcEndpoint", "CreateTags"])
def test_a_failure_while_building_the_network_leaves_nothing(account, operation):
    rec = Recorder()
    rec.fail[operation] = "InternalError"
    with pytest.raises(JobFailedError, match="InternalError"):
        _estimator(account, rec).fit(wait=False, job_name=f"net-fail-{operation.lower()}")
    assert leftovers(f"net-fail-{operation.lower()}") == {}
    assert _shared() == ({}, [], [])


def _user_subnet(cidr: str, *, s3_gateway: bool, interface_endpoints: bool) -> str:
    ec2 = boto3.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.40.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=cidr, AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    ec2.associate_route_table(RouteTableId=table, SubnetId=subnet)
    if s3_gateway:
        ec2.create_vpc_endpoint(VpcId=vpc, ServiceName="com.amazonaws.us-east-1.s3", VpcEndpointType="Gateway",
                                RouteTableIds=[table])
    if interface_endpoints:
        for service in network.INTERFACE_SERVICES:
            ec2.create_vpc_endpoint(VpcId=vpc, ServiceName=f"com.amazonaws.us-east-1.{service}",
                                    VpcEndpointType="Interface", SubnetIds=[subnet], PrivateDnsEnabled=True)
    return subnet


@pytest.mark.parametrize("s3_gateway,interface_endpoints,missing", [
    (False, True, "a route to S3"), (True, False, "interface endpoints with private DNS for ecr.api, ecr.dkr, logs, ec2"),
])
def test_a_user_subnet_that_cannot_reach_s3_or_ecr_is_refused_before_anything_is_created(
        account, s3_gateway, interface_endpoints, missing):
    subnet = _user_subnet("10.40.1.0/24", s3_gateway=s3_gateway, interface_endpoints=interface_endpoints)
    rec = Recorder()
    with pytest.raises(ConfigError, match=rf"^subnets: {subnet} \(us-east-1a\) lacks .*{missing}"):
        _estimator(account, rec, subnets=[subnet]).fit(wait=False, job_name="net-user")
    assert rec.created() == []


def test_a_user_subnet_with_its_endpoints_passes_and_the_plan_prices_a_created_network(account, capsys):
    subnet = _user_subnet("10.40.2.0/24", s3_gateway=True, interface_endpoints=True)
    plan = _estimator(account, Recorder(), subnets=[subnet]).fit(job_name="net-ok", dry_run=True)
    assert plan.subnets_to_try == (subnet,) and plan.network_lines == ()
    plan = _estimator(account, Recorder(), network={"internet": True}).fit(job_name="net-new", dry_run=True)
    text = plan.describe()
    assert "vpc:       a route table and an S3 gateway endpoint of the job's own (free)" in text
    assert "4 shared interface endpoints (ecr.api, ecr.dkr, logs, ec2): $0.040/hour" in text
    assert "a NAT gateway and its Elastic IP: $0.050/hour, plus $0.045/GB" in text
