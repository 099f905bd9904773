"""The EC2 backend's provisioning, against a moto server over HTTP (AWS_ENDPOINT_URL).

What moto drops is checked on the requests, through botocore event hooks on the Estimator's boto3
session: the launch template's network interfaces (moto keeps only plain interfaces at launch), its
placement and IMDS options. Placement groups are served by the fake in tests/cloud/conftest.py.
"""
import base64

import boto3
import pytest
from botocore.exceptions import ClientError

from trainyard.errors import ConfigError, JobFailedError
from trainyard.job.spec import build_spec
from trainyard.sdk.backends.ec2 import network
from trainyard.sdk.backends.ec2.preflight import preflight
from trainyard.sdk.backends.ec2.provision import Cluster

from .conftest import IMAGE, Recorder, leftovers as _leftovers


def _estimator(account, rec: Recorder, instance_type="ml.p4d.24xlarge", count=2, **kw):
    from trainyard import Estimator  # here: the tests that build a JobSpec directly do not need the Estimator

    return Estimator(entry_point="trainyard.engine.train", instance_type=instance_type, instance_count=count,
                     hyperparameters={"steps": 2, "global_batch_size": 64, "micro_batch_size": 1},
                     output_path="s3://ty-out/jobs", image_uri=IMAGE, role=account["role"],
                     boto_session=rec.session, **kw)


def _form(params: dict, prefix: str) -> list[dict]:
    """The list `prefix.N.*` of an EC2 query-API request body, as dicts of the remaining keys."""
    out: dict[int, dict] = {}
    for key, value in params.items():
        if key.startswith(prefix + "."):
            index, _, rest = key[len(prefix) + 1:].partition(".")
            out.setdefault(int(index), {})[rest] = value
    return [out[i] for i in sorted(out)]


@pytest.mark.slow
@pytest.mark.parametrize("instance_type,interfaces", [("ml.p4d.24xlarge", 4), ("ml.p5.48xlarge", 32)])
def test_fit_launches_an_efa_cluster_and_stop_tears_it_down(account, instance_type, interfaces):
    rec = Recorder()
    job = _estimator(account, rec, instance_type=instance_type).fit(wait=False, job_name=f"efa-{interfaces}")
    name = job.name
    ec2 = boto3.client("ec2")
    running = [i for r in ec2.describe_instances(Filters=[{"Name": "tag:trainyard:job", "Values": [name]}])["Reservations"]
               for i in r["Instances"] if i["State"]["Name"] in ("pending", "running")]
    assert len(running) == 2 and {i["InstanceType"] for i in running} == {instance_type.removeprefix("ml.")}
    # one RunInstances for all: MinCount = MaxCount = 2, from the launch template
    (run,) = rec.params("RunInstances")
    assert run["MinCount"] == run["MaxCount"] == "2" and "LaunchTemplate.LaunchTemplateId" in run
    (template,) = rec.params("CreateLaunchTemplate")
    nics = _form(template, "LaunchTemplateData.NetworkInterface")
    assert len(nics) == interfaces  # read from DescribeInstanceTypes, never hard-coded
    assert [n["InterfaceType"] for n in nics] == ["efa"] + ["efa-only"] * (interfaces - 1)
    assert [int(n["NetworkCardIndex"]) for n in nics] == list(range(interfaces))
    assert {n["DeviceIndex"] for n in nics} == {"0"} and {n.get("AssociatePublicIpAddress", "false") for n in nics} == {"false"}
    # the job's EFA group; the other is the VPC's shared endpoints' (test_network.py)
    (group,) = [g for g in rec.params("CreateSecurityGroup") if g["GroupName"] != network.SHARED_NAME]
    sg = ec2.describe_security_groups(Filters=[{"Name": "tag:trainyard:job", "Values": [name]}])["SecurityGroups"][0]
    assert {n["SecurityGroupId.1"] for n in nics} == {sg["GroupId"]}
    assert any(p.get("UserIdGroupPairs") and p["UserIdGroupPairs"][0]["GroupId"] == sg["GroupId"]
               and p["IpProtocol"] == "-1" for p in sg["IpPermissions"])  # all traffic from itself
    assert template["LaunchTemplateData.MetadataOptions.HttpTokens"] == "required"
    assert template["LaunchTemplateData.MetadataOptions.HttpPutResponseHopLimit"] == "1"
    (placement,) = rec.params("CreatePlacementGroup")
    assert placement["Strategy"] == "cluster"
    assert template["LaunchTemplateData.Placement.GroupName"] == placement["GroupName"]
    assert [g["GroupName"] for g in ec2.describe_placement_groups()["PlacementGroups"]] == [placement["GroupName"]]
    user_data = base64.b64decode(template["LaunchTemplateData.UserData"]).decode()
    assert "trainyard.container.node" in user_data and IMAGE in user_data
    assert job.describe()["TrainingJobStatus"] == "InProgress"

    job.stop()
    assert job.describe()["TrainingJobStatus"] == "Stopped"
    assert _leftovers(name) == {}
    assert not ec2.describe_placement_groups()["PlacementGroups"]
    assert not boto3.client("iam").list_instance_profiles()["InstanceProfiles"]


FAIL_AT = ["CreateSubnet", "CreateSecurityGroup", "AuthorizeSecurityGroupIngress", "CreatePlacementGroup",
           "CreateInstanceProfile", "AddRoleToInstanceProfile", "CreateLaunchTemplate", "RunInstances"]


@pytest.mark.parametrize("operation", FAIL_AT)
def test_a_failure_at_any_provisioning_call_leaves_nothing(account, operation):
    rec = Recorder()
    rec.fail[operation] = "InternalError"
    with pytest.raises(JobFailedError, match="InternalError"):
        _estimator(account, rec).fit(wait=False, job_name=f"fail-{operation.lower()}")
    assert operation in [name for name, _ in rec.calls]
    assert _leftovers(f"fail-{operation.lower()}") == {}
    assert not boto3.client("iam").list_instance_profiles()["InstanceProfiles"]
    assert not boto3.client("ec2").describe_placement_groups()["PlacementGroups"]


def test_capacity_errors_move_to_the_next_zone_then_fail_saying_what_was_tried(account):
    rec = Recorder()
    rec.fail["RunInstances"] = "InsufficientInstanceCapacity"
    with pytest.raises(JobFailedError) as caught:
        _estimator(account, rec).fit(wait=False, job_name="no-capacity")
    # the job's subnets (/20), not the VPC's shared endpoints' subnet (/28, test_network.py)
    runs = rec.params("RunInstances")
    subnets = [s for s in rec.params("CreateSubnet") if s["CidrBlock"].endswith("/20")]
    assert len(runs) == len(subnets) >= 2  # one subnet per zone that offers the type, each tried once
    zones = [s["AvailabilityZone"] for s in subnets]
    assert all(z in str(caught.value) for z in zones) and "InsufficientInstanceCapacity" in str(caught.value)
    assert _leftovers("no-capacity") == {}
    # the second zone has capacity: the job launches there, on a launch-template version for its subnet
    rec = Recorder()
    failures = iter(["InsufficientInstanceCapacity"])

    def first_fails(params, model, **kwargs):
        if model.name == "RunInstances":
            code = next(failures, None)
            if code:
                raise ClientError({"Error": {"Code": code, "Message": "no"}}, model.name)

    rec.session.events.register("before-call.ec2.RunInstances", first_fails)
    job = _estimator(account, rec).fit(wait=False, job_name="second-zone")
    second = rec.params("RunInstances")[-1]
    assert second["LaunchTemplate.Version"] == "2"
    version = rec.params("CreateLaunchTemplateVersion")[0]
    assert _form(version, "LaunchTemplateData.NetworkInterface")[0]["SubnetId"] != \
        _form(rec.params("CreateLaunchTemplate")[0], "LaunchTemplateData.NetworkInterface")[0]["SubnetId"]
    job.stop()
    assert _leftovers("second-zone") == {}


def test_dry_run_prints_the_plan_and_creates_nothing(account, capsys):
    from trainyard.sdk.jobs.jobstate import job_dir

    rec = Recorder()
    plan = _estimator(account, rec, use_spot_instances=True, max_wait=7200, max_run=3600).fit(
        dry_run=True, job_name="dry")
    out = capsys.readouterr().out
    assert "p4d.24xlarge" in out and "4" in out and plan.efa_interfaces == 4
    assert plan.estimated_cost_max_run is not None and f"{plan.estimated_cost_max_run:,.2f}" in out
    assert rec.created() == []
    assert not boto3.client("s3").list_objects_v2(Bucket="ty-out").get("KeyCount")  # not even the code
    import os

    assert not os.path.exists(job_dir("dry"))


def test_ec2_inputs_must_be_reachable_from_the_instances(account, tmp_path):
    rec = Recorder()
    with pytest.raises(ConfigError, match="inputs.train.*EC2 instances cannot read"):
        _estimator(account, rec).fit({"train": f"file://{tmp_path}"}, wait=False, job_name="local-data")
    with pytest.raises(ConfigError, match="inputs.train.*nothing found"):
        _estimator(account, rec).fit({"train": "s3://ty-out/empty/"}, wait=False, job_name="empty-data")
    assert rec.created() == []


def test_gc_removes_what_a_dead_job_left(account):
    from trainyard.sdk.backends.ec2.backend import gc

    session = boto3.Session()
    spec = build_spec(job_name="orphan", entry_point="trainyard.engine.train", entry_kind="module",
                      instance_type="p4d.24xlarge", instance_count=2, processes_per_host=8,
                      output_path="s3://ty-out/jobs", image_uri=IMAGE, role=account["role"])
    cluster = Cluster(session, "orphan", say=lambda m: None)
    cluster.provision(preflight(spec, session=session), lambda attempt: "#!/bin/bash\ntrue\n")
    assert set(_leftovers("orphan")) == {"instance", "launch-template", "placement-group", "security-group",
                                         "subnet", "instance-profile", "route-table", "vpc-endpoint", "endpoint-use"}
    said: list[str] = []
    assert gc(session, say=said.append) == {} and "running; skipped" in said[-1]
    assert gc(session, say=said.append, include_running=True) == {"orphan": []}
    assert _leftovers("orphan") == {}


def _spec(account, **kw):
    fields = dict(job_name="tagged", entry_point="trainyard.engine.train", entry_kind="module",
                  instance_type="p4d.24xlarge", instance_count=2, processes_per_host=8,
                  output_path="s3://ty-out/jobs", image_uri=IMAGE, role=account["role"])
    return build_spec(**{**fields, **kw})


def _tag_specifications(params: dict) -> dict[str, dict[str, str]]:
    """{resource type: tags} of a request's TagSpecification.N (a launch template's data too)."""
    out: dict[str, dict[str, str]] = {}
    for prefix in ("TagSpecification", "LaunchTemplateData.TagSpecification"):
        for spec in _form(params, prefix):
            tags = {t["Key"]: t["Value"] for t in _form(spec, "Tag")}
            out.setdefault(spec["ResourceType"], {}).update(tags)
    return out


USER_TAGS = {"team": "ml", "cost-center": "4242", "Name": "my-run"}


@pytest.mark.parametrize("spot", [False, True], ids=["on-demand", "spot"])
def test_the_users_tags_volume_size_and_groups_are_on_what_the_launch_creates(account, spot):
    rec = Recorder()
    ec2 = boto3.client("ec2")
    vpc = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    extra = [ec2.create_security_group(GroupName=f"corp-{i}", Description="the user's", VpcId=vpc)["GroupId"]
             for i in range(2)]
    job = f"tagged-{'spot' if spot else 'od'}"
    spot_args = {"use_spot_instances": True, "max_wait": 7200, "max_run": 3600} if spot else {}
    spec = _spec(account, job_name=job, tags=USER_TAGS, volume_size=120, security_group_ids=extra, **spot_args)
    plan = preflight(spec, session=rec.session)
    assert plan.root_volume_gib == 120 and plan.root_device_name == "/dev/sda1"  # moto's ami-12c6146b
    assert "120 GB gp3 root volume on /dev/sda1" in plan.describe() and all(g in plan.describe() for g in extra)
    cluster = Cluster(rec.session, job, say=lambda m: None)
    cluster.provision(plan, lambda attempt: "#!/bin/bash\ntrue\n")
    try:
        want = {**USER_TAGS, "trainyard:job": job}
        # the VPC's shared endpoints carry Trainyard's shared tag, not a job's (test_network.py): left out here
        shared_groups = {g["GroupId"] for g in ec2.describe_security_groups(Filters=[
            {"Name": f"tag:{network.SHARED_TAG}", "Values": ["endpoints"]}])["SecurityGroups"]}

        def shared(name: str, params: dict) -> bool:
            return name == "CreateTags" or params.get("GroupId") in shared_groups or network.SHARED_TAG in params.values()

        created = [(name, p) for name, p in rec.calls
                   if name.startswith(("Create", "Run", "Authorize")) and not shared(name, p)]
        assert {n for n, _ in created} == {"CreateSubnet", "CreateSecurityGroup", "AuthorizeSecurityGroupIngress",
                                           "AuthorizeSecurityGroupEgress", "CreatePlacementGroup",
                                           "CreateInstanceProfile", "CreateLaunchTemplate", "RunInstances",
                                           "CreateRouteTable", "CreateVpcEndpoint"}
        for name, params in created:
            if name == "CreateInstanceProfile":  # IAM's own form
                tags = {t["Key"]: t["Value"] for t in _form(params, "Tags.member")}
                assert want.items() <= tags.items(), (name, tags)
                continue
            specs = _tag_specifications(params)
            assert specs, name
            for resource, tags in specs.items():
                assert want.items() <= tags.items(), (name, resource, tags)
        launched = {"instance", "volume", "network-interface"} | ({"spot-instances-request"} if spot else set())
        (template,) = rec.params("CreateLaunchTemplate")
        assert set(_tag_specifications(template)) == launched | {"launch-template"}
        (run,) = rec.params("RunInstances")
        run_tags = _tag_specifications(run)
        assert set(run_tags) == launched and {t["trainyard:attempt"] for t in run_tags.values()} == {"1"}
        # the root volume: volume_size GB on the AMI's root device
        (mapping,) = _form(template, "LaunchTemplateData.BlockDeviceMapping")
        assert mapping["DeviceName"] == "/dev/sda1" and mapping["Ebs.VolumeSize"] == "120"
        assert mapping["Ebs.VolumeType"] == "gp3" and mapping["Ebs.Encrypted"] == "true"
        # every interface: the job's EFA group first, then the user's
        (own,) = cluster.ledger.ids("security-group")
        nics = _form(template, "LaunchTemplateData.NetworkInterface")
        assert len(nics) == 4 and all([n["SecurityGroupId.1"], n["SecurityGroupId.2"], n["SecurityGroupId.3"]]
                                      == [own, *extra] for n in nics)
        # and what moto holds
        instances = [i for r in ec2.describe_instances(Filters=[{"Name": "tag:trainyard:job", "Values": [job]}])[
            "Reservations"] for i in r["Instances"]]
        assert len(instances) == 2
        for inst in instances:
            assert want.items() <= {t["Key"]: t["Value"] for t in inst["Tags"]}.items()
        group = ec2.describe_security_groups(GroupIds=[own])["SecurityGroups"][0]
        assert want.items() <= {t["Key"]: t["Value"] for t in group["Tags"]}.items()
    finally:
        assert cluster.teardown() == []
    assert _leftovers(job) == {}
    assert {g["GroupId"] for g in ec2.describe_security_groups(GroupIds=extra)["SecurityGroups"]} == set(extra)


def test_a_missing_security_group_fails_in_preflight_before_anything_is_created(account):
    rec = Recorder()
    ec2 = boto3.client("ec2")
    vpc = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    there = ec2.create_security_group(GroupName="corp", Description="the user's", VpcId=vpc)["GroupId"]
    spec = _spec(account, job_name="no-group", security_group_ids=[there, "sg-0123456789abcdef0"])
    with pytest.raises(ConfigError) as caught:
        preflight(spec, session=rec.session)
    assert caught.value.field == "security_group_ids" and "sg-0123456789abcdef0" in str(caught.value)
    assert there not in str(caught.value)
    assert rec.created() == [] and rec.params("DescribeSecurityGroups")
    assert _leftovers("no-group") == {}
