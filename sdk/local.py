"""The local backend: every host is a group of processes on this machine, supervised per job.

`launch(spec, endpoint)` creates the job folder (see `jobstate.py`) and starts the detached supervisor;
`LocalJob` reads the folder, so any process can follow, stop or attach to a job by its name.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime

from trainyard.container.contract import hp_json
from trainyard.sdk.errors import ConfigError, JobFailedError
from trainyard.sdk.jobstate import TERMINAL, Status, job_dir, pid_alive, read_json, wait_for, write_json
from trainyard.sdk.spec import JobSpec
from trainyard.sdk.store import Endpoint

STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: JobSpec, endpoint: Endpoint) -> "LocalJob":
    jobdir = job_dir(spec.job_name)
    if os.path.exists(jobdir):
        raise ConfigError("job_name", f"a job named {spec.job_name!r} already exists ({jobdir}); choose another name")
    for sub in ("hosts", "logs", "torchrun"):
        os.makedirs(f"{jobdir}/{sub}")
    with open(f"{jobdir}/spec.json", "w") as fh:
        fh.write(spec.to_json())
    env = dict(endpoint.env())
    if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in spec.environment:
        # all hosts share this machine's cores: one thread per process unless there are cores to spare
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.world_size))
    write_json(f"{jobdir}/runtime.json", {
        "master_port": free_port(), "env": env, "embedded_store": endpoint.embedded, "private_opt_ml": True,
    })
    Status(f"{jobdir}/status.json").transition("Starting", "Launching the supervisor")
    with open(f"{jobdir}/logs/supervisor.log", "ab") as log:
        subprocess.Popen([sys.executable, "-m", "trainyard.sdk.supervisor", jobdir], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    return LocalJob(spec.job_name)


class LogFollower:
    """New complete lines of a job's log files (supervisor first, then algo-1..N), from where it left off."""

    def __init__(self, jobdir: str, hosts: list[str]):
        self.paths = [f"{jobdir}/logs/supervisor.log"] + [f"{jobdir}/logs/{h}.log" for h in hosts]
        self.offsets = dict.fromkeys(self.paths, 0)

    def poll(self) -> list[str]:
        lines = []
        for path in self.paths:
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[path])
                    data = fh.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # only whole lines; the rest waits for its newline
            self.offsets[path] += end
            lines += data[:end].decode(errors="replace").splitlines()
        return lines


class LocalJob:
    """A handle on one local training job: `describe()`, `wait()`, `logs()`, `stop()`, `metrics()`."""

    stop_timeout_s = STOP_TIMEOUT_S

    def __init__(self, job_name: str):
        self.name = job_name
        self.dir = job_dir(job_name)
        if not os.path.isdir(self.dir):
            raise ConfigError("job_name", f"no local job named {job_name!r} under {os.path.dirname(self.dir)}")
        self.spec = JobSpec.from_json(open(f"{self.dir}/spec.json").read())

    def __repr__(self) -> str:
        return f"LocalJob({self.name!r})"

    def _supervisor_pid(self) -> int | None:
        try:
            return read_json(f"{self.dir}/supervisor.json")["pid"]
        except (OSError, ValueError, KeyError):
            return None

    def _status(self) -> dict:
        """The supervisor's status document. Only the supervisor writes it; a supervisor that died
        without a word is reported here (not written), so readers never race the writer."""
        doc = read_json(f"{self.dir}/status.json")
        if doc["TrainingJobStatus"] not in TERMINAL and not self._supervisor_alive():
            doc = read_json(f"{self.dir}/status.json")  # it may have finished between the two looks
            if doc["TrainingJobStatus"] not in TERMINAL:
                doc.update(TrainingJobStatus="Failed", SecondaryStatus="Failed",
                           FailureReason="the job's supervisor process ended unexpectedly; see logs/supervisor.log")
        return doc

    def _supervisor_alive(self) -> bool:
        pid = self._supervisor_pid()
        if pid is not None:
            return pid_alive(pid)
        # not started yet: give it a minute before calling it dead
        return time.time() - os.path.getmtime(f"{self.dir}/status.json") < 60

    def describe(self) -> dict:
        """A SageMaker-shaped description (`DescribeTrainingJob`), times as datetimes."""
        s, spec = self._status(), self.spec
        out = {
            "TrainingJobName": self.name,
            "TrainingJobArn": f"arn:aws:sagemaker:local:000000000000:training-job/{self.name}",
            "TrainingJobStatus": s["TrainingJobStatus"],
            "SecondaryStatus": s["SecondaryStatus"],
            "SecondaryStatusTransitions": [_times(t) for t in s["SecondaryStatusTransitions"]],
            "HyperParameters": {k: hp_json(v) for k, v in spec.hyperparameters.items()},
            "AlgorithmSpecification": {"TrainingInputMode": "File", "EntryPoint": spec.entry_point},
            "RoleArn": spec.role,
            "InputDataConfig": [
                {"ChannelName": c.name, "DataSource": {"S3DataSource": {"S3Uri": c.uri, "S3DataDistributionType": c.distribution}}}
                for c in spec.channels
            ],
            "OutputDataConfig": {"S3OutputPath": spec.output_path},
            "ResourceConfig": {"InstanceType": spec.instance_type, "InstanceCount": spec.instance_count},
            "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_run},
            "Environment": dict(spec.environment),
        }
        if spec.checkpoint_s3_uri:
            out["CheckpointConfig"] = {"S3Uri": spec.checkpoint_s3_uri, "LocalPath": spec.checkpoint_local_path}
        for k in ("FailureReason", "ModelArtifacts"):
            if k in s:
                out[k] = s[k]
        out.update(_times({k: s[k] for k in ("CreationTime", "TrainingStartTime", "TrainingEndTime", "LastModifiedTime") if k in s}))
        return out

    def status(self) -> str:
        return self._status()["TrainingJobStatus"]

    def wait(self, logs: bool = True, poll: float = 0.2) -> dict:
        """Block until the job ends, printing its log lines as they come when `logs`.

        Raises JobFailedError when it Failed or ran past max_run; Ctrl-C stops the job, then re-raises.
        """
        follower = LogFollower(self.dir, self.spec.hosts)
        try:
            while True:
                done = self.status() in TERMINAL
                if logs:
                    for line in follower.poll():
                        print(line, flush=True)
                if done:
                    break
                time.sleep(poll)
        except KeyboardInterrupt:
            print(f"[trainyard] interrupted: stopping {self.name} ...", flush=True)
            self.stop()
            raise
        d = self.describe()
        outcome = "MaxRuntimeExceeded" if d["SecondaryStatus"] == "MaxRuntimeExceeded" else d["TrainingJobStatus"]
        if outcome in ("Failed", "MaxRuntimeExceeded"):
            raise JobFailedError(self.name, outcome, d.get("FailureReason", ""))
        return d

    def logs(self) -> str:
        """Everything the job printed so far: supervisor, then each host (rank-prefixed lines)."""
        return "\n".join(LogFollower(self.dir, self.spec.hosts).poll())

    def stop(self, wait: bool = True) -> None:
        """Ask the job to stop; every process of it ends. With `wait`, returns once it has."""
        if self.status() in TERMINAL:
            return
        open(f"{self.dir}/stop-requested", "w").close()
        pid = self._supervisor_pid()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
        if wait and not wait_for(lambda: self.status() in TERMINAL, self.stop_timeout_s, 0.1):
            raise TimeoutError(f"job {self.name} did not stop within {self.stop_timeout_s:.0f}s; see {self.dir}/logs")

    def metrics(self) -> list[dict]:
        """The per-step metrics the job wrote to `$SM_OUTPUT_DATA_DIR/metrics.jsonl` (rank 0 of algo-1)."""
        path = f"{self.dir}/hosts/{self.spec.hosts[0]}/output/data/metrics.jsonl"
        if not os.path.exists(path):
            return []
        out = []
        with open(path) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written right now
        return out


def open_job(job_name: str) -> LocalJob:
    """The handle of an existing job, local or EC2, by name (from any process)."""
    runtime = f"{job_dir(job_name)}/runtime.json"
    if os.path.exists(runtime) and read_json(runtime).get("backend") == "ec2":
        from trainyard.sdk.aws.backend import Ec2Job

        return Ec2Job(job_name)
    return LocalJob(job_name)


def _times(d: dict) -> dict:
    return {k: (datetime.fromisoformat(v) if k.endswith("Time") and isinstance(v, str) else v) for k, v in d.items()}
