"""The node agent: what runs in the training container on each EC2 instance of a job.

    python -m trainyard.container.node --state-uri s3://.../<job>/trainyard --region us-east-1 --attempt 1 [--root /opt/ml]

Every instance of a job runs the same command (one RunInstances, identical user data); the instance
metadata tells them apart. The agent

1. asks IMDS (v2) for its instance id and launch index, takes its host index (host `algo-<index+1>`) from
   its `trainyard:host-index` tag when it has one (Terraform's instances, each launched alone, all have
   launch index 0), else the launch index, and reports `Starting`;
2. reads the job's spec from `<state_uri>/spec.json` and finds its peers with DescribeInstances (tags
   `trainyard:job`, `trainyard:attempt`); the master is the private address of host index 0;
3. `Downloading`: copies the S3 channels into `<root>/input/data/<channel>` (ShardedByS3Key as the local
   backend shards), links FSx channels to the mounted file system, writes the SageMaker contract files;
4. `Training`: runs the driver (`python -m trainyard.container.driver`) in its own process group, each
   output line to CloudWatch Logs (`/trainyard/jobs`, stream `<job>/algo-N`; container/logship.py) and to
   its own stdout, while a thread watches IMDS for a spot interruption notice (then: `Interrupted`,
   SIGTERM to the driver, whose engine writes an emergency checkpoint, SIGKILL after `INTERRUPT_GRACE_S`);
5. reports `Completed`, `Failed` (with the failure reason) or `Interrupted`, flushes the logs and exits
   with the driver's status.

The status object is rewritten whole at `<state_uri>/hosts/algo-N/status.json` at every phase change:
`{"host", "instance_id", "attempt", "phase", "message", "time", "exit_code", "failure_reason"}`.

Nothing here imports torch; boto3 is imported when first needed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from trainyard.container.logship import CWL_EVENT_BYTES, LogShipper
from trainyard.sdk import storage
from trainyard.sdk.storage import shard
from trainyard.sdk.uris import join, split_fsx, split_s3

PHASES = ("Starting", "Downloading", "Training", "Uploading", "Completed", "Failed", "Interrupted")
FINAL_PHASES = ("Completed", "Failed", "Interrupted")
LOG_GROUP = "/trainyard/jobs"

IMDS_DEFAULT = "http://169.254.169.254"
IMDS_TOKEN_TTL_S = 21600  # the longest an IMDSv2 token may live (6 h); the agent renews it before expiry
IMDS_TIMEOUT_S = 2.0  # IMDS answers in milliseconds; a longer silence means it is not there
IMDS_TRIES = 5  # connection errors are retried (1 s apart): IMDS may lag right after boot
SPOT_POLL_S = 5.0  # AWS's advice for the interruption notice, which comes ~120 s ahead
# SIGTERM -> SIGKILL for the driver after a notice: of the ~120 s warning, 100 s for the emergency
# checkpoint and the artifact upload, the rest for the final status and the log tail
INTERRUPT_GRACE_S = 100.0
STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL when the agent itself is stopped (or max_run passes)
PEER_WAIT_S = 600.0  # RunInstances starts every instance at once; 10 min covers slow "pending" states
PEER_POLL_S = 5.0  # DescribeInstances is throttled per account: poll gently
WAIT_POLL_S = 0.2  # how often the agent checks on the driver, the notice and the clock
READER_JOIN_S = 10.0  # after the driver exits, how long its output pipe may take to drain

# the driver's line that announces the artifact upload on the first host (container/driver.py, _say)
_UPLOAD_LINE = "driver: uploading model and output data"


def host_name(launch_index: int) -> str:
    return f"algo-{launch_index + 1}"


def job_name_from_state_uri(state_uri: str) -> str:
    """`<output_path>/<job>/trainyard` -> `<job>`."""
    _, sep, rest = state_uri.rstrip("/").partition("://")
    parts = rest.split("/")  # [bucket, ..., job, "trainyard"] (file:// URIs: ["", ..., job, "trainyard"])
    if not sep or len(parts) < 3 or parts[-1] != "trainyard" or not parts[-2]:
        raise ValueError(f"state URI {state_uri!r} is not <output_path>/<job>/trainyard")
    return parts[-2]


def status_uri(state_uri: str, host: str) -> str:
    return join(state_uri, "hosts", host, "status.json")


# -- instance metadata ----------------------------------------------------------------------------


class Imds:
    """An IMDSv2 client: a session token (PUT), then GETs that carry it. `get` returns None for 404."""

    def __init__(self, base_url: str | None = None, *, timeout: float = IMDS_TIMEOUT_S, tries: int = IMDS_TRIES):
        self.base = (base_url or os.environ.get("TRAINYARD_IMDS_ENDPOINT") or IMDS_DEFAULT).rstrip("/")
        self.timeout, self.tries = timeout, tries
        self._token: str | None = None
        self._token_expiry = 0.0
        self._lock = threading.Lock()
        # never through an HTTP proxy from the environment: IMDS is link-local
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _request(self, req: urllib.request.Request) -> tuple[int, str]:
        last: Exception | None = None
        for attempt in range(self.tries):
            try:
                with self._opener.open(req, timeout=self.timeout) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode(errors="replace")
            except (urllib.error.URLError, OSError) as e:
                last = e
                if attempt + 1 < self.tries:
                    time.sleep(1.0)
        raise ConnectionError(f"instance metadata at {self.base} unreachable: {last}")

    def token(self, *, renew: bool = False) -> str:
        with self._lock:
            if renew or self._token is None or time.monotonic() > self._token_expiry:
                req = urllib.request.Request(f"{self.base}/latest/api/token", method="PUT",
                                             headers={"X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_TTL_S)})
                code, body = self._request(req)
                if code != 200 or not body:
                    raise ConnectionError(f"IMDSv2 token request to {self.base} answered HTTP {code}")
                # renew a minute before the token runs out
                self._token, self._token_expiry = body.strip(), time.monotonic() + IMDS_TOKEN_TTL_S - 60
            return self._token

    def get(self, path: str) -> str | None:
        for renew in (False, True):  # a 401 means the token expired or was revoked: one fresh try
            headers = {"X-aws-ec2-metadata-token": self.token(renew=renew)}
            req = urllib.request.Request(f"{self.base}{path}", headers=headers)
            code, body = self._request(req)
            if code == 200:
                return body
            if code == 404:
                return None
            if code != 401:
                break
        raise ConnectionError(f"IMDS {path} answered HTTP {code}")

    def require(self, path: str) -> str:
        value = self.get(path)
        if value is None:
            raise ConnectionError(f"IMDS has no {path}")
        return value.strip()


# -- peers ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Peer:
    instance_id: str
    launch_index: int
    private_ip: str | None


def host_index(instance: dict) -> int:
    """The host index of a DescribeInstances record: its `trainyard:host-index` tag when it has one
    (instances launched one at a time, as Terraform does, all have launch index 0), else its AMI launch
    index (all instances in one RunInstances, as the EC2 backend launches them)."""
    from trainyard.sdk.aws.facts import HOST_INDEX_TAG

    tag = next((t["Value"] for t in instance.get("Tags") or [] if t["Key"] == HOST_INDEX_TAG), None)
    return int(tag) if tag is not None else int(instance.get("AmiLaunchIndex", 0))


def own_host_index(ec2, instance_id: str, tries: int = 3, wait: float = 2.0) -> int:
    """This instance's host index (see `host_index`), from DescribeInstances of its own id; retried, as
    a just-launched instance may not be visible to the API yet."""
    for attempt in range(tries):
        try:
            reply = ec2.describe_instances(InstanceIds=[instance_id])
            break
        except Exception:  # botocore's ClientError (InvalidInstanceID.NotFound) or a throttle
            if attempt + 1 == tries:
                raise
            time.sleep(wait)
    return host_index(reply["Reservations"][0]["Instances"][0])


def list_peers(ec2, job_name: str, attempt: int) -> list[Peer]:
    """The job's live instances of this attempt, by host index (`Peer.launch_index`: see `host_index`)."""
    from trainyard.sdk.aws.facts import TAG_KEY

    filters = [{"Name": f"tag:{TAG_KEY}", "Values": [job_name]},
               {"Name": "tag:trainyard:attempt", "Values": [str(attempt)]},
               {"Name": "instance-state-name", "Values": ["pending", "running"]}]
    peers = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for res in page.get("Reservations", []):
            for i in res.get("Instances", []):
                peers.append(Peer(i["InstanceId"], host_index(i), i.get("PrivateIpAddress")))
    return sorted(peers, key=lambda p: (p.launch_index, p.instance_id))


def find_peers(ec2, job_name: str, attempt: int, count: int, *, timeout: float = PEER_WAIT_S,
               poll: float = PEER_POLL_S, say: Callable[[str], None] = print,
               stop: Callable[[], str | None] = lambda: None, wake: threading.Event | None = None) -> list[Peer]:
    """Wait until the `count` instances of the job's attempt are there, each with its address. `stop()`
    returning a reason ends the wait with InterruptedError; setting `wake` cuts a pause short."""
    wake = wake or threading.Event()
    deadline = time.monotonic() + timeout
    seen: list[Peer] = []
    for _ in range(int(timeout / max(poll, 0.01)) + 2):  # bounded in count as well as in time
        seen = list_peers(ec2, job_name, attempt)
        indexes = [p.launch_index for p in seen]
        if len(seen) > count or len(set(indexes)) != len(indexes):
            raise RuntimeError(f"job {job_name} attempt {attempt}: {len(seen)} live instances "
                               f"(host indexes {indexes}) where {count} were launched")
        if len(seen) == count and indexes == list(range(count)) and seen[0].private_ip:
            return seen
        if time.monotonic() + poll > deadline:
            break
        say(f"waiting for peers: {len(seen)} of {count} instances of attempt {attempt} seen")
        wake.wait(poll)
        why = stop()
        if why:
            raise InterruptedError(why)
    raise TimeoutError(f"job {job_name} attempt {attempt}: after {timeout:.0f} s only {len(seen)} of {count} "
                       f"instances are pending or running ({[p.instance_id for p in seen]}); "
                       "the others failed to start or were terminated")


# -- input data -----------------------------------------------------------------------------------


def stage_channel(uri: str, dest: str, *, distribution: str, host_index: int, host_count: int,
                  fsx_root: str = "/fsx", stop: Callable[[], str | None] = lambda: None) -> tuple[int, int]:
    """Make a channel's data appear at `dest`. `s3://`/`file://`: download this host's share; returns
    (files, bytes). `fsx://fs-id/dir`: `dest` becomes a symlink to `<fsx_root>/<fs-id>/<dir>`, which
    must exist (the user data mounted the file system); returns (0, 0). `stop()` returning a reason
    ends a download between two files with InterruptedError."""
    if uri.startswith("fsx://"):
        fs_id, path = split_fsx(uri)
        target = f"{fsx_root.rstrip('/')}/{fs_id}{path}".rstrip("/")
        if not os.path.isdir(target):
            raise FileNotFoundError(f"{uri}: {target} does not exist (is {fs_id} mounted at "
                                    f"{fsx_root.rstrip('/')}/{fs_id}, and does it hold {path}?)")
        if os.path.islink(dest):
            os.unlink(dest)
        elif os.path.isdir(dest):
            os.rmdir(dest)  # an empty folder from an earlier contract; a non-empty one is an error
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.symlink(target, dest)
        return 0, 0
    files = storage.list_files(uri)
    if not files:
        raise RuntimeError(f"nothing found at {uri}")
    mine = shard(files, host_index, host_count, distribution)
    os.makedirs(dest, exist_ok=True)
    total = 0
    for obj in mine:
        why = stop()
        if why:
            raise InterruptedError(why)
        total += storage.download_tree(uri, dest, [obj])
    return len(mine), total


def default_interface() -> str:
    """The interface of the default route (`ens5`, `eth0`), from /proc/net/route."""
    try:
        with open("/proc/net/route") as fh:
            for line in fh.readlines()[1:]:
                f = line.split()
                if len(f) > 2 and f[1] == "00000000":
                    return f[0]
    except OSError:
        pass
    return "eth0"


# -- object storage helpers -----------------------------------------------------------------------


def put_text(uri: str, text: str) -> None:
    if uri.startswith("s3://"):
        from trainyard.sdk.storage import s3_client

        bucket, key = split_s3(uri)
        s3_client().put_object(Bucket=bucket, Key=key, Body=text.encode(), ContentType="application/json")
    else:
        path = uri[len("file://"):]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".partial", "w") as fh:
            fh.write(text)
        os.replace(path + ".partial", path)


def get_text(uri: str) -> str:
    if uri.startswith("s3://"):
        from trainyard.sdk.storage import s3_client

        bucket, key = split_s3(uri)
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    with open(uri[len("file://"):]) as fh:
        return fh.read()


class StatusWriter:
    """Rewrites the host's status object at every phase change. After a final phase only another final
    phase is written, and after `Interrupted` nothing but a final one."""

    def __init__(self, state_uri: str, host: str, instance_id: str, attempt: int, say: Callable[[str], None]):
        self.uri = status_uri(state_uri, host)
        self.doc = {"host": host, "instance_id": instance_id, "attempt": attempt, "phase": None}
        self.say = say
        self.phases: list[str] = []
        self._lock = threading.Lock()

    @property
    def phase(self) -> str | None:
        return self.doc["phase"]

    def write(self, phase: str, message: str, *, exit_code: int | None = None,
              failure_reason: str | None = None) -> bool:
        from trainyard.sdk.jobstate import now_iso

        assert phase in PHASES, phase
        with self._lock:
            current = self.doc["phase"]
            if current in FINAL_PHASES and phase not in FINAL_PHASES:
                return False
            if current == "Interrupted" and phase == "Uploading":
                return False
            self.doc.update(phase=phase, message=message, time=now_iso(), exit_code=exit_code,
                            failure_reason=failure_reason[:1024] if failure_reason else None)
            self.phases.append(phase)
            text = json.dumps(self.doc, indent=1)
        self.say(f"status {phase}: {message}")
        try:
            put_text(self.uri, text)
        except Exception as e:  # training goes on; the controller then sees a late phase, not a crash
            self.say(f"could not write {self.uri}: {type(e).__name__}: {e}")
            return False
        return True


# -- spot interruption ----------------------------------------------------------------------------


class SpotWatcher:
    """Polls IMDS for the spot interruption notice; `on_notice(notice)` is called once."""

    PATH = "/latest/meta-data/spot/instance-action"

    def __init__(self, imds: Imds, poll_s: float, on_notice: Callable[[dict], None], say: Callable[[str], None]):
        self.imds, self.poll_s, self.on_notice, self.say = imds, poll_s, on_notice, say
        self.notice: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spot-watcher", daemon=True)

    def start(self) -> "SpotWatcher":
        self._thread.start()
        return self

    def _run(self) -> None:
        errors = 0
        while not self._stop.wait(self.poll_s):
            try:
                body = self.imds.get(self.PATH)
            except Exception as e:
                errors += 1
                if errors == 1 or errors % 100 == 0:
                    self.say(f"spot notice check failed ({errors}x): {e}")
                continue
            if body is None:
                continue
            try:
                notice = json.loads(body)
            except ValueError:
                notice = {"action": "terminate", "time": body.strip()}
            self.notice = notice
            self.on_notice(notice)
            return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)


# -- the agent ------------------------------------------------------------------------------------


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Agent:
    def __init__(self, *, state_uri: str, region: str, attempt: int, root: str):
        self.state_uri, self.region, self.attempt = state_uri.rstrip("/"), region, attempt
        self.root = root.rstrip("/") or "/"
        self.job_name = job_name_from_state_uri(self.state_uri)
        self.host = "algo-?"
        self.instance_id = "?"
        self.logs: LogShipper | None = None
        self.status: StatusWriter | None = None
        self.proc: subprocess.Popen | None = None
        self.notice: dict | None = None
        self.stop_signal: int | None = None
        self._wake = threading.Event()  # set by a signal or the spot notice: cuts every wait short

    def say(self, msg: str) -> None:
        self.emit(f"[{self.host} agent] {msg}")

    def emit(self, line: str) -> None:
        try:
            print(line, flush=True)
        except (OSError, ValueError):  # nobody reads the console any more: CloudWatch still does
            pass
        if self.logs is not None:
            self.logs.write(line)

    def _client(self, service: str):
        import boto3
        from botocore.config import Config

        cfg = Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=10, read_timeout=30)
        return boto3.client(service, region_name=self.region, config=cfg)

    def _on_signal(self, signum, _frame) -> None:
        self.stop_signal = self.stop_signal or signum
        self._wake.set()

    def _on_notice(self, notice: dict) -> None:
        self.notice = notice
        self._wake.set()

    def _interrupted(self) -> str | None:
        if self.notice is not None:
            return f"spot interruption: EC2 reclaims the instance at {self.notice.get('time', '?')} " \
                   f"(action {self.notice.get('action', '?')})"
        if self.stop_signal is not None:
            return f"the agent was stopped ({signal.Signals(self.stop_signal).name})"
        return None

    def run(self) -> int:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, self._on_signal)
        imds = Imds()
        launch_index = int(imds.require("/latest/meta-data/ami-launch-index"))
        instance_id = imds.require("/latest/meta-data/instance-id")
        index = own_host_index(self._client("ec2"), instance_id)  # the host-index tag, else the launch index
        local_ip = imds.get("/latest/meta-data/local-ipv4") or "?"
        self.host, self.instance_id = host_name(index), instance_id
        try:
            self.logs = LogShipper(self._client("logs"), LOG_GROUP, f"{self.job_name}/{self.host}").start()
        except Exception as e:  # no CloudWatch: the job still runs, its output on the console
            self.say(f"CloudWatch Logs unavailable, logging to the console only: {type(e).__name__}: {e}")
        self.status = StatusWriter(self.state_uri, self.host, instance_id, self.attempt, self.say)
        watcher = SpotWatcher(imds, float(os.environ.get("TRAINYARD_SPOT_POLL_S", SPOT_POLL_S)), self._on_notice,
                              self.say).start()
        code = 1
        try:
            self.status.write("Starting", f"instance {instance_id} ({local_ip}), host index {index} "
                                          f"(launch index {launch_index}), attempt {self.attempt}")
            code = self._run(index)
        except Exception as e:
            interrupted = self._interrupted()
            if interrupted:  # before the driver ran: nothing to checkpoint
                self.say(f"stopped before training: {interrupted}")
                self.status.write("Interrupted", interrupted, failure_reason=interrupted)
                code = 128 + signal.SIGTERM
            else:
                reason = f"{self.host} agent: {type(e).__name__}: {e}"
                self.say(f"FAILED: {reason}")
                self.status.write("Failed", reason, exit_code=1, failure_reason=reason)
                code = 1
        finally:
            watcher.stop()
            self.say(f"exiting with status {code}")
            if self.logs is not None:
                self.logs.close()
        return code

    def _run(self, index: int) -> int:
        from trainyard.container.contract import render_contract, write_contract
        from trainyard.sdk.aws.facts import RDZV_PORT
        from trainyard.sdk.spec import JobSpec

        spec = JobSpec.from_json(get_text(join(self.state_uri, "spec.json")))
        if spec.job_name != self.job_name:
            raise ValueError(f"{self.state_uri}/spec.json is for job {spec.job_name!r}, not {self.job_name!r}")
        if index >= spec.instance_count:
            raise ValueError(f"host index {index} but the job has {spec.instance_count} instance(s)")
        deadline = time.monotonic() + spec.max_run  # even with no controller left, the instance ends
        peers = find_peers(self._client("ec2"), spec.job_name, self.attempt, spec.instance_count,
                           timeout=float(os.environ.get("TRAINYARD_PEER_WAIT_S", PEER_WAIT_S)), say=self.say,
                           stop=self._interrupted, wake=self._wake)
        if peers[index].instance_id != self.instance_id:
            self.say(f"warning: DescribeInstances has {peers[index].instance_id} at host index {index}, "
                     f"IMDS says this is {self.instance_id}")
        master_addr = os.environ.get("TRAINYARD_MASTER_ADDR") or peers[0].private_ip
        master_port = int(os.environ.get("TRAINYARD_MASTER_PORT") or RDZV_PORT)
        self._check_interrupt()

        self.status.write("Downloading", f"downloading input data ({len(spec.channels)} channel(s)); "
                                         f"master {master_addr}:{master_port}")
        fsx_root = os.environ.get("TRAINYARD_FSX_ROOT", "/fsx")
        for ch in spec.channels:
            dest = f"{self.root}/input/data/{ch.name}"
            n, size = stage_channel(ch.uri, dest, distribution=ch.distribution, host_index=index,
                                    host_count=spec.instance_count, fsx_root=fsx_root, stop=self._interrupted)
            where = f"{n} files, {size / 2**20:.1f} MiB" if not ch.uri.startswith("fsx://") else \
                f"linked to {os.readlink(dest)}"
            self.say(f"channel {ch.name}: {where} from {ch.uri}")
            self._check_interrupt()
        contract = render_contract(spec, index, root=self.root, master_addr=master_addr, master_port=master_port,
                                   network_interface=default_interface(), num_cpus=os.cpu_count())
        write_contract(contract, self.root)

        self.status.write("Training", f"training on {spec.instance_count} host(s) x {spec.processes_per_host} "
                                      f"process(es); master {master_addr}:{master_port}")
        code, why = self._run_driver(deadline)
        return self._finish(code, why)

    def _check_interrupt(self) -> None:
        why = self._interrupted()
        if why:
            raise InterruptedError(why)

    def _run_driver(self, deadline: float) -> tuple[int, str | None]:
        """Run the driver to its end. Returns (its exit status, why it was ended early or None)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._check_interrupt()
        self.proc = proc = subprocess.Popen(
            [sys.executable, "-m", "trainyard.container.driver", "--root", self.root], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        reader = threading.Thread(target=self._pump, args=(proc,), name="driver-output", daemon=True)
        reader.start()
        why: str | None = None
        kill_at: float | None = None
        while True:
            self._wake.wait(WAIT_POLL_S)
            self._wake.clear()
            if proc.poll() is not None:
                break
            if why is None:
                why = self._interrupted()
                grace = INTERRUPT_GRACE_S if self.notice is not None else STOP_GRACE_S
                if why is None and time.monotonic() > deadline:
                    why, grace = "MaxRuntimeExceeded: the job ran longer than max_run and was stopped", STOP_GRACE_S
                if why is not None:
                    if self.notice is not None:
                        self.status.write("Interrupted", why, failure_reason=why)
                    self.say(f"{why}; sending SIGTERM to the driver (SIGKILL in {grace:.0f} s)")
                    self._signal_driver(signal.SIGTERM)
                    kill_at = time.monotonic() + grace
            elif kill_at is not None and time.monotonic() > kill_at:
                self.say("the driver did not stop in time: SIGKILL")
                self._signal_driver(signal.SIGKILL)
                kill_at = None
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    self.say("the driver survived SIGKILL; giving up on it")
                    break
        self._signal_driver(signal.SIGKILL)  # whatever of its group is left
        reader.join(READER_JOIN_S)
        return _exit_status(proc.returncode if proc.returncode is not None else -signal.SIGKILL), why

    def _pump(self, proc: subprocess.Popen) -> None:
        upload_line = f"[{self.host}] {_UPLOAD_LINE}"
        for raw in iter(lambda: proc.stdout.readline(CWL_EVENT_BYTES), b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            self.emit(line)
            if line == upload_line and self.status.phase == "Training":
                self.status.write("Uploading", "uploading the model and output data")

    def _signal_driver(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _finish(self, code: int, why: str | None) -> int:
        """Write the final status from the driver's exit status and its reports."""
        result: dict = {}
        try:
            with open(f"{self.root}/output/host-status.json") as fh:
                result = json.load(fh)
        except (OSError, ValueError):
            pass
        failure = ""
        try:
            with open(f"{self.root}/output/failure", errors="replace") as fh:
                failure = fh.read(1024)
        except OSError:
            pass
        if self.logs is not None:  # the final status tells the controller to read the logs: ship them first
            self.logs.flush()
        if code == 0:
            self.status.write("Completed", "training completed", exit_code=0)
        elif why is not None and not why.startswith("MaxRuntimeExceeded"):
            self.status.write("Interrupted", f"{why}; the driver exited with status {code}", exit_code=code,
                              failure_reason=why)
        else:
            reason = why or failure or result.get("reason") or \
                f"{self.host}: the driver exited with status {code} and left no failure report"
            self.status.write("Failed", (reason.splitlines() or [""])[0], exit_code=code, failure_reason=reason)
        return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainyard.container.node")
    p.add_argument("--state-uri", required=True, help="<output_path>/<job>/trainyard")
    p.add_argument("--region", required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--root", default=os.environ.get("TRAINYARD_ML_ROOT", "/opt/ml"))
    a = p.parse_args(argv)
    try:
        agent = Agent(state_uri=a.state_uri, region=a.region, attempt=a.attempt, root=a.root)
    except ValueError as e:
        print(f"[trainyard agent] {e}", flush=True)
        return 2
    try:
        return agent.run()
    except Exception as e:  # before the host is known (IMDS): nothing to report to but the console
        print(f"[trainyard agent] FAILED before reporting: {type(e).__name__}: {e}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
