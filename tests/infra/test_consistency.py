"""The Terraform modules declare what trainyard/job/facts.py says an EFA cluster is (the EC2 backend sends the
facts): security-group rules, the launch template's network interfaces for several EFA counts, the
instance-metadata options, and the tags and names the node agent relies on. Each side is read as it is
written (the HCL parsed, its expressions evaluated), so a change on one side alone fails here."""
import json
import os

import pytest

from trainyard.container import node, peers
from trainyard.job import catalog
from trainyard.job import facts
from trainyard.job.spec import JobSpec
from trainyard.sdk.backends.ec2 import provision

from . import hcl

CLUSTER = hcl.load_module(os.path.join(hcl.MODULES, "cluster"))
JOB = hcl.load_module(os.path.join(hcl.MODULES, "job"))
LAYOUT = hcl.load_module(os.path.join(hcl.MODULES, "efa-layout"))
EFA_GROUP = "${aws_security_group.efa.id}"
VPC_CIDR = "${aws_vpc.this.cidr_block}"
SUBNET = "${aws_subnet.private.id}"
# Terraform's names of the launch template's fields -> the EC2 API's, as facts.py writes them
INTERFACE_FIELDS = {"network_card_index": "NetworkCardIndex", "device_index": "DeviceIndex",
                    "interface_type": "InterfaceType", "associate_public_ip_address": "AssociatePublicIpAddress",
                    "subnet_id": "SubnetId", "security_groups": "Groups", "delete_on_termination": "DeleteOnTermination"}
IMDS_FIELDS = {"http_tokens": "HttpTokens", "http_put_response_hop_limit": "HttpPutResponseHopLimit",
               "http_endpoint": "HttpEndpoint"}


def _canonical(items: list[dict]) -> list[str]:
    return sorted(json.dumps(i, sort_keys=True) for i in items)


def _permission(body: dict) -> dict:
    """One aws_vpc_security_group_*_rule as an EC2 IpPermission (facts.security_group_rules' shape)."""
    unexpected = set(body) - {"security_group_id", "description", "ip_protocol", "from_port", "to_port", "cidr_ipv4",
                              "referenced_security_group_id", "tags"}
    assert not unexpected, f"rule field(s) the comparison does not know: {unexpected}"
    out = {"IpProtocol": body["ip_protocol"]}
    if "from_port" in body or "to_port" in body:
        out["FromPort"], out["ToPort"] = body["from_port"], body["to_port"]
    if "cidr_ipv4" in body:
        out["IpRanges"] = [{"CidrIp": body["cidr_ipv4"]}]
    if "referenced_security_group_id" in body:
        ref = body["referenced_security_group_id"]
        out["UserIdGroupPairs"] = [{"GroupId": "self" if ref == body["security_group_id"] else ref}]
    return out


def test_security_group_rules_are_the_facts():
    group = CLUSTER["resource"][("aws_security_group", "efa")]
    assert not {"ingress", "egress"} & set(group), "rules belong in aws_vpc_security_group_*_rule resources"
    found = {"ingress": [], "egress": []}
    for (rtype, name), body in CLUSTER["resource"].items():
        for direction in found:
            if rtype == f"aws_vpc_security_group_{direction}_rule" and body["security_group_id"] == EFA_GROUP:
                found[direction].append(_permission(body))
    expected = facts.security_group_rules(vpc_cidr=VPC_CIDR)
    assert _canonical(found["ingress"]) == _canonical(expected["ingress"])
    assert _canonical(found["egress"]) == _canonical(expected["egress"])
    # the Lustre ports, spelled out: FSx's interfaces are in the same group
    assert {(p["FromPort"], p["ToPort"]) for p in found["ingress"] if "FromPort" in p} == set(facts.LUSTRE_PORTS)
    fsx = CLUSTER["resource"][("aws_fsx_lustre_file_system", "this")]
    assert fsx["security_group_ids"] == [EFA_GROUP] and fsx["subnet_ids"] == [SUBNET]


def _layout(efa: int) -> list[dict]:
    """efa-layout's interfaces for `efa`, evaluated from its HCL."""
    assert LAYOUT["output"]["network_interfaces"]["value"] == "${local.network_interfaces}"
    return hcl.evaluate(hcl.expression(LAYOUT["locals"]["network_interfaces"]), {"var": {"efa_interfaces": efa}})


def _template_interfaces(efa: int) -> list[dict]:
    """The cluster's launch template's network interfaces for `efa`, in the EC2 API's names."""
    template = CLUSTER["resource"][("aws_launch_template", "this")]
    assert "network_interfaces" not in template, "interfaces come from the dynamic block only"
    (dynamic,) = [d["network_interfaces"] for d in template["dynamic"] if "network_interfaces" in d]
    assert dynamic["for_each"] == "${module.efa_layout.network_interfaces}"
    module = CLUSTER["module"]["efa_layout"]
    assert module["source"] == "../efa-layout" and module["efa_interfaces"] == "${var.efa_interfaces}"
    (content,) = dynamic["content"]
    out = []
    for element in _layout(efa):
        nic = {}
        for field, value in content.items():
            assert field in INTERFACE_FIELDS, f"launch template interface field {field} unknown to the comparison"
            if isinstance(value, str) and value.startswith("${network_interfaces.value."):
                value = element[value[len("${network_interfaces.value."):-1]]
            if field == "security_groups":
                value = [EFA_GROUP if v == EFA_GROUP else v for v in value]
            if value is not None:  # null: the field is not sent
                nic[INTERFACE_FIELDS[field]] = value
        out.append(nic)
    return out


def _facts(efa: int) -> facts.InstanceFacts:
    return facts.InstanceFacts(name=f"test.{efa}efa", gpus=8, gpu_name="", gpu_memory_mib=0, vcpus=8, memory_mib=1,
                               efa_supported=efa > 0, max_efa_interfaces=efa, network_cards=max(efa, 1))


@pytest.mark.parametrize("efa", [4, 16, 32, 8, 1, 0])
def test_launch_template_interfaces_are_the_facts(efa):
    expected = facts.network_interfaces(_facts(efa), subnet_id=SUBNET, security_group_id=EFA_GROUP)
    assert _template_interfaces(efa) == expected
    assert len(expected) == max(efa, 1)


def test_catalog_instance_types_get_the_facts_layout():
    for name in ("p4d.24xlarge", "p5.48xlarge", "p5en.48xlarge", "trn1.32xlarge"):
        itype = catalog.lookup(name)
        f = facts.InstanceFacts(name=name, gpus=itype.num_gpus, gpu_name="", gpu_memory_mib=0, vcpus=itype.vcpus,
                                memory_mib=itype.memory_mib, efa_supported=itype.efa_supported,
                                max_efa_interfaces=itype.max_efa_interfaces, network_cards=itype.network_cards)
        assert _template_interfaces(itype.max_efa_interfaces) == facts.network_interfaces(
            f, subnet_id=SUBNET, security_group_id=EFA_GROUP), name


@pytest.mark.skipif(hcl.terraform() is None, reason="no terraform binary on this machine: the layout is checked "
                                                    "with the Python evaluator only")
def test_terraform_computes_the_same_layout(tmp_path):
    """terraform itself evaluates efa-layout (provider-free, so init works offline): the same interfaces as
    the evaluator the tests above use."""
    counts = (0, 4, 16, 32)
    (tmp_path / "main.tf").write_text("".join(
        f'module "l{n}" {{\n  source         = "{os.path.join(hcl.MODULES, "efa-layout")}"\n  efa_interfaces = {n}\n}}\n'
        f'output "l{n}" {{\n  value = module.l{n}.network_interfaces\n}}\n' for n in counts))
    outputs = hcl.terraform_outputs(str(tmp_path))
    for n in counts:
        assert outputs[f"l{n}"] == _layout(n), n


def _imds(block: dict) -> dict:
    unknown = set(block) - set(IMDS_FIELDS)
    assert not unknown, f"metadata option(s) facts.IMDS_OPTIONS does not have: {unknown}"
    return {IMDS_FIELDS[k]: v for k, v in block.items()}


def test_metadata_options_are_the_facts():
    (template_options,) = CLUSTER["resource"][("aws_launch_template", "this")]["metadata_options"]
    assert _imds(template_options) == facts.IMDS_OPTIONS
    (instance_options,) = JOB["resource"][("aws_instance", "this")]["metadata_options"]
    assert _imds(instance_options) == facts.IMDS_OPTIONS


# DescribeImages images: the Deep Learning AMI's shape, moto's (root on /dev/sda1), one without a snapshot size
IMAGES = [
    {"RootDeviceName": "/dev/xvda", "BlockDeviceMappings": [
        {"DeviceName": "/dev/xvda", "Ebs": {"VolumeSize": 75, "VolumeType": "gp3", "SnapshotId": "snap-1"}},
        {"DeviceName": "/dev/sdb", "VirtualName": "ephemeral0"}]},
    {"RootDeviceName": "/dev/sda1", "BlockDeviceMappings": [
        {"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 15, "SnapshotId": "snap-2"}},
        {"DeviceName": "/dev/sdf", "Ebs": {"VolumeSize": 500}}]},
    {"RootDeviceName": "/dev/xvda", "BlockDeviceMappings": [{"DeviceName": "/dev/xvda", "Ebs": {}}]},
]


def _aws_ami(image: dict) -> dict:
    """An image as Terraform's data "aws_ami" holds it: snake_case, `ebs` a map of strings."""
    return {"root_device_name": image["RootDeviceName"], "block_device_mappings": [
        {"device_name": m["DeviceName"], "ebs": {k.lower().replace("volumesize", "volume_size"): str(v)
                                                 for k, v in m.get("Ebs", {}).items()}}
        for m in image["BlockDeviceMappings"]]}


def test_launch_template_is_the_ec2_backends():
    template = CLUSTER["resource"][("aws_launch_template", "this")]
    assert CLUSTER["variable"]["ami_ssm_parameter"]["default"] == provision.AMI_PARAMETER
    # the root volume: JobSpec.volume_size's default, on the AMI's root device, never below its snapshot
    assert CLUSTER["variable"]["root_volume_size_gib"]["default"] == JobSpec.model_fields["volume_size"].default
    assert template["image_id"] == "${local.ami_id}"
    assert CLUSTER["data"][("aws_ami", "this")]["filter"] == [{"name": "image-id", "values": ["${local.ami_id}"]}]
    assert template["instance_initiated_shutdown_behavior"] == "terminate"
    (mapping,) = template["block_device_mappings"]
    (ebs,) = mapping["ebs"]
    assert mapping["device_name"] == "${data.aws_ami.this.root_device_name}"
    assert ebs == {"volume_size": "${local.root_volume_gib}", "volume_type": "gp3", "encrypted": True,
                   "delete_on_termination": True}
    for image in IMAGES:
        device, snapshot = provision.image_root(image)
        assert device == image["RootDeviceName"]
        for size in (8, 30, 200):
            scope = {"var": {"root_volume_size_gib": size}, "data": {"aws_ami": {"this": _aws_ami(image)}}}
            got = hcl.evaluate(hcl.expression(CLUSTER["locals"]["root_volume_gib"]), scope)
            assert got == provision.root_volume_gib(size, snapshot), (image, size)
    assert [provision.root_volume_gib(30, provision.image_root(i)[1]) for i in IMAGES] == [75, 30, 30]
    assert template["placement"] == [{"group_name": "${aws_placement_group.this.name}"}]
    assert CLUSTER["resource"][("aws_placement_group", "this")]["strategy"] == "cluster"
    subnet = CLUSTER["resource"][("aws_subnet", "private")]
    assert subnet["availability_zone_id"] == "${var.availability_zone_id}" and subnet["map_public_ip_on_launch"] is False


def test_job_tags_are_what_the_node_agent_looks_for():
    scope = {"var": {"job_name": "my-job", "tags": {"team": "ml"}}, "local": {"attempt": 1}}
    job_tags = hcl.evaluate(hcl.expression(JOB["locals"]["job_tags"]), scope)
    assert job_tags == {"team": "ml", facts.TAG_KEY: "my-job", provision.ATTEMPT_TAG: "1"}
    instance = JOB["resource"][("aws_instance", "this")]
    assert instance["count"] == "${var.instance_count}"
    hosts = []
    for index in range(4):
        tags = hcl.evaluate(hcl.expression(instance["tags"]),
                            {"local": {"job_tags": job_tags}, "count": {"index": index}, "var": scope["var"]})
        assert tags[facts.TAG_KEY] == "my-job" and tags[provision.ATTEMPT_TAG] == "1"
        record = {"InstanceId": f"i-{index}", "AmiLaunchIndex": 0,  # one RunInstances per aws_instance
                  "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}
        hosts.append(peers.host_name(peers.host_index(record)))
    assert hosts == ["algo-1", "algo-2", "algo-3", "algo-4"]
    volume_tags = hcl.evaluate(hcl.expression(instance["volume_tags"]),
                               {"local": {"job_tags": job_tags}, "count": {"index": 0}, "var": scope["var"]})
    assert job_tags.items() <= volume_tags.items()
    interface_tags = JOB["resource"][("aws_ec2_tag", "interfaces")]
    assert interface_tags["value"] == "${local.job_tags[each.value.key]}"


def test_names_the_node_agent_uses():
    assert CLUSTER["locals"]["log_group_name"] == node.LOG_GROUP
    job = JOB["resource"][("aws_s3_object", "spec")]
    assert job["key"] == "${local.state[1]}/spec.json"  # <output_path>/<job>/trainyard/spec.json (backend.state_uri)
    assert "trainyard$" in JOB["variable"]["state_s3_uri"]["validation"][0]["condition"]
