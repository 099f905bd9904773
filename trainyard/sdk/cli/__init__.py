"""`trainyard`: the command line for jobs (local, EC2, SageMaker, Kubernetes), their metrics, the embedded store,
images, checkpoints, Terraform and Kubernetes manifests. `trainyard --help` lists the commands; `trainyard COMMAND
--help` shows one, with examples. The job commands are in jobs.py, the store's in store.py, the planner's in
plan.py; tables and durations in sdk/jobs/format.py.

Exit status: 0 done, 1 the job failed or something was refused or left behind, 2 bad input (a
ConfigError: a missing job, bucket or key, a malformed URI or duration, no AWS region or credentials).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from trainyard.engine.components.export import export_checkpoint
from trainyard.engine.quiet import quiet
from trainyard.errors import ConfigError, ImageError
from trainyard.sdk import image
from trainyard.sdk.cli import jobs as cli_jobs
from trainyard.sdk.cli import catalog as cli_catalog
from trainyard.sdk.cli import plan as cli_plan
from trainyard.sdk.cli import store as cli_store
from trainyard.sdk.backends.terraform import render as terraform
from trainyard.sdk.backends.ec2.backend import gc
from trainyard.sdk.backends.aws.session import aws_config_error, check_session, new_session
from trainyard.sdk.backends import open_job
from trainyard.sdk.jobs.format import parse_duration
from trainyard.sdk.estimator import Estimator
from trainyard.sdk.inputs import FileSystemInput, TrainingInput
from trainyard.sdk.backends.kubernetes import manifests as k8s_manifests
from trainyard.sdk.store import ensure_store

EXAMPLE_JOB = "train-20260101-120000-000"


def _command(sub, name: str, summary: str, examples: str, description: str = "") -> argparse.ArgumentParser:
    """A subcommand: `summary` is its line in the parent's help; `examples` (shell lines) its epilog."""
    text = f"{summary[0].upper()}{summary[1:]}.\n\n{description}".strip()
    return sub.add_parser(name, help=summary, description=text,
                          epilog="examples:\n" + "\n".join(f"  {line}" for line in examples.strip().splitlines()),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _duration(text: str) -> tuple[float, str]:
    """(seconds, the text as given) of --older-than."""
    try:
        return parse_duration(text), text
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1, e.g. 20")
    return int(text)


def _job_arguments(p: argparse.ArgumentParser, fsx_note: str = "") -> None:
    """--inputs and --job-name of the `render` commands: what fit(inputs, job_name=...) takes."""
    p.add_argument("--inputs", default=None, help="fit()'s inputs as JSON (a file, or inline): a URI, or channel "
                   "name to a URI, {\"s3_data\": ..., \"distribution\": ...} or {\"file_system_id\": ..., "
                   f"\"directory_path\": ...}}{fsx_note}")
    p.add_argument("--job-name", default=None, help="default: base_job_name and the time")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainyard", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Trainyard: jobs (local and EC2), their metrics, the embedded object store, images, "
                    "checkpoints, Terraform.",
        epilog="examples:\n  trainyard jobs\n  trainyard logs JOB -f\n  trainyard store ls\n\n"
               "`trainyard COMMAND --help` shows a command's arguments and examples.")
    p.add_argument("--verbose", action="store_true",
                   help="show every warning, also torch's notes that say nothing about the job "
                        "(trainyard/engine/quiet.py lists them; TRAINYARD_VERBOSE=1 does the same)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    _command(sub, "jobs", "list the jobs started from this machine, newest first",
             "trainyard jobs\ntrainyard jobs | grep InProgress",
             "Columns: name, status, hosts, started, duration, last step/loss (the newest `step` and `loss` of the\n"
             "job's metrics, else its newest metric). Jobs are the folders under $TRAINYARD_HOME/jobs\n"
             "(default ~/.trainyard/jobs). Piped, the table is plain text without box lines.")
    _command(sub, "describe", "a job's description (DescribeTrainingJob) as JSON",
             f"trainyard describe {EXAMPLE_JOB}\ntrainyard describe {EXAMPLE_JOB} | grep FailureReason").add_argument(
        "job", metavar="JOB", help="the job's name (`trainyard jobs` lists them)")
    lg = _command(sub, "logs", "a job's log: what it printed so far, or (-f) until it ends",
                  f"trainyard logs {EXAMPLE_JOB}\ntrainyard logs {EXAMPLE_JOB} -f",
                  "With -f, exits 1 when the job failed; Ctrl-C stops following, not the job.")
    lg.add_argument("job", metavar="JOB", help="the job's name")
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    mt = _command(sub, "metrics", "a job's metrics: one row per step or matched log line",
                  f"trainyard metrics {EXAMPLE_JOB}\ntrainyard metrics {EXAMPLE_JOB} --json | tail -n 1",
                  "The rows the script appended to $SM_OUTPUT_DATA_DIR/metrics.jsonl (the built-in trainer\n"
                  "writes one per step), then one per log line the Estimator's metric_definitions matched.")
    mt.add_argument("job", metavar="JOB", help="the job's name")
    mt.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    mt.add_argument("--tail", type=_positive, default=None, metavar="N", help="only the last N rows")
    rp = _command(sub, "report", "write a job's report: one HTML file of plots, no network needed",
                  f"trainyard report {EXAMPLE_JOB}\ntrainyard report {EXAMPLE_JOB} -o run-1.html",
                  "Loss, lr, gradient norm, tokens/s and MFU, the step's compute/communication split, bytes per mesh\n"
                  "dimension intra/inter-host, memory, checkpoints, the startup timeline per host, the fingerprint\n"
                  "and the cost, each drawn from the data the job has. plotly.js is inlined: the file opens without\n"
                  "a network. Needs plotly: pip install 'trainyard[report]'.")
    rp.add_argument("job", metavar="JOB", help="the job's name")
    rp.add_argument("-o", "--output", default=None, metavar="FILE",
                    help="where to write it (default: JOB-report.html in the current folder)")
    _command(sub, "stop", "stop a running job: every process of it ends",
             f"trainyard stop {EXAMPLE_JOB}").add_argument("job", metavar="JOB", help="the job's name")
    cli_plan.add_parser(sub, _command)
    cli_catalog.add_parser(sub, _command)
    rm = _command(sub, "rm", "delete the folders of ended jobs",
                  f"trainyard rm {EXAMPLE_JOB}\ntrainyard rm --force {EXAMPLE_JOB}",
                  "Deletes $TRAINYARD_HOME/jobs/JOB (spec, status, logs, hosts' files); artifacts in object storage\n"
                  "stay. A running job is refused: `trainyard stop` it first, or pass --force.")
    rm.add_argument("jobs", nargs="+", metavar="JOB", help="job names")
    rm.add_argument("--force", action="store_true", help="stop a running job, then delete it (and delete a "
                                                         "folder whose status cannot be read)")
    pr = _command(sub, "prune", "delete the folders of jobs that ended longer ago than a duration",
                  "trainyard prune --older-than 7d --dry-run\ntrainyard prune --older-than 12h",
                  "Running jobs and folders that cannot be read are kept.")
    pr.add_argument("--older-than", type=_duration, required=True, metavar="DURATION",
                    help="a number and a unit (s, m, h, d, w): 30m, 12h, 7d, or a sum such as 1d12h")
    pr.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")

    st = _command(sub, "store", "the object store of local jobs: address, objects, credentials",
                  "trainyard store\ntrainyard store ls\ntrainyard store --stop",
                  "Without a subcommand: prints the store's address (AWS_ENDPOINT_URL when set, else the\n"
                  "embedded store's, started if needed). URIs name a folder (s3://b/data is data/...) or one object.")
    st.usage = "trainyard store [--stop]\n       trainyard store {ls,put,get,rm,creds} ..."
    st.add_argument("--stop", action="store_true", help="stop the embedded store (its objects stay on disk)")
    st_sub = st.add_subparsers(dest="store_cmd", metavar="SUBCOMMAND", title="subcommands")
    sl = _command(st_sub, "ls", "the buckets, or the objects under s3://bucket[/prefix]",
                  "trainyard store ls\ntrainyard store ls s3://trainyard-default\n"
                  "trainyard store ls s3://my-data/train")
    sl.add_argument("uri", nargs="?", metavar="S3_URI", help="s3://bucket[/prefix]; without it: the buckets")
    sp = _command(st_sub, "put", "upload a file, or a folder recursively",
                  "trainyard store put data.csv s3://my-data/train/\ntrainyard store put ./dataset s3://my-data/train",
                  "A file goes to the key S3_URI (into it when it ends with / or names only the bucket); a folder's\n"
                  "files go under the prefix S3_URI. The embedded store creates a missing bucket.")
    sp.add_argument("local", metavar="LOCAL", help="a file or a folder")
    sp.add_argument("uri", metavar="S3_URI", help="s3://bucket/key or s3://bucket/prefix")
    sg = _command(st_sub, "get", "download an object, or every object under a prefix",
                  "trainyard store get s3://my-data/train/data.csv .\ntrainyard store get s3://my-data/train ./train")
    sg.add_argument("uri", metavar="S3_URI", help="s3://bucket/key or s3://bucket/prefix")
    sg.add_argument("local", metavar="LOCAL", help="a file or folder for an object; a folder for a prefix")
    sr = _command(st_sub, "rm", "delete an object (--recursive: a prefix, or a bucket with its objects)",
                  "trainyard store rm s3://my-data/train/data.csv\ntrainyard store rm --recursive s3://my-data/train")
    sr.add_argument("uri", metavar="S3_URI", help="s3://bucket/key, s3://bucket/prefix, s3://bucket")
    sr.add_argument("--recursive", "-r", action="store_true", help="every object under the prefix")
    sc = _command(st_sub, "creds", "shell variables that point boto3, the AWS CLI and s3fs at the embedded store",
                  'eval "$(trainyard store creds)"\ntrainyard store creds --json',
                  "Prints export lines of AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and\n"
                  "AWS_DEFAULT_REGION. The credentials reach only the embedded store, never AWS.")
    sc.add_argument("--json", action="store_true", help="one JSON object instead of export lines")

    ck = _command(sub, "checkpoint", "checkpoints written by the built-in trainer",
                  "trainyard checkpoint export s3://my-bucket/ckpt ./model")
    ck_sub = ck.add_subparsers(dest="ck_cmd", required=True, metavar="SUBCOMMAND", title="subcommands")
    ex = _command(ck_sub, "export", "one safetensors file from a sharded checkpoint",
                  "trainyard checkpoint export s3://my-bucket/ckpt ./model\n"
                  "trainyard checkpoint export s3://my-bucket/ckpt/step-00000100 ./model-100",
                  "Writes OUT/model.safetensors and OUT/config.json from the newest verified step (or the given one).")
    ex.add_argument("uri", help="s3://bucket/prefix or a path: a checkpoint location or a step-NNNNNNNN prefix")
    ex.add_argument("out", help="folder for model.safetensors and config.json")
    g = _command(sub, "gc", "delete EC2 resources that ended jobs left behind",
                 "trainyard gc --region us-east-1\ntrainyard gc --include-running",
                 "Finds instances, launch templates, placement groups, security groups, subnets and instance\n"
                 "profiles tagged trainyard:job. Needs a region and AWS credentials.")
    g.add_argument("--include-running", action="store_true",
                   help="also jobs with running instances that no controller on this machine follows")
    g.add_argument("--region", default=None, help="default: AWS_REGION, then AWS_DEFAULT_REGION, then the profile's")
    im = _command(sub, "image", "the training image: build it, push it to ECR",
                  "trainyard image build\ntrainyard image push --region us-east-1")
    im_sub = im.add_subparsers(dest="image_cmd", required=True, metavar="SUBCOMMAND", title="subcommands")
    ib = _command(im_sub, "build", "build the image of a Trainyard checkout (skipped when built already)",
                  "trainyard image build\ntrainyard image build --variant cpu\n"
                  "trainyard image build --context ~/src/trainyard --repository my-trainyard",
                  "The tag comes from the content (trainyard:0.1.0-3f2a9c1b7d4e); needs docker, podman or buildah. "
                  "--variant cpu builds the CPU image on a Debian base (mmdebstrap; podman or buildah preferred), "
                  "for local jobs (image_uri) and tests; the last line printed is the image's reference.")
    ib.add_argument("--variant", choices=image.VARIANTS, default="gpu",
                    help="gpu (CUDA and EFA: the cloud backends' image, default) or cpu (a Debian base)")
    ipu = _command(im_sub, "push", "build if needed, then push to ECR (skipped when ECR has the tag)",
                   "trainyard image push --region us-east-1\n"
                   "trainyard image push --registry 123456789012.dkr.ecr.us-east-1.amazonaws.com/trainyard",
                   "Needs AWS credentials for ECR, and a region unless --registry names the ECR registry.")
    for q in (ib, ipu):
        q.add_argument("--context", default=".", help="the Trainyard repository root, the build context (default: .)")
        q.add_argument("--repository", default="trainyard", help="image repository name (default: trainyard)")
    ipu.add_argument("--registry", default=None,
                     help="<account>.dkr.ecr.<region>.amazonaws.com/<repository> (default: ECR of the AWS "
                          "configuration's account and region, repository --repository)")
    ipu.add_argument("--region", default=None, help="default: AWS_REGION, then AWS_DEFAULT_REGION, then the profile's")
    rd = _command(sub, "render", "render a job for another tool (Terraform, Kubernetes)",
                  "trainyard render terraform estimator.json tf/run-1 --region us-east-1\n"
                  "trainyard render kubernetes estimator.json k8s/run-1")
    rd_sub = rd.add_subparsers(dest="render_cmd", required=True, metavar="SUBCOMMAND", title="subcommands")
    rt = _command(rd_sub, "terraform", "a Terraform root module (infra/modules) of the job an Estimator runs",
                  "trainyard render terraform estimator.json tf/run-1 --region us-east-1 "
                  "--inputs '{\"train\": \"s3://my-data/tokens\"}'\n"
                  "trainyard render terraform '{\"entry_point\": \"train.py\", \"instance_type\": \"ml.p4d.24xlarge\", "
                  "\"output_path\": \"s3://b/out\"}' tf/run-2 --cluster-outputs cluster.json",
                  "See docs/terraform.md for the module and the variables.")
    rt.add_argument("estimator", help="Estimator arguments as JSON (a file, or inline): entry_point, instance_type, "
                                      "image_uri, output_path, hyperparameters, ...")
    rt.add_argument("out", help="folder for the root module (created; files in it are overwritten)")
    _job_arguments(rt, " (\"cluster\": the new cluster's file system)")
    rt.add_argument("--region", default=None, help="default: AWS_REGION, then AWS_DEFAULT_REGION")
    rt.add_argument("--availability-zone-id", default=None, help="zone ID of the new cluster (use1-az6); "
                                                                 "without it terraform asks")
    rt.add_argument("--cluster-outputs", default=None, help="`terraform output -json` of an existing "
                                                            "infra/modules/cluster (a file): no cluster is created")
    rt.add_argument("--data-s3-uri", default=None, help="S3 prefix linked to the new cluster's FSx file system (/data)")
    rt.add_argument("--fsx-mount", action="append", default=None, metavar="FS_ID=DNS:MOUNT",
                    help="DNS and mount names of another FSx file system a channel reads (repeatable)")
    rk = _command(rd_sub, "kubernetes", "a Kubeflow PyTorchJob (and its ConfigMap, FSx volumes) of the job an "
                                        "Estimator runs",
                  "trainyard render kubernetes estimator.json k8s/run-1 "
                  "--inputs '{\"train\": \"s3://my-data/tokens\"}'\n"
                  "trainyard render kubernetes '{\"entry_point\": \"trainyard.engine.train\", \"instance_type\": "
                  "\"ml.p5.48xlarge\", \"image_uri\": \"IMAGE\", \"output_path\": \"s3://b/out\", \"kubernetes\": "
                  "{\"namespace\": \"training\"}}' k8s/run-2",
                  "Writes OUT/pytorchjob.yaml for `kubectl apply -f` (and OUT/sourcedir.tar.gz, the code to upload\n"
                  "first). The Estimator's \"kubernetes\" argument holds the namespace, service account, FSx\n"
                  "volumes, ... See docs/backends.md and docs/sdk.md.")
    rk.add_argument("estimator", help="Estimator arguments as JSON (a file, or inline): entry_point, instance_type, "
                                      "image_uri, output_path, kubernetes, hyperparameters, ...")
    rk.add_argument("out", help="folder for pytorchjob.yaml (created; files in it are overwritten)")
    _job_arguments(rk)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    quiet(show_all=a.verbose or None)  # torch's harmless notes (e.g. checkpoint export's), listed in engine/quiet.py
    try:
        return _run(a)
    except ConfigError as e:
        print(f"trainyard: {e}", file=sys.stderr)
        return 2
    except ImageError as e:
        print(f"trainyard: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"trainyard: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trainyard plan ... | head`: the reader left; nothing to say, nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1
    except OSError as e:  # a job folder that cannot be read, a file that cannot be written
        print(f"trainyard: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("trainyard: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # botocore's "no region" / "no credentials" past the first checks: one line
        err = aws_config_error(e) if a.cmd in ("gc", "image") else None
        if err is None:
            raise
        print(f"trainyard: {err}", file=sys.stderr)
        return 2


def _run(a) -> int:
    if a.cmd == "jobs":
        return cli_jobs.show_jobs()
    if a.cmd == "describe":
        print(json.dumps(open_job(a.job).describe(), indent=1, default=str))
    elif a.cmd == "logs":
        return _logs(a.job, a.follow)
    elif a.cmd == "metrics":
        return cli_jobs.show_metrics(a.job, a.json, a.tail)
    elif a.cmd == "report":
        return cli_jobs.write_job_report(a.job, a.output)
    elif a.cmd == "stop":
        open_job(a.job).stop()
        print(f"{a.job}: {open_job(a.job).status()}")
    elif a.cmd == "rm":
        return cli_jobs.remove(a.jobs, force=a.force)
    elif a.cmd == "prune":
        return cli_jobs.prune(*a.older_than, dry_run=a.dry_run)
    elif a.cmd == "store":
        return cli_store.store_command(a)
    elif a.cmd == "plan":
        return cli_plan.show_plan(a)
    elif a.cmd == "catalog":
        return cli_catalog.show(a.filter, a.json)
    elif a.cmd == "gc":
        session = new_session(a.region)
        check_session(session)
        left = gc(session, include_running=a.include_running)
        for job, items in left.items():
            for item in items:
                print(f"{job}: left behind: {item}", file=sys.stderr)
        return 1 if any(left.values()) else 0
    elif a.cmd == "render":
        for path in (render_terraform(a) if a.render_cmd == "terraform" else render_kubernetes(a)):
            print(path)
    elif a.cmd == "image":
        if a.image_cmd == "build":
            print(image.build(a.context, a.repository, variant=a.variant))
        else:
            print(image.publish(a.context, a.repository, registry_uri=a.registry, session=_push_session(a)))
    elif a.cmd == "checkpoint":
        if a.uri.startswith("s3://") and not os.environ.get("AWS_ENDPOINT_URL"):
            os.environ.update(ensure_store().env())  # as local jobs do: s3:// is the embedded store
        config = export_checkpoint(a.uri, a.out)
        print(f"step {config['step']} ({config['parameters'] / 1e6:.2f}M parameters) from {config['source']} "
              f"written to {a.out}/model.safetensors")
    return 0


def _logs(name: str, follow: bool) -> int:
    """`trainyard logs JOB [-f]`: with -f, 1 when the job did not complete. Ctrl-C leaves the job running."""
    job = open_job(name)
    if not follow:
        print(job.log_text())
        return 0
    try:
        job.logs(wait=True)
    except KeyboardInterrupt:
        print(f"trainyard: stopped following {name}; it keeps running (`trainyard stop {name}` stops it)",
              file=sys.stderr)
        return 130
    d = job.describe()
    return 1 if d["TrainingJobStatus"] == "Failed" or d["SecondaryStatus"] == "MaxRuntimeExceeded" else 0


def _push_session(a):
    """The boto3 session of `image push`, checked: ECR needs credentials, and a region unless --registry
    names the registry; a registry that is not ECR needs neither."""
    if a.registry is not None and image.ecr_host(a.registry.rstrip("/")) is None:
        return None
    session = new_session(a.region)
    check_session(session, need_region=a.registry is None)
    return session


def render_terraform(args) -> list[str]:
    """`trainyard render terraform ESTIMATOR.json OUT [...]` (an argparse Namespace: estimator, out, inputs,
    job_name, region, availability_zone_id, cluster_outputs, data_s3_uri, fsx_mount). ESTIMATOR.json holds
    Estimator's keyword arguments (SageMaker's names); --inputs is fit()'s inputs as JSON: a URI, or channel
    name to a URI, {"s3_data": ..., "distribution": ...} or {"file_system_id": ..., "directory_path": ...}
    ("cluster" for the cluster module's file system). Returns the files written."""
    est, inputs = _render_job(args, cluster_fsx=terraform.CLUSTER_FSX)
    cluster = _read_json("cluster_outputs", args.cluster_outputs) if args.cluster_outputs else None
    mounts = []
    for spec in args.fsx_mount or []:
        m = re.match(r"^(fs-[0-9a-f]{8,17})=([^:]+):([A-Za-z0-9_-]{1,8})$", spec)
        if not m:
            raise ConfigError("fsx_mount", f"{spec!r}: expected FS_ID=DNS_NAME:MOUNT_NAME")
        mounts.append({"file_system_id": m.group(1), "dns_name": m.group(2), "mount_name": m.group(3)})
    return est.to_terraform(args.out, inputs, job_name=args.job_name, region=args.region,
                            availability_zone_id=args.availability_zone_id, cluster=cluster,
                            data_s3_uri=args.data_s3_uri, fsx_mounts=mounts or None)


def render_kubernetes(args) -> list[str]:
    """`trainyard render kubernetes ESTIMATOR.json OUT [--inputs JSON] [--job-name NAME]`: the arguments as for
    `render terraform`; writes OUT/pytorchjob.yaml (and OUT/sourcedir.tar.gz when there is code to ship).
    Returns the files written."""
    est, inputs = _render_job(args)
    est.to_kubernetes(args.out, inputs, job_name=args.job_name)
    return [p for p in (os.path.join(args.out, k8s_manifests.MANIFEST_FILE),
                        os.path.join(args.out, k8s_manifests.CODE_ARCHIVE)) if os.path.exists(p)]


def _render_job(args, cluster_fsx: str | None = None) -> tuple[Estimator, Any]:
    """The Estimator of `args.estimator` and fit()'s inputs of `args.inputs` (see render_terraform); an FSx input
    on file system "cluster" means `cluster_fsx` (Terraform's cluster module's file system)."""
    kwargs = _read_json("estimator", args.estimator)
    if not isinstance(kwargs, dict):
        raise ConfigError("estimator", f"{args.estimator}: expected a JSON object of Estimator arguments")
    inputs = None
    if args.inputs:
        raw = _read_json("inputs", args.inputs)

        def channel(value: Any):
            if isinstance(value, dict) and "file_system_id" in value:
                fs = value["file_system_id"]
                return FileSystemInput(**{**value, "file_system_id": cluster_fsx if fs == "cluster" and cluster_fsx
                                          else fs})
            if isinstance(value, dict):
                return TrainingInput(**value)
            return value

        inputs = {k: channel(v) for k, v in raw.items()} if isinstance(raw, dict) else raw
    try:
        return Estimator(**kwargs), inputs
    except TypeError as e:
        raise ConfigError("estimator", f"{args.estimator}: {e}") from None


def _read_json(field: str, value: str) -> Any:
    """A JSON file, or JSON given inline."""
    try:
        if os.path.isfile(value):
            with open(value) as fh:
                return json.load(fh)
        return json.loads(value)
    except ValueError as e:
        raise ConfigError(field, f"{value!r} is neither a JSON file nor JSON: {e}") from None
