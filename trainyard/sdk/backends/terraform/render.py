"""A job as Terraform: a root module that uses `infra/modules` (the `terraform` backend of DESIGN.md).

    render_root_module(spec, "tf/my-job", region="us-east-1", availability_zone_id="use1-az6")
    # cd tf/my-job && terraform init && terraform apply

The output folder is self-contained: the modules are copied into `<path>/modules/` (cluster, job,
efa-layout), so the folder can be moved, archived or committed and applies the same later, whatever
this repository becomes. It holds

    main.tf              the provider, the job's values as locals, module "cluster" (unless the outputs
                         of an existing cluster are given) and module "job"
    variables.tf         what the job does not decide: region, zone, data bucket, NAT, ...
    terraform.tfvars     the values known when rendering (region, zone, ...)
    outputs.tf           instance ids, hosts, state prefix, and the job's values read back
    spec.json            the JobSpec (JobSpec.to_json); module "job" writes it to <state prefix>/spec.json
    user_data.sh.tftpl   the instances' user data (trainyard/sdk/backends/aws/userdata.py), a templatefile() template whose
                         only variables are the FSx file systems' DNS and mount names
    sourcedir.tar.gz     the code, when there is code to ship; module "job" uploads it to spec.code_uri

The user data is rendered here by the EC2 backend's own function; what is known only once Terraform
has created the cluster (the FSx file system's DNS and mount names) is left as `${fsx[i].dns_name}` and
`${fsx[i].mount_name}` for `templatefile` to fill, and every other `${` / `%{` of the script is escaped.
An FSx channel on the cluster module's own file system names it `CLUSTER_FSX` (its id is not known
before `apply`): it is mounted at `/fsx/<CLUSTER_FSX>` and linked from there, like any other.

Nothing here calls AWS: the number of EFA interfaces comes from the shipped catalog.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import textwrap
from decimal import Decimal
from typing import Any

import trainyard
from trainyard.job import catalog
from trainyard.errors import ConfigError
from trainyard.job.spec import JobSpec
from trainyard.job.uris import split_fsx, split_s3
from trainyard.sdk.backends.aws.state import check_inputs, state_uri
from trainyard.sdk.backends.aws.userdata import render_user_data

# An fsx:// channel on the file system that module "cluster" creates, whose id is known only after
# apply: FileSystemInput(CLUSTER_FSX, "/data/tokens"). (A valid-looking id no file system has.)
CLUSTER_FSX = "fs-00000000000000000"
MODULES = ("cluster", "job", "efa-layout")
TERRAFORM_VERSION = ">= 1.5.0, < 2.0.0"
AWS_PROVIDER_VERSION = "~> 5.60"  # as infra/modules/*/versions.tf
TEMPLATE = "user_data.sh.tftpl"
CODE_ARCHIVE = "sourcedir.tar.gz"
ATTEMPT = 1  # Terraform launches the first attempt only (modules/job)
_CLUSTER_NAME = re.compile(r"^[a-z][a-z0-9-]{1,22}[a-z0-9]$")
_ZONE_ID = re.compile(r"^[a-z]{2,4}[0-9]+-([a-z]+[0-9]+-)?az[0-9]+$")
_ECR_IMAGE = re.compile(r"^(\d{12})\.dkr\.ecr(?:-fips)?\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?/([^:@]+)")


def modules_dir() -> str:
    """This repository's `infra/modules` (`TRAINYARD_TF_MODULES` overrides)."""
    path = os.environ.get("TRAINYARD_TF_MODULES") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(trainyard.__file__))), "infra", "modules")
    if not all(os.path.isdir(os.path.join(path, m)) for m in MODULES):
        raise ConfigError("terraform", f"the Terraform modules are not at {path} (an installed wheel does not ship "
                                       "them): set TRAINYARD_TF_MODULES to a checkout's infra/modules")
    return path


def render_root_module(spec: JobSpec, path: str, *, cluster: dict | None = None, region: str | None = None,
                       availability_zone_id: str | None = None, data_s3_uri: str | None = None,
                       fsx_mounts: list[dict] | None = None, code_archive: bytes | None = None) -> list[str]:
    """Write `spec` as a Terraform root module in `path` (created; files there are overwritten) and
    return the files written.

    cluster: the outputs of an existing `modules/cluster` (a dict of name to value, or `terraform output
        -json` as it prints them): the job then uses its launch template and FSx file system, and no
        cluster is created.
    region: the AWS region (default: `cluster["region"]`, AWS_REGION, AWS_DEFAULT_REGION).
    availability_zone_id: the new cluster's zone (use1-az6); without it, terraform asks.
    data_s3_uri: the S3 prefix the new cluster's FSx file system is linked to (its `/data` folder);
        required when a channel is on `CLUSTER_FSX`.
    fsx_mounts: DNS and mount names of other FSx file systems that channels read (`file_system_id`,
        `dns_name`, `mount_name`, as the EC2 backend's); without them, terraform asks.
    code_archive: the bytes of `sourcedir.tar.gz`, uploaded by `apply` to `spec.code_uri`.
    """
    itype = catalog.lookup(spec.instance_type)
    if itype.is_local:
        raise ConfigError("instance_type", "Terraform renders EC2 jobs: give an EC2 instance type such as "
                                           "'ml.p5.48xlarge'")
    if not spec.job_name:
        raise ConfigError("job_name", "the spec has no job_name yet")
    if not spec.image_uri:
        raise ConfigError("image_uri", "EC2 jobs need a training image (an ECR URI)")
    if spec.subnets:
        raise ConfigError("subnets", "a Terraform job runs in its cluster's subnet; leave subnets out")
    if spec.security_group_ids:
        raise ConfigError("security_group_ids", "a Terraform job's instances are in their cluster's security group "
                                                "(its launch template); leave security_group_ids out")
    if spec.capacity_reservation_id:
        raise ConfigError("capacity_reservation_id", "the Terraform modules do not launch into a capacity "
                                                     "reservation yet; run the job with fit(), or leave it out")
    check_inputs(spec)
    efa = itype.max_efa_interfaces if itype.efa_supported else 0
    if spec.instance_count > 1 and efa == 0:
        raise ConfigError("instance_type", f"{itype.name} has no EFA: a job of {spec.instance_count} instances "
                                           "needs an EFA instance type (p4d, p5, trn1, ...)")
    existing = _cluster_outputs(cluster, efa) if cluster is not None else None
    region = region or (existing or {}).get("region") or os.environ.get("AWS_REGION") or \
        os.environ.get("AWS_DEFAULT_REGION")
    if not region:
        raise ConfigError("region", "no region: pass region='us-east-1' (or set AWS_REGION)")
    for field, value in (("availability_zone_id", availability_zone_id), ("data_s3_uri", data_s3_uri)):
        if existing is not None and value is not None:
            raise ConfigError(field, "only for a new cluster: with cluster= the job runs in that cluster")
    if availability_zone_id is not None and not _ZONE_ID.match(availability_zone_id):
        raise ConfigError("availability_zone_id", f"{availability_zone_id!r} is not a zone ID such as 'use1-az6'")
    if data_s3_uri is not None and not data_s3_uri.startswith("s3://"):
        raise ConfigError("data_s3_uri", f"expected an s3:// URI, got {data_s3_uri!r}")
    if code_archive is not None and not (spec.code_uri or "").startswith("s3://"):
        raise ConfigError("code_uri", "a code archive needs the spec's code_uri (s3://) to go to")

    fsx_ids = list(dict.fromkeys(split_fsx(c.uri)[0] for c in spec.channels if c.uri.startswith("fsx://")))
    create_fsx = existing is None and (data_s3_uri is not None or CLUSTER_FSX in fsx_ids)
    if existing is None and CLUSTER_FSX in fsx_ids and data_s3_uri is None:
        raise ConfigError("data_s3_uri", f"a channel reads the cluster's file system ({CLUSTER_FSX}), which is "
                                         "linked to a data bucket: pass data_s3_uri='s3://bucket/prefix'")
    mounts, external = _fsx_sources(fsx_ids, existing, fsx_mounts)

    state = state_uri(spec)
    # placeholders that shlex.quote leaves alone, replaced by template variables after escaping
    tokens = [{"file_system_id": fs, "dns_name": f"@@TRAINYARD_FSX_{i}_DNS@@",
               "mount_name": f"@@TRAINYARD_FSX_{i}_MOUNT@@"} for i, fs in enumerate(fsx_ids)]
    user_data = render_user_data(spec, state_uri=state, region=region, attempt=ATTEMPT, fsx_mounts=tokens)
    template = user_data.replace("${", "$${").replace("%{", "%%{")
    for i in range(len(fsx_ids)):
        template = template.replace(f"@@TRAINYARD_FSX_{i}_DNS@@", f"${{fsx[{i}].dns_name}}")
        template = template.replace(f"@@TRAINYARD_FSX_{i}_MOUNT@@", f"${{fsx[{i}].mount_name}}")

    os.makedirs(path, exist_ok=True)
    written: list[str] = []

    def write(name: str, content: str | bytes) -> None:
        target = os.path.join(path, name)
        with open(target, "wb") as fh:
            fh.write(content.encode() if isinstance(content, str) else content)
        written.append(target)

    name = _cluster_name(spec.job_name)
    write("main.tf", _main_tf(spec, itype.name, efa, state, existing, create_fsx, mounts, bool(code_archive)))
    write("variables.tf", _variables_tf(spec, existing, create_fsx, external, name))
    write("terraform.tfvars", _tfvars(region, availability_zone_id, data_s3_uri, existing, external, fsx_mounts or []))
    write("outputs.tf", _outputs_tf(existing))
    write("spec.json", spec.to_json() + "\n")
    write(TEMPLATE, template)
    if code_archive is not None:
        write(CODE_ARCHIVE, code_archive)
    written += _copy_modules(os.path.join(path, "modules"))
    return written


# ---- inputs ---------------------------------------------------------------------------------------


def _cluster_outputs(cluster: dict, efa: int) -> dict:
    if not isinstance(cluster, dict):
        raise ConfigError("cluster", f"expected the cluster module's outputs as a dict, got {type(cluster).__name__}")
    out = {k: (v["value"] if isinstance(v, dict) and "value" in v else v) for k, v in cluster.items()}
    template = out.get("launch_template_id")
    if not isinstance(template, str) or not re.match(r"^lt-[0-9a-f]{8,17}$", template):
        raise ConfigError("cluster", "needs launch_template_id (the outputs of infra/modules/cluster, as "
                                     "`terraform output -json` prints them)")
    if out.get("efa_interfaces") is not None and int(out["efa_interfaces"]) != efa:
        raise ConfigError("cluster", f"the cluster's launch template has {out['efa_interfaces']} EFA interface(s); "
                                     f"this instance type needs {efa}")
    return out


def _fsx_sources(fsx_ids: list[str], existing: dict | None, given: list[dict] | None) -> tuple[list[str], list[str]]:
    """For each FSx file system the channels read, in order: the HCL expression of its {dns_name,
    mount_name}; and the ids whose names come from the `fsx_file_systems` variable."""
    known = {m.get("file_system_id"): m for m in given or []}
    exprs, external = [], []
    for fs in fsx_ids:
        if fs == CLUSTER_FSX and existing is None:
            exprs.append("{ dns_name = module.cluster.fsx_dns_name, mount_name = module.cluster.fsx_mount_name }")
        elif existing is not None and fs in (CLUSTER_FSX, existing.get("fsx_file_system_id")):
            if not (existing.get("fsx_dns_name") and existing.get("fsx_mount_name")):
                raise ConfigError("cluster", "a channel reads the cluster's file system but the outputs have no "
                                             "fsx_dns_name and fsx_mount_name (a cluster without create_fsx?)")
            exprs.append(f"{{ dns_name = {_string(existing['fsx_dns_name'])}, "
                         f"mount_name = {_string(existing['fsx_mount_name'])} }}")
        else:
            if fs in known and not (known[fs].get("dns_name") and known[fs].get("mount_name")):
                raise ConfigError("fsx_mounts", f"{fs}: needs dns_name and mount_name")
            exprs.append(f"var.fsx_file_systems[{_string(fs)}]")
            external.append(fs)
    return exprs, external


def _cluster_name(job_name: str) -> str:
    """A cluster name for the job (modules/cluster: 3-24 characters), unique per job name."""
    base = re.sub(r"[^a-z0-9]+", "-", job_name.lower()).strip("-")[:13].strip("-") or "job"
    name = f"ty-{base}-{hashlib.sha256(job_name.encode()).hexdigest()[:6]}"
    assert _CLUSTER_NAME.match(name), name
    return name


def _ecr_repository_arn(image_uri: str) -> str | None:
    m = _ECR_IMAGE.match(image_uri)
    if not m:
        return None
    account, region, china, repo = m.groups()
    return f"arn:{'aws-cn' if china else 'aws'}:ecr:{region}:{account}:repository/{repo}"


def _copy_modules(dest: str) -> list[str]:
    src = modules_dir()
    written = []
    for module in MODULES:
        target = os.path.join(dest, module)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.makedirs(target)
        for name in sorted(os.listdir(os.path.join(src, module))):
            if name.endswith(".tf"):  # not .terraform/ or a lock file a local init left
                shutil.copyfile(os.path.join(src, module, name), os.path.join(target, name))
                written.append(os.path.join(target, name))
    return written


# ---- HCL, formatted as `terraform fmt` formats it ---------------------------------------------------


class Expr(str):
    """An HCL expression written as is (a reference, a call), not as a string literal."""


def _string(s: str) -> str:
    out = json.dumps(s, ensure_ascii=False).replace("\\b", "\\u0008").replace("\\f", "\\u000c")
    return out.replace("${", "$${").replace("%{", "%%{")  # a literal, never an interpolation


def _value(v: Any, indent: int) -> str:
    """`v` (JSON-like, or an Expr) as HCL; lists of scalars on one line, objects on several."""
    pad = "  " * indent
    if isinstance(v, Expr):
        return str(v)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):  # positional notation: 1e-05 -> 0.00001, as terraform fmt leaves it
        return format(Decimal(repr(v)), "f")
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, dict):
        if not v:
            return "{}"
        return "{\n" + "\n".join(_attributes([(_string(k), x) for k, x in v.items()], indent + 1)) + f"\n{pad}}}"
    if isinstance(v, (list, tuple)):
        items = [_value(x, indent + 1) for x in v]
        if all("\n" not in i for i in items) and sum(len(i) + 2 for i in items) + len(pad) < 100:
            return "[" + ", ".join(items) + "]"
        return "[\n" + "".join(f"{pad}  {i},\n" for i in items) + f"{pad}]"
    raise TypeError(f"no HCL for {type(v).__name__}")


def _attributes(pairs: list[tuple[str, Any]], indent: int) -> list[str]:
    """`key = value` lines; the `=` of consecutive one-line attributes aligned (a multi-line one stands alone)."""
    pad = "  " * indent
    rendered = [(k, _value(v, indent)) for k, v in pairs]
    lines: list[str] = []
    run: list[tuple[str, str]] = []

    def flush() -> None:
        width = max((len(k) for k, _ in run), default=0)
        lines.extend(f"{pad}{k.ljust(width)} = {v}" for k, v in run)
        run.clear()

    for k, v in rendered:
        if "\n" in v:
            flush()
            lines.append(f"{pad}{k} = {v}")
        else:
            run.append((k, v))
    flush()
    return lines


def _block(header: str, pairs: list[tuple[str, Any]], indent: int = 0) -> str:
    pad = "  " * indent
    return f"{pad}{header} {{\n" + "\n".join(_attributes(pairs, indent + 1)) + f"\n{pad}}}\n"


def _comment(text: str) -> str:
    return "".join(f"# {line}".rstrip() + "\n" for line in text.strip("\n").splitlines())


# ---- the files ------------------------------------------------------------------------------------

_TERRAFORM_BLOCK = f"""terraform {{
  required_version = "{TERRAFORM_VERSION}"

  required_providers {{
    aws = {{
      source  = "hashicorp/aws"
      version = "{AWS_PROVIDER_VERSION}"
    }}
  }}
}}
"""


def _main_tf(spec: JobSpec, instance_type: str, efa: int, state: str, existing: dict | None, create_fsx: bool,
             mounts: list[str], has_code: bool) -> str:
    channels = {c.name: {"uri": c.uri, "distribution": c.distribution} for c in spec.channels}
    if existing is None:
        what = ("creates the job's cluster (modules/cluster: VPC and endpoints, EFA security group, placement group, "
                "FSx, checkpoint bucket, role, ECR, launch template) and launches")
    else:
        what = (f"launches, from the launch template {existing['launch_template_id']} of an existing cluster "
                "(whose root volume size it keeps),")
    header = textwrap.fill(
        f"Trainyard job {spec.job_name}, rendered from its JobSpec (spec.json) by `trainyard render terraform`. "
        f"`terraform init && terraform apply` {what} the job's {spec.instance_count} instance(s) (modules/job): they "
        "mount the data, run the node agent and terminate themselves when training ends. `terraform destroy` then "
        "removes the rest (another `terraform apply` would launch the job again).", 100)
    if spec.use_spot_instances:
        header += "\n" + textwrap.fill("Spot: an interrupted job is not relaunched under Terraform (max_retry_attempts "
                                        "is the EC2 backend's).", 100)
    out = [_comment(header), "\n", _TERRAFORM_BLOCK]
    out.append("\n" + _block('provider "aws"', [("region", Expr("var.region"))]))
    scalars: list[tuple[str, Any]] = [
        ("job_name", spec.job_name),
        ("instance_type", instance_type),  # EC2's name, without SageMaker's ml.
        ("instance_count", spec.instance_count),
        ("processes_per_host", spec.processes_per_host),
        ("efa_interfaces", efa),  # the catalog's MaximumEfaInterfaces of the type
        ("image_uri", spec.image_uri),
        ("use_spot", spec.use_spot_instances),
        ("output_path", spec.output_path),
        ("checkpoint_s3_uri", spec.checkpoint_s3_uri),
        ("code_uri", spec.code_uri),
        ("state_s3_uri", state),
        ("hyperparameters", spec.hyperparameters),
        ("channels", channels),
        ("fsx", Expr("[" + ", ".join(mounts) + "]") if mounts else []),
        ("volume_size", spec.volume_size),
        ("tags", spec.tags),
    ]
    out.append("\n" + _comment("The job's values, as in spec.json (hyperparameters and channels too: see outputs.tf)."
                               "\nfsx: DNS and mount names of the FSx file systems the user data mounts, in its "
                               "order.\ntags: on every resource created, with the modules' own (trainyard:job, "
                               "trainyard:cluster).") + _block("locals", scalars))
    if existing is None:
        reads = [c.uri for c in spec.channels if c.uri.startswith("s3://")]
        if spec.code_uri and spec.code_uri.startswith("s3://") and not _under(spec.code_uri, spec.output_path):
            reads.append(spec.code_uri)
        ecr = _ecr_repository_arn(spec.image_uri)
        cluster_args: list[tuple[str, Any]] = [
            ("source", "./modules/cluster"),
            ("name", Expr("var.cluster_name")),
            ("availability_zone_id", Expr("var.availability_zone_id")),
            ("efa_interfaces", Expr("local.efa_interfaces")),
            ("enable_nat_gateway", Expr("var.enable_nat_gateway")),
            ("create_log_group", Expr("var.create_log_group")),
            ("ecr_repository_name", Expr("var.cluster_name")),
            ("ecr_pull_repository_arns", [ecr] if ecr else []),
            ("output_s3_uri", Expr("local.output_path")),
            ("read_s3_uris", reads),
            ("write_s3_uris", [spec.checkpoint_s3_uri] if spec.checkpoint_s3_uri else []),
            ("create_fsx", create_fsx),
            ("root_volume_size_gib", Expr("local.volume_size")),
            ("tags", Expr("local.tags")),
        ]
        if create_fsx:
            cluster_args += [("data_bucket_name", Expr("var.data_bucket_name")),
                             ("data_s3_prefix", Expr("var.data_s3_prefix")),
                             ("fsx_storage_capacity_gib", Expr("var.fsx_storage_capacity_gib")),
                             ("fsx_throughput_per_tib", Expr("var.fsx_throughput_per_tib"))]
        out.append("\n" + _comment("The cluster: its role may read the S3 channels and write output_path and the "
                                   "checkpoints.") + _block('module "cluster"', cluster_args))
        template_id, efa_expr = Expr("module.cluster.launch_template_id"), Expr("module.cluster.efa_interfaces")
    else:
        template_id, efa_expr = existing["launch_template_id"], Expr("local.efa_interfaces")
    job_args: list[tuple[str, Any]] = [
        ("source", "./modules/job"),
        ("job_name", Expr("local.job_name")),
        ("instance_type", Expr("local.instance_type")),
        ("instance_count", Expr("local.instance_count")),
        ("launch_template_id", template_id),
        ("efa_interfaces", efa_expr),
        ("use_spot", Expr("local.use_spot")),
        ("user_data", Expr(f'templatefile("${{path.module}}/{TEMPLATE}", {{ fsx = local.fsx }})')),
        ("state_s3_uri", Expr("local.state_s3_uri")),
        ("spec_json", Expr('file("${path.module}/spec.json")')),
        ("tags", Expr("local.tags")),
    ]
    if has_code:
        job_args += [("code_archive_path", Expr(f'"${{path.module}}/{CODE_ARCHIVE}"')),
                     ("code_s3_uri", Expr("local.code_uri"))]
    out.append("\n" + _block('module "job"', job_args))
    return "".join(out)


def _under(uri: str, prefix: str) -> bool:
    return uri == prefix or uri.startswith(prefix.rstrip("/") + "/")


def _variable(name: str, description: str, type_: str, default: Any = ..., validation: tuple[str, str] | None = None,
              ) -> str:
    pairs: list[tuple[str, Any]] = [("description", description), ("type", Expr(type_))]
    if default is not ...:
        pairs.append(("default", default))
    text = _block(f'variable "{name}"', pairs)
    if validation:
        text = text[:-2] + "\n" + _block("validation", [("condition", Expr(validation[0])),
                                                        ("error_message", validation[1])], 1) + "}\n"
    return text


def _variables_tf(spec: JobSpec, existing: dict | None, create_fsx: bool, external: list[str], name: str) -> str:
    out = [_variable("region", "AWS region of the job (the user data names it too: render again to change it).",
                     "string")]
    if existing is None:
        ecr = _ecr_repository_arn(spec.image_uri or "") is not None
        out += [
            _variable("availability_zone_id", "Zone ID of the cluster (use1-az6): one that offers the instance type "
                      "(aws ec2 describe-instance-type-offerings --location-type availability-zone-id).", "string"),
            _variable("cluster_name", "Name of the job's cluster (prefix of its resources' names).", "string", name),
            _variable("enable_nat_gateway", "A NAT gateway for the instances: needed when the image is not in ECR "
                      "(the VPC endpoints cover ECR, S3, CloudWatch Logs and EC2), or with network={\"internet\": "
                      "true}.", "bool", not ecr or bool(spec.network and spec.network.internet)),
            _variable("create_log_group", "Create the /trainyard/jobs log group. Off: the node agents create it "
                      "when it is missing (as with the EC2 backend), so that several jobs' clusters coexist.",
                      "bool", False),
        ]
        if create_fsx:
            out += [
                _variable("data_bucket_name", "S3 bucket linked to the cluster's FSx file system (its /data folder).",
                          "string"),
                _variable("data_s3_prefix", "Prefix in data_bucket_name linked to /data (empty: the whole bucket).",
                          "string", ""),
                _variable("fsx_storage_capacity_gib", "FSx for Lustre storage in GiB (1200, 2400 or a multiple of "
                          "2400).", "number", 1200),
                _variable("fsx_throughput_per_tib", "FSx for Lustre throughput in MB/s per TiB (125, 250, 500, 1000).",
                          "number", 250),
            ]
    if external:
        ids = ", ".join(_string(i) for i in external)
        out.append(_variable(
            "fsx_file_systems", "DNS and mount names of the FSx for Lustre file systems the channels read, by file "
            "system id (aws fsx describe-file-systems: DNSName, LustreConfiguration.MountName).",
            "map(object({ dns_name = string, mount_name = string }))",
            validation=(f"alltrue([for id in [{ids}] : contains(keys(var.fsx_file_systems), id)])",
                        f"fsx_file_systems needs an entry for each of {', '.join(external)}.")))
    return "\n".join(out)


def _tfvars(region: str, zone: str | None, data_s3_uri: str | None, existing: dict | None, external: list[str],
            given: list[dict]) -> str:
    pairs: list[tuple[str, Any]] = [("region", region)]
    if existing is None and zone:
        pairs.append(("availability_zone_id", zone))
    if existing is None and data_s3_uri:
        bucket, prefix = split_s3(data_s3_uri)
        pairs += [("data_bucket_name", bucket), ("data_s3_prefix", prefix.strip("/"))]
    known = {m["file_system_id"]: {"dns_name": m["dns_name"], "mount_name": m["mount_name"]}
             for m in given if m.get("file_system_id") in external}
    if known:
        pairs.append(("fsx_file_systems", known))
    text = "\n".join(_attributes(pairs, 0)) + "\n"
    if existing is None and not zone:
        text += "# availability_zone_id = \"use1-az6\" # required: a zone ID that offers the instance type\n"
    return text


def _outputs_tf(existing: dict | None) -> str:
    outputs = [
        ("job_name", "The job's name (the trainyard:job tag).", "local.job_name"),
        ("instance_type", "EC2 instance type of the job.", "local.instance_type"),
        ("instance_count", "Number of instances.", "local.instance_count"),
        ("efa_interfaces", "EFA interfaces per instance.", "local.efa_interfaces"),
        ("image_uri", "The training image.", "local.image_uri"),
        ("hyperparameters", "The job's hyperparameters (as in spec.json).", "local.hyperparameters"),
        ("channels", "The job's input channels: URI and distribution.", "local.channels"),
        ("state_s3_uri", "spec.json and the hosts' status objects (hosts/algo-N/status.json).", "local.state_s3_uri"),
        ("instance_ids", "Instance IDs by host index (algo-1 first).", "module.job.instance_ids"),
        ("hosts", "Host name (algo-N) to instance ID.", "module.job.hosts"),
    ]
    if existing is None:
        outputs += [
            ("checkpoint_bucket_name", "The cluster's checkpoint bucket.", "module.cluster.checkpoint_bucket_name"),
            ("ecr_repository_url", "The cluster's ECR repository.", "module.cluster.ecr_repository_url"),
            ("fsx_file_system_id", "The cluster's FSx file system (null without one).",
             "module.cluster.fsx_file_system_id"),
        ]
    return "\n".join(_block(f'output "{n}"', [("description", d), ("value", Expr(v))]) for n, d, v in outputs)
