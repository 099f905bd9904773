"""The EC2 backend's provisioning, against a moto server over HTTP (AWS_ENDPOINT_URL).

What moto drops is checked on the requests, through botocore event hooks on the Estimator's boto3
session: the launch template's network interfaces (moto keeps only plain interfaces at launch), its
placement and IMDS options. Placement groups are served by the fake in tests/cloud/conftest.py.
"""
import base64

import boto3
import pytest
from botocore.exceptions import ClientError

from trainyard import Estimator
from trainyard.sdk.errors import ConfigError, JobFailedError

from .conftest import IMAGE, Recorder, leftovers as _leftovers

def _estimator(account, rec: Recorder, instance_type="ml.p4d.24xlarge", count=2, **kw) -> Estimator:
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
    (group,) = rec.params("CreateSecurityGroup")
    sg = ec2.describe_security_groups(Filters=[{"Name": "tag:trainyard:job", "Values": [name]}])["SecurityGroups"][0]
    assert {n["SecurityGroupId.1"] for n in nics} == {sg["GroupId"]}
    assert any(p.get("UserIdGroupPairs") and p["UserIdGroupPairs"][0]["GroupId"] == sg["GroupId"]
               and p["IpProtocol"] == "-1" for p in sg["IpPermissions"])  # all traffic from itself
    assert template["LaunchTemplateData.MetadataOptions.HttpTokens"] == "required"
    assert template["LaunchTemplateData.MetadataOptions.HttpPutResponseHopLimit"] == "2"
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
    runs, subnets = rec.params("RunInstances"), rec.params("CreateSubnet")
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
    from trainyard.sdk.jobstate import job_dir

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
    from trainyard.sdk.aws.backend import gc
    from trainyard.sdk.aws.preflight import preflight
    from trainyard.sdk.aws.provision import Cluster
    from trainyard.sdk.spec import build_spec

    session = boto3.Session()
    spec = build_spec(job_name="orphan", entry_point="trainyard.engine.train", entry_kind="module",
                      instance_type="p4d.24xlarge", instance_count=2, processes_per_host=8,
                      output_path="s3://ty-out/jobs", image_uri=IMAGE, role=account["role"])
    cluster = Cluster(session, "orphan", say=lambda m: None)
    cluster.provision(preflight(spec, session=session), lambda attempt: "#!/bin/bash\ntrue\n")
    assert set(_leftovers("orphan")) == {"instance", "launch-template", "placement-group", "security-group",
                                         "subnet", "instance-profile"}
    said: list[str] = []
    assert gc(session, say=said.append) == {} and "running; skipped" in said[-1]
    assert gc(session, say=said.append, include_running=True) == {"orphan": []}
    assert _leftovers("orphan") == {}
