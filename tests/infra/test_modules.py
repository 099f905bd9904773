"""The Terraform modules as files: formatted as `terraform fmt` wants, parseable, every variable described
(and validated where a bad value is possible), every output described, versions pinned."""
import glob
import os
import subprocess

import pytest

from . import hcl

TF_FILES = sorted(glob.glob(os.path.join(hcl.REPO, "infra", "**", "*.tf"), recursive=True))
MODULE_DIRS = sorted(os.path.join(hcl.MODULES, m) for m in os.listdir(hcl.MODULES))


def test_the_modules_are_there():
    assert [os.path.basename(d) for d in MODULE_DIRS] == ["cluster", "efa-layout", "job"]
    for d in MODULE_DIRS:
        names = {os.path.basename(p) for p in glob.glob(os.path.join(d, "*.tf"))}
        assert {"main.tf", "variables.tf", "outputs.tf", "versions.tf"} <= names, d


@pytest.mark.skipif(hcl.terraform() is None, reason="no terraform binary on this machine: `terraform fmt` not run")
def test_terraform_fmt_check(tmp_path):
    r = subprocess.run([hcl.terraform(), "fmt", "-check", "-recursive", "-diff", "infra/"], cwd=hcl.REPO,
                       env=hcl.terraform_env(str(tmp_path)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"terraform fmt would change:\n{r.stdout}\n{r.stderr}"


@pytest.mark.parametrize("path", TF_FILES, ids=lambda p: os.path.relpath(p, hcl.REPO))
def test_every_file_parses(path):
    doc = hcl.load(path)
    assert doc, path


@pytest.mark.parametrize("directory", MODULE_DIRS, ids=os.path.basename)
def test_variables_and_outputs_are_described_and_validated(directory):
    module = hcl.load_module(directory)
    assert module["variable"] and module["output"]
    for name, body in module["variable"].items():
        assert len(body.get("description", "")) > 20, f"variable {name}: no description"
        assert "type" in body, f"variable {name}: no type"
        free = body["type"] in ("bool", "${bool}", "${map(string)}", "map(string)")  # no value is bad
        if not free:
            validations = body.get("validation") or []
            assert validations, f"variable {name} ({body['type']}) has no validation"
            for v in validations:
                assert v["condition"].startswith("${") and len(v["error_message"]) > 20, name
    for name, body in module["output"].items():
        assert len(body.get("description", "")) > 10, f"output {name}: no description"


def test_versions_are_pinned():
    for directory in MODULE_DIRS:
        doc = hcl.load(os.path.join(directory, "versions.tf"))
        block = doc["terraform"][0]
        assert block["required_version"].startswith(">= 1.5"), directory
        providers = block.get("required_providers", [{}])[0]
        if os.path.basename(directory) == "efa-layout":
            assert not providers  # provider-free: init and validate run offline
        else:
            assert providers["aws"]["source"] == "hashicorp/aws"
            assert providers["aws"]["version"].startswith("~> 5."), providers


def test_cluster_outputs_what_jobs_and_users_need():
    outputs = set(hcl.load_module(os.path.join(hcl.MODULES, "cluster"))["output"])
    assert {"vpc_id", "subnet_id", "security_group_id", "placement_group_name", "launch_template_id",
            "efa_interfaces", "instance_profile_arn", "role_arn", "kms_key_arn", "checkpoint_bucket_name",
            "checkpoint_bucket_arn", "ecr_repository_url", "ecr_repository_arn", "fsx_file_system_id",
            "fsx_dns_name", "fsx_mount_name", "log_group_name", "region"} <= outputs


@pytest.mark.skipif(hcl.terraform() is None, reason="no terraform binary on this machine: `terraform validate` not run")
def test_the_provider_free_module_validates(tmp_path):
    """efa-layout has no provider, so terraform validates it offline (the others need the aws provider,
    which cannot be downloaded here)."""
    import shutil

    work = tmp_path / "efa-layout"
    shutil.copytree(os.path.join(hcl.MODULES, "efa-layout"), work)
    env = hcl.terraform_env(str(tmp_path))
    for cmd in (["init", "-backend=false", "-input=false", "-no-color"], ["validate", "-no-color"]):
        r = subprocess.run([hcl.terraform(), *cmd], cwd=work, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"
