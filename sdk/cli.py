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
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainyard", description="Trainyard local jobs and embedded store")
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
    a = p.parse_args(argv)

    from trainyard.sdk.errors import ConfigError, JobFailedError
    from trainyard.sdk.local import open_job as LocalJob

    try:
        if a.cmd == "jobs":
            from trainyard.sdk.jobstate import jobs_root

            root = jobs_root()
            names = sorted(os.listdir(root), key=lambda n: os.path.getmtime(os.path.join(root, n)), reverse=True) \
                if os.path.isdir(root) else []
            for n in names:
                try:
                    print(f"{n}\t{LocalJob(n).status()}")
                except (OSError, ValueError):
                    print(f"{n}\t(unreadable)")
        elif a.cmd == "describe":
            print(json.dumps(LocalJob(a.job).describe(), indent=1, default=str))
        elif a.cmd == "logs":
            job = LocalJob(a.job)
            if a.follow:
                try:
                    job.wait(logs=True)
                except JobFailedError:
                    return 1
            else:
                print(job.logs())
        elif a.cmd == "stop":
            LocalJob(a.job).stop()
            print(f"{a.job}: {LocalJob(a.job).status()}")
        elif a.cmd == "store":
            from trainyard.sdk.store import ensure_store, stop_store, store_root

            if a.stop:
                print("stopped" if stop_store() else "not running")
            else:
                ep = ensure_store()
                print(f"{ep.url}\t{'embedded, objects under ' + store_root() if ep.embedded else 'AWS_ENDPOINT_URL'}")
        elif a.cmd == "gc":
            import boto3

            from trainyard.sdk.aws.backend import gc

            left = gc(boto3.Session(region_name=a.region), include_running=a.include_running)
            for job, items in left.items():
                for item in items:
                    print(f"{job}: left behind: {item}", file=sys.stderr)
            return 1 if any(left.values()) else 0
        elif a.cmd == "checkpoint":
            from trainyard.engine.export import export_checkpoint

            if a.uri.startswith("s3://") and not os.environ.get("AWS_ENDPOINT_URL"):
                from trainyard.sdk.store import ensure_store  # as local jobs do: s3:// is the embedded store

                os.environ.update(ensure_store().env())
            config = export_checkpoint(a.uri, a.out)
            print(f"step {config['step']} ({config['parameters'] / 1e6:.2f}M parameters) from {config['source']} "
                  f"written to {a.out}/model.safetensors")
    except ConfigError as e:
        print(f"trainyard: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"trainyard: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
