"""`trainyard`: the command line for jobs (local and EC2) and the embedded store.

    trainyard jobs                  list jobs started from this machine, newest first
    trainyard describe JOB          the job's description as JSON
    trainyard logs JOB [--follow]   the job's logs
    trainyard stop JOB              stop a job (every process of it ends)
    trainyard store [--stop]        the embedded object store's address (or stop it)
    trainyard checkpoint export URI OUT
                                    consolidate a sharded checkpoint (a location or one step's prefix)
                                    into OUT/model.safetensors + OUT/config.json
    trainyard gc [--include-running] [--region R]
                                    delete the EC2 resources (tagged trainyard:job) that ended jobs left
    trainyard image build [--context .] [--repository trainyard]
                                    build the training image (tag from its content; skipped when built)
    trainyard image push [--context .] [--repository trainyard] [--registry URI] [--region R]
                                    build if needed and push to ECR (nothing when ECR has the tag)
    trainyard render terraform ESTIMATOR_JSON OUT [--inputs JSON] [--job-name N] [--region R] ...
                                    write the Terraform root module of the job an Estimator would run
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from trainyard.engine.components.export import export_checkpoint
from trainyard.job.errors import ConfigError, ImageError, JobFailedError
from trainyard.sdk import image, terraform
from trainyard.sdk.aws.backend import gc
from trainyard.sdk.backends import open_job
from trainyard.sdk.estimator import Estimator
from trainyard.sdk.inputs import FileSystemInput, TrainingInput
from trainyard.sdk.jobstate import jobs_root
from trainyard.sdk.store import ensure_store, stop_store, store_root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainyard", description="Trainyard: jobs (local and EC2), images, checkpoints, the embedded store")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("jobs", help="list local jobs")
    for name in ("describe", "stop"):
        sub.add_parser(name).add_argument("job")
    lg = sub.add_parser("logs")
    lg.add_argument("job")
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    st = sub.add_parser("store", help="the embedded object store")
    st.add_argument("--stop", action="store_true", help="stop it (its objects stay on disk)")
    ck = sub.add_parser("checkpoint", help="checkpoints written by the built-in trainer")
    ck_sub = ck.add_subparsers(dest="ck_cmd", required=True)
    ex = ck_sub.add_parser("export", help="one safetensors file from a sharded checkpoint")
    ex.add_argument("uri", help="s3://bucket/prefix or a path: a checkpoint location or a step-NNNNNNNN prefix")
    ex.add_argument("out", help="folder for model.safetensors and config.json")
    g = sub.add_parser("gc", help="delete EC2 resources that ended jobs left behind")
    g.add_argument("--include-running", action="store_true",
                   help="also jobs with running instances that no controller on this machine follows")
    g.add_argument("--region", default=None, help="default: the AWS configuration's region")
    im = sub.add_parser("image", help="the training image: build it, push it to ECR")
    im_sub = im.add_subparsers(dest="image_cmd", required=True)
    ib = im_sub.add_parser("build", help="build the image of a Trainyard checkout (skipped when built already)")
    ipu = im_sub.add_parser("push", help="build if needed, then push to ECR (skipped when ECR has the tag)")
    for q in (ib, ipu):
        q.add_argument("--context", default=".", help="the Trainyard repository root, the build context (default: .)")
        q.add_argument("--repository", default="trainyard", help="image repository name (default: trainyard)")
    ipu.add_argument("--registry", default=None,
                     help="<account>.dkr.ecr.<region>.amazonaws.com/<repository> (default: ECR of the AWS "
                          "configuration's account and region, repository --repository)")
    ipu.add_argument("--region", default=None, help="default: the AWS configuration's region")
    rd = sub.add_parser("render", help="render a job for another tool")
    rd_sub = rd.add_subparsers(dest="render_cmd", required=True)
    rt = rd_sub.add_parser("terraform", help="a Terraform root module (infra/modules) of the job an Estimator runs")
    rt.add_argument("estimator", help="Estimator arguments as JSON (a file, or inline): entry_point, instance_type, "
                                      "image_uri, output_path, hyperparameters, ...")
    rt.add_argument("out", help="folder for the root module (created; files in it are overwritten)")
    rt.add_argument("--inputs", default=None, help="fit()'s inputs as JSON (a file, or inline): a URI, or channel "
                    "name to a URI, {\"s3_data\": ..., \"distribution\": ...} or {\"file_system_id\": ..., "
                    "\"directory_path\": ...} (\"cluster\": the new cluster's file system)")
    rt.add_argument("--job-name", default=None, help="default: base_job_name and the time")
    rt.add_argument("--region", default=None, help="default: AWS_REGION, then AWS_DEFAULT_REGION")
    rt.add_argument("--availability-zone-id", default=None, help="zone ID of the new cluster (use1-az6); "
                                                                 "without it terraform asks")
    rt.add_argument("--cluster-outputs", default=None, help="`terraform output -json` of an existing "
                                                            "infra/modules/cluster (a file): no cluster is created")
    rt.add_argument("--data-s3-uri", default=None, help="S3 prefix linked to the new cluster's FSx file system (/data)")
    rt.add_argument("--fsx-mount", action="append", default=None, metavar="FS_ID=DNS:MOUNT",
                    help="DNS and mount names of another FSx file system a channel reads (repeatable)")
    a = p.parse_args(argv)

    try:
        if a.cmd == "jobs":
            root = jobs_root()
            names = sorted(os.listdir(root), key=lambda n: os.path.getmtime(os.path.join(root, n)), reverse=True) \
                if os.path.isdir(root) else []
            for n in names:
                try:
                    print(f"{n}\t{open_job(n).status()}")
                except (OSError, ValueError):
                    print(f"{n}\t(unreadable)")
        elif a.cmd == "describe":
            print(json.dumps(open_job(a.job).describe(), indent=1, default=str))
        elif a.cmd == "logs":
            job = open_job(a.job)
            if a.follow:
                try:
                    job.wait(logs=True)
                except JobFailedError:
                    return 1
            else:
                print(job.log_text())
        elif a.cmd == "stop":
            open_job(a.job).stop()
            print(f"{a.job}: {open_job(a.job).status()}")
        elif a.cmd == "store":
            if a.stop:
                print("stopped" if stop_store() else "not running")
            else:
                ep = ensure_store()
                print(f"{ep.url}\t{'embedded, objects under ' + store_root() if ep.embedded else 'AWS_ENDPOINT_URL'}")
        elif a.cmd == "gc":
            import boto3

            left = gc(boto3.Session(region_name=a.region), include_running=a.include_running)
            for job, items in left.items():
                for item in items:
                    print(f"{job}: left behind: {item}", file=sys.stderr)
            return 1 if any(left.values()) else 0
        elif a.cmd == "render":
            for path in render_terraform(a):
                print(path)
        elif a.cmd == "image":
            if a.image_cmd == "build":
                print(image.build(a.context, a.repository))
            else:
                import boto3

                print(image.publish(a.context, a.repository, registry_uri=a.registry,
                                    session=boto3.Session(region_name=a.region)))
        elif a.cmd == "checkpoint":
            if a.uri.startswith("s3://") and not os.environ.get("AWS_ENDPOINT_URL"):
                os.environ.update(ensure_store().env())  # as local jobs do: s3:// is the embedded store
            config = export_checkpoint(a.uri, a.out)
            print(f"step {config['step']} ({config['parameters'] / 1e6:.2f}M parameters) from {config['source']} "
                  f"written to {a.out}/model.safetensors")
    except ConfigError as e:
        print(f"trainyard: {e}", file=sys.stderr)
        return 2
    except ImageError as e:
        print(f"trainyard: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"trainyard: {e}", file=sys.stderr)
        return 2
    return 0


def render_terraform(args) -> list[str]:
    """`trainyard render terraform ESTIMATOR.json OUT [...]` (an argparse Namespace: estimator, out, inputs,
    job_name, region, availability_zone_id, cluster_outputs, data_s3_uri, fsx_mount). ESTIMATOR.json holds
    Estimator's keyword arguments (SageMaker's names); --inputs is fit()'s inputs as JSON: a URI, or channel
    name to a URI, {"s3_data": ..., "distribution": ...} or {"file_system_id": ..., "directory_path": ...}
    ("cluster" for the cluster module's file system). Returns the files written."""
    kwargs = _read_json("estimator", args.estimator)
    if not isinstance(kwargs, dict):
        raise ConfigError("estimator", f"{args.estimator}: expected a JSON object of Estimator arguments")
    inputs = None
    if args.inputs:
        raw = _read_json("inputs", args.inputs)

        def channel(name: str, value: Any):
            if isinstance(value, dict) and "file_system_id" in value:
                fs = value["file_system_id"]
                return FileSystemInput(**{**value, "file_system_id": terraform.CLUSTER_FSX if fs == "cluster" else fs})
            if isinstance(value, dict):
                return TrainingInput(**value)
            return value

        inputs = {k: channel(k, v) for k, v in raw.items()} if isinstance(raw, dict) else raw
    cluster = _read_json("cluster_outputs", args.cluster_outputs) if args.cluster_outputs else None
    mounts = []
    for spec in args.fsx_mount or []:
        m = re.match(r"^(fs-[0-9a-f]{8,17})=([^:]+):([A-Za-z0-9_-]{1,8})$", spec)
        if not m:
            raise ConfigError("fsx_mount", f"{spec!r}: expected FS_ID=DNS_NAME:MOUNT_NAME")
        mounts.append({"file_system_id": m.group(1), "dns_name": m.group(2), "mount_name": m.group(3)})
    try:
        est = Estimator(**kwargs)
    except TypeError as e:
        raise ConfigError("estimator", f"{args.estimator}: {e}") from None
    return est.to_terraform(args.out, inputs, job_name=args.job_name, region=args.region,
                            availability_zone_id=args.availability_zone_id, cluster=cluster,
                            data_s3_uri=args.data_s3_uri, fsx_mounts=mounts or None)


def _read_json(field: str, value: str) -> Any:
    """A JSON file, or JSON given inline."""
    try:
        if os.path.isfile(value):
            with open(value) as fh:
                return json.load(fh)
        return json.loads(value)
    except ValueError as e:
        raise ConfigError(field, f"{value!r} is neither a JSON file nor JSON: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
