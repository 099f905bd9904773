"""`Estimator.to_terraform` / trainyard/sdk/backends/terraform/render.py: the rendered root module parses, is formatted, and carries
the JobSpec's values (instance type, count, EFA interfaces, image, channels, hyperparameters); its user
data template, once Terraform fills it, is the EC2 backend's user data."""
import json
import os
import re
import subprocess

import pytest

from trainyard.sdk.backends.aws.userdata import render_user_data
from trainyard.errors import ConfigError
from trainyard.sdk.inputs import FileSystemInput, TrainingInput
from trainyard.job.spec import JobSpec, build_spec
from trainyard.sdk.backends.terraform.render import CLUSTER_FSX, TEMPLATE, render_root_module

from . import hcl

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainyard:0.1.0"
ROLE = "arn:aws:iam::123456789012:role/trainyard-training"
HYPERPARAMETERS = {"steps": 10, "global_batch_size": 64, "micro_batch_size": 1, "lr": 0.00003}
FSX_NAMES = {"dns_name": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com", "mount_name": "abcdefgh"}


def Estimator(**kw):
    from trainyard import Estimator as cls  # here: the tests that render a JobSpec directly need no Estimator

    return cls(**kw)


def _p5(**kw):
    args = dict(entry_point="trainyard.engine.train", instance_type="ml.p5.48xlarge", instance_count=4,
                image_uri=IMAGE, role=ROLE, output_path="s3://my-bucket/jobs", checkpoint_s3_uri="s3://my-ckpt/run-1",
                hyperparameters=HYPERPARAMETERS)
    return Estimator(**{**args, **kw})


def _literal(text):
    """A string value as python-hcl2 gives it (backslash escapes decoded, template escapes kept) -> the string."""
    if not isinstance(text, str) or (text.startswith("${") and text.endswith("}")):
        return text  # not a string, or an expression
    return text.replace("$${", "${").replace("%%{", "%{")


def _values(v):
    """HCL values parsed by python-hcl2 -> plain Python (strings unescaped)."""
    if isinstance(v, dict):
        return {k: _values(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_values(x) for x in v]
    return _literal(v)


def _fill(template: str, fsx: list[dict]) -> str:
    """What templatefile(template, {fsx = fsx}) gives: the fsx[i] references filled in, the escapes undone.
    Fails on any other template sequence, so that nothing of the script is left for Terraform to read."""
    def ref(m):
        return fsx[int(m.group(1))][m.group(2)]

    assert "%{" not in template.replace("%%{", ""), "a template directive in the user data"
    stripped = re.sub(r"\$\$\{", "", template)
    others = set(re.findall(r"\$\{[^}]*\}", re.sub(r"\$\{fsx\[\d+\]\.(dns_name|mount_name)\}", "", stripped)))
    assert not others, f"interpolations Terraform would evaluate: {others}"
    parts = re.split(r"(\$\$\{|%%\{|\$\{fsx\[\d+\]\.(?:dns_name|mount_name)\})", template)
    out = []
    for part in parts:
        if part == "$${":
            out.append("${")
        elif part == "%%{":
            out.append("%{")
        elif part.startswith("${fsx["):
            out.append(ref(re.match(r"\$\{fsx\[(\d+)\]\.(dns_name|mount_name)\}", part)))
        else:
            out.append(part)
    return "".join(out)


@pytest.fixture(scope="module")
def p5_module(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tf") / "p5-job")
    est = _p5()
    files = est.to_terraform(path, {"train": "s3://my-data/tokens",
                                    "val": TrainingInput("s3://my-data/val", distribution="ShardedByS3Key")},
                             job_name="p5-terraform-job", region="us-east-1", availability_zone_id="use1-az6")
    return est, path, files


def test_p5_root_module_names_the_instances_and_their_interfaces(p5_module):
    est, path, files = p5_module
    names = {os.path.relpath(f, path) for f in files}
    assert {"main.tf", "variables.tf", "terraform.tfvars", "outputs.tf", "spec.json", TEMPLATE} <= names
    assert {"modules/cluster/compute.tf", "modules/job/main.tf", "modules/efa-layout/main.tf"} <= names
    assert "sourcedir.tar.gz" not in names  # an installed module: no code to ship
    for f in files:
        if f.endswith((".tf", ".tfvars")):
            hcl.load(f)  # parses

    main = hcl.load(os.path.join(path, "main.tf"))
    local = _values(main["locals"][0])
    assert local["instance_type"] == "p5.48xlarge" and local["instance_count"] == 4 and local["efa_interfaces"] == 32
    modules = {k: v for m in main["module"] for k, v in m.items()}
    assert modules["cluster"]["source"] == "./modules/cluster" and modules["job"]["source"] == "./modules/job"
    assert modules["cluster"]["efa_interfaces"] == "${local.efa_interfaces}"
    job = modules["job"]
    assert job["instance_type"] == "${local.instance_type}" and job["instance_count"] == "${local.instance_count}"
    assert job["launch_template_id"] == "${module.cluster.launch_template_id}"
    assert job["efa_interfaces"] == "${module.cluster.efa_interfaces}"

    # the copied cluster module turns 32 into the interfaces of a p5: 1 efa + 31 efa-only
    layout = hcl.load_module(os.path.join(path, "modules", "efa-layout"))
    nics = hcl.evaluate(hcl.expression(layout["locals"]["network_interfaces"]),
                        {"var": {"efa_interfaces": local["efa_interfaces"]}})
    assert [n["interface_type"] for n in nics] == ["efa"] + ["efa-only"] * 31
    assert [n["network_card_index"] for n in nics] == list(range(32))


def test_p5_root_module_carries_the_job_spec(p5_module):
    est, path, _ = p5_module
    with open(os.path.join(path, "spec.json")) as fh:
        spec = JobSpec.from_json(fh.read())
    assert spec.job_name == "p5-terraform-job" and spec.instance_type == "p5.48xlarge" and spec.instance_count == 4
    assert spec.image_uri == IMAGE and spec.hyperparameters == HYPERPARAMETERS and spec.processes_per_host == 8
    assert spec.code_uri is None
    assert [(c.name, c.uri, c.distribution) for c in spec.channels] == [
        ("train", "s3://my-data/tokens", "FullyReplicated"), ("val", "s3://my-data/val", "ShardedByS3Key")]
    # the same as fit() would build, less the name
    assert spec.model_dump(exclude={"job_name", "channels"}) == est._spec.model_dump(exclude={"job_name", "channels"})

    local = _values(hcl.load(os.path.join(path, "main.tf"))["locals"][0])
    assert local["job_name"] == spec.job_name and local["image_uri"] == spec.image_uri
    assert local["instance_type"] == spec.instance_type and local["instance_count"] == spec.instance_count
    assert local["hyperparameters"] == spec.hyperparameters
    assert local["channels"] == {c.name: {"uri": c.uri, "distribution": c.distribution} for c in spec.channels}
    assert local["checkpoint_s3_uri"] == spec.checkpoint_s3_uri and local["output_path"] == spec.output_path
    assert local["state_s3_uri"] == "s3://my-bucket/jobs/p5-terraform-job/trainyard"  # backend.state_uri
    assert local["fsx"] == [] and local["use_spot"] is False
    outputs = {k: v for o in hcl.load(os.path.join(path, "outputs.tf"))["output"] for k, v in o.items()}
    assert outputs["hyperparameters"]["value"] == "${local.hyperparameters}"

    cluster = {k: v for m in hcl.load(os.path.join(path, "main.tf"))["module"] for k, v in m.items()}["cluster"]
    assert cluster["read_s3_uris"] == ["s3://my-data/tokens", "s3://my-data/val"]
    assert cluster["write_s3_uris"] == ["s3://my-ckpt/run-1"] and cluster["output_s3_uri"] == "${local.output_path}"
    assert cluster["ecr_pull_repository_arns"] == ["arn:aws:ecr:us-east-1:123456789012:repository/trainyard"]
    assert cluster["create_fsx"] is False
    tfvars = hcl.load(os.path.join(path, "terraform.tfvars"))
    assert tfvars["region"] == "us-east-1" and tfvars["availability_zone_id"] == "use1-az6"


def test_p5_user_data_is_the_ec2_backends(p5_module):
    _, path, _ = p5_module
    with open(os.path.join(path, "spec.json")) as fh:
        spec = JobSpec.from_json(fh.read())
    with open(os.path.join(path, TEMPLATE)) as fh:
        template = fh.read()
    expected = render_user_data(spec, state_uri="s3://my-bucket/jobs/p5-terraform-job/trainyard", region="us-east-1",
                                attempt=1, fsx_mounts=[])
    assert _fill(template, []) == expected


@pytest.mark.skipif(hcl.terraform() is None, reason="no terraform binary on this machine: `terraform fmt` not run")
def test_rendered_module_is_formatted(p5_module, tmp_path):
    _, path, _ = p5_module
    r = subprocess.run([hcl.terraform(), "fmt", "-check", "-recursive", "-diff", path],
                       env=hcl.terraform_env(str(tmp_path)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"terraform fmt would change:\n{r.stdout}\n{r.stderr}"


def test_script_with_cluster_fsx_channel(tmp_path):
    """Code is packaged next to the module (uploaded by apply); a channel on the cluster's own FSx file
    system is mounted with the names Terraform fills into the user data; hostile strings stay literal."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('hi')\n")
    hps = {"note": 'a ${b} %{c} "q" \\ tab\t', "lr": 1e-05, "layers": [1, 2], "opt": {"b1": 0.9}, "flag": False}
    est = Estimator(entry_point="train.py", source_dir=str(src), instance_type="p4d.24xlarge", instance_count=2,
                    image_uri=IMAGE, output_path="s3://my-bucket/jobs", hyperparameters=hps, use_spot_instances=True,
                    max_wait=172800)
    path = str(tmp_path / "job")
    files = est.to_terraform(path, {"train": FileSystemInput(CLUSTER_FSX, directory_path="/data/tokens")},
                             job_name="fsx-job", region="us-west-2", data_s3_uri="s3://my-data/corpus")
    names = {os.path.relpath(f, path) for f in files}
    assert "sourcedir.tar.gz" in names
    with open(os.path.join(path, "spec.json")) as fh:
        spec = JobSpec.from_json(fh.read())
    assert spec.code_uri.startswith("s3://my-bucket/fsx-job/source/trainyard-code/") and spec.hyperparameters == hps
    main = hcl.load(os.path.join(path, "main.tf"))
    local = _values(main["locals"][0])
    assert local["hyperparameters"] == hps and local["efa_interfaces"] == 4 and local["use_spot"] is True
    assert local["fsx"] == [{"dns_name": "${module.cluster.fsx_dns_name}",
                             "mount_name": "${module.cluster.fsx_mount_name}"}]
    modules = {k: v for m in main["module"] for k, v in m.items()}
    assert modules["cluster"]["create_fsx"] is True
    assert modules["job"]["code_archive_path"] == "${path.module}/sourcedir.tar.gz"
    assert modules["job"]["code_s3_uri"] == "${local.code_uri}" and local["code_uri"] == spec.code_uri
    tfvars = hcl.load(os.path.join(path, "terraform.tfvars"))
    assert tfvars["data_bucket_name"] == "my-data" and tfvars["data_s3_prefix"] == "corpus"
    assert "availability_zone_id" not in tfvars  # not given: terraform asks
    with open(os.path.join(path, TEMPLATE)) as fh:
        template = fh.read()
    filled = _fill(template, [FSX_NAMES])
    state = "s3://my-bucket/jobs/fsx-job/trainyard"
    assert filled == render_user_data(spec, state_uri=state, region="us-west-2", attempt=1,
                                      fsx_mounts=[{"file_system_id": CLUSTER_FSX, **FSX_NAMES}])
    assert f"mount -t lustre -o relatime,flock {FSX_NAMES['dns_name']}@tcp:/abcdefgh /fsx/{CLUSTER_FSX}" in filled
    if hcl.terraform():  # terraform's own templatefile gives the same script
        probe = tmp_path / "probe"
        probe.mkdir()
        (probe / "main.tf").write_text(
            f'output "user_data" {{\n  value = templatefile("{path}/{TEMPLATE}", {{ fsx = '
            f'[{{ dns_name = "{FSX_NAMES["dns_name"]}", mount_name = "{FSX_NAMES["mount_name"]}" }}] }})\n}}\n'
            f'output "hyperparameters" {{\n  value = {_hcl_of(path, "hyperparameters")}\n}}\n')
        outputs = hcl.terraform_outputs(str(probe))
        assert outputs["user_data"] == filled
        assert outputs["hyperparameters"] == {**hps, "lr": pytest.approx(1e-05)}
        r = subprocess.run([hcl.terraform(), "fmt", "-check", "-recursive", path], env=hcl.terraform_env(str(tmp_path)),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout


def _hcl_of(path: str, local: str) -> str:
    """The text of one multi-line local of the rendered main.tf (to let terraform evaluate it)."""
    with open(os.path.join(path, "main.tf")) as fh:
        text = fh.read()
    m = re.search(rf"^  {local} = (\{{.*?^  \}})$", text, re.S | re.M)
    return m.group(1)


def test_existing_cluster_outputs(tmp_path):
    outputs = {"launch_template_id": {"value": "lt-0123456789abcdef0", "type": "string", "sensitive": False},
               "efa_interfaces": {"value": 32}, "fsx_file_system_id": {"value": "fs-0123456789abcdef0"},
               "fsx_dns_name": {"value": FSX_NAMES["dns_name"]}, "fsx_mount_name": {"value": "abcdefgh"},
               "region": {"value": "ap-northeast-1"}}
    path = str(tmp_path / "job")
    channel = FileSystemInput("fs-0123456789abcdef0", directory_path="/data/tokens")
    _p5(instance_count=2).to_terraform(path, {"train": channel}, job_name="in-cluster", cluster=outputs)
    main = hcl.load(os.path.join(path, "main.tf"))
    modules = {k: v for m in main["module"] for k, v in m.items()}
    assert set(modules) == {"job"}
    assert modules["job"]["launch_template_id"] == "lt-0123456789abcdef0"
    assert _values(main["locals"][0])["fsx"] == [FSX_NAMES]
    assert "availability_zone_id" not in hcl.load(os.path.join(path, "variables.tf"))["variable"][0]
    assert hcl.load(os.path.join(path, "terraform.tfvars"))["region"] == "ap-northeast-1"  # the cluster's
    with pytest.raises(ConfigError, match="availability_zone_id: only for a new cluster"):
        _p5().to_terraform(path, cluster=outputs, availability_zone_id="use1-az6")


def test_other_file_systems_come_from_a_variable(tmp_path):
    path = str(tmp_path / "job")
    _p5().to_terraform(path, {"train": FileSystemInput("fs-0fedcba9876543210", directory_path="/x")},
                       job_name="ext-fsx", region="us-east-1",
                       fsx_mounts=[{"file_system_id": "fs-0fedcba9876543210", **FSX_NAMES}])
    local = _values(hcl.load(os.path.join(path, "main.tf"))["locals"][0])
    assert local["fsx"] == ['${var.fsx_file_systems["fs-0fedcba9876543210"]}']
    tfvars = _values(hcl.load(os.path.join(path, "terraform.tfvars")))
    assert tfvars["fsx_file_systems"] == {"fs-0fedcba9876543210": FSX_NAMES}


def test_render_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="instance_type"):
        Estimator(entry_point="trainyard.engine.train", hyperparameters={"steps": 1}).to_terraform(str(tmp_path))
    with pytest.raises(ConfigError, match="data_s3_uri"):
        _p5().to_terraform(str(tmp_path), {"t": FileSystemInput(CLUSTER_FSX, directory_path="/data")},
                           region="us-east-1")
    with pytest.raises(ConfigError, match="4 EFA interface"):
        _p5().to_terraform(str(tmp_path), region="us-east-1",
                           cluster={"launch_template_id": "lt-0123456789abcdef0", "efa_interfaces": 4})
    with pytest.raises(ConfigError, match="availability_zone_id"):
        _p5().to_terraform(str(tmp_path), region="us-east-1", availability_zone_id="us-east-1a")
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="region"):
        _p5().to_terraform(str(tmp_path))
    assert not os.listdir(tmp_path)  # nothing written before the checks passed


def test_render_command(tmp_path, capsys):
    from trainyard.sdk.cli import main

    est = tmp_path / "estimator.json"
    est.write_text(json.dumps({"entry_point": "trainyard.engine.train", "instance_type": "ml.p4d.24xlarge",
                               "instance_count": 2, "image_uri": IMAGE, "output_path": "s3://my-bucket/jobs",
                               "hyperparameters": HYPERPARAMETERS}))
    out = str(tmp_path / "out")
    assert main([
        "render", "terraform", str(est), out, "--job-name", "cli-job", "--region", "eu-west-1",
        "--availability-zone-id", "euw1-az1", "--data-s3-uri", "s3://my-data/x",
        "--inputs", '{"train": {"file_system_id": "cluster", "directory_path": "/data/t"}, '
                    '"ext": {"file_system_id": "fs-0fedcba9876543210"}, "raw": "s3://my-data/raw"}',
        "--fsx-mount", f"fs-0fedcba9876543210={FSX_NAMES['dns_name']}:{FSX_NAMES['mount_name']}"]) == 0
    assert os.path.join(out, "main.tf") in capsys.readouterr().out.splitlines()
    with open(os.path.join(out, "spec.json")) as fh:
        spec = JobSpec.from_json(fh.read())
    assert spec.job_name == "cli-job" and spec.instance_type == "p4d.24xlarge" and spec.instance_count == 2
    assert [c.uri for c in spec.channels] == [f"fsx://{CLUSTER_FSX}/data/t", "fsx://fs-0fedcba9876543210",
                                              "s3://my-data/raw"]
    local = _values(hcl.load(os.path.join(out, "main.tf"))["locals"][0])
    assert local["fsx"][1] == '${var.fsx_file_systems["fs-0fedcba9876543210"]}'
    assert main(["render", "terraform", str(est), out, "--fsx-mount", "nonsense"]) == 2
    assert "fsx_mount" in capsys.readouterr().err


def _spec(**kw) -> JobSpec:
    fields = dict(job_name="tagged-job", entry_point="trainyard.engine.train", entry_kind="module",
                  instance_type="p4d.24xlarge", instance_count=2, processes_per_host=8, image_uri=IMAGE, role=ROLE,
                  output_path="s3://my-bucket/jobs")
    return build_spec(**{**fields, **kw})


def test_tags_and_volume_size_reach_both_modules(tmp_path):
    tags = {"team": "ml", "cost center": "42 ${x}"}  # a literal, never an interpolation
    path = str(tmp_path / "job")
    render_root_module(_spec(tags=tags, volume_size=250), path, region="us-east-1", availability_zone_id="use1-az6")
    main = hcl.load(os.path.join(path, "main.tf"))
    local = _values(main["locals"][0])
    assert local["tags"] == tags and local["volume_size"] == 250
    modules = {k: v for m in main["module"] for k, v in m.items()}
    assert modules["cluster"]["tags"] == modules["job"]["tags"] == "${local.tags}"
    assert modules["cluster"]["root_volume_size_gib"] == "${local.volume_size}"
    # what the modules do with them: every cluster resource and the job's instances carry the tags
    cluster = hcl.load_module(os.path.join(path, "modules", "cluster"))
    cluster_tags = hcl.evaluate(hcl.expression(cluster["locals"]["tags"]), {"var": {"tags": tags, "name": "c"}})
    assert tags.items() <= cluster_tags.items() and cluster_tags["trainyard:cluster"] == "c"
    job = hcl.load_module(os.path.join(path, "modules", "job"))
    job_tags = hcl.evaluate(hcl.expression(job["locals"]["job_tags"]),
                            {"var": {"tags": tags, "job_name": "tagged-job"}, "local": {"attempt": 1}})
    assert tags.items() <= job_tags.items() and job_tags["trainyard:job"] == "tagged-job"
    if hcl.terraform():  # terraform reads the local back as the same map, and the module stays formatted
        probe = tmp_path / "probe"
        probe.mkdir()
        (probe / "main.tf").write_text(f'output "tags" {{\n  value = {_hcl_of(path, "tags")}\n}}\n')
        assert hcl.terraform_outputs(str(probe))["tags"] == tags
        r = subprocess.run([hcl.terraform(), "fmt", "-check", "-recursive", path], env=hcl.terraform_env(str(tmp_path)),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout
    # no tags: an empty map, and the modules' own tags only
    render_root_module(_spec(), path, region="us-east-1")
    assert _values(hcl.load(os.path.join(path, "main.tf"))["locals"][0])["tags"] == {}


def test_security_groups_are_refused_and_an_existing_cluster_keeps_its_volume(tmp_path):
    with pytest.raises(ConfigError) as e:
        render_root_module(_spec(security_group_ids=["sg-0123456789abcdef0"]), str(tmp_path / "a"), region="us-east-1")
    assert e.value.field == "security_group_ids" and not os.path.exists(tmp_path / "a")
    path = str(tmp_path / "b")
    render_root_module(_spec(tags={"team": "ml"}, volume_size=250), path, region="us-east-1",
                       cluster={"launch_template_id": "lt-0123456789abcdef0", "efa_interfaces": 4})
    main = hcl.load(os.path.join(path, "main.tf"))
    modules = {k: v for m in main["module"] for k, v in m.items()}
    assert set(modules) == {"job"} and modules["job"]["tags"] == "${local.tags}"
    with open(os.path.join(path, "main.tf")) as fh:
        assert "whose root volume size it keeps" in fh.read().replace("\n# ", " ")


@pytest.mark.parametrize("network,nat", [(None, False), ({"internet": True}, True)])
def test_internet_access_turns_on_the_clusters_nat_gateway(tmp_path, network, nat):
    path = str(tmp_path / "job")
    _p5(network=network).to_terraform(path, {"train": "s3://my-data/tokens"}, job_name="nat-job",
                                      region="us-east-1", availability_zone_id="use1-az6")
    variables = {k: v for block in hcl.load(os.path.join(path, "variables.tf"))["variable"] for k, v in block.items()}
    assert variables["enable_nat_gateway"]["default"] is nat  # the image is in ECR: the endpoints suffice without it
