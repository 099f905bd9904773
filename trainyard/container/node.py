"""The node agent: what runs in the training container on each EC2 instance of a job.

    python -m trainyard.container.node --state-uri s3://.../<job>/trainyard --region us-east-1 --attempt 1 \
        [--root /opt/ml] [--hosts-file /etc/hosts]

Every instance of a job runs the same command (one RunInstances, identical user data); the instance
metadata tells them apart. The agent

1. asks IMDS (v2, trainyard/container/imds.py) for its instance id and launch index, takes its host index
   (host `algo-<index+1>`) from its `trainyard:host-index` tag when it has one (Terraform's instances, each
   launched alone, all have launch index 0), else the launch index, and reports `Starting`;
2. reads the job's spec from `<state_uri>/spec.json` and finds its peers with DescribeInstances (tags
   `trainyard:job`, `trainyard:attempt`; trainyard/container/peers.py); the master is the private address of
   host index 0, and every host's name `algo-N` is added to the container's /etc/hosts with its peer's
   private address (trainyard/container/hostnames.py);
3. `Downloading`: copies the S3 channels into `<root>/input/data/<channel>` (ShardedByS3Key as the local
   backend shards), links FSx channels to the mounted file system (trainyard/container/staging.py), writes
   the SageMaker contract files;
4. `Training`: runs the driver (`python -m trainyard.container.driver`) in its own process group, each
   output line to CloudWatch Logs (`/trainyard/jobs`, stream `<job>/algo-N`; trainyard/container/logship.py) and to
   its own stdout, while a thread watches IMDS for a spot interruption notice (then: `Interrupted`,
   SIGTERM to the driver, whose engine writes an emergency checkpoint, SIGKILL after `INTERRUPT_GRACE_S`);
   on the first host another thread ships the lines appended to `<root>/output/data/metrics.jsonl` to
   `<state_uri>/hosts/algo-1/metrics/` every few seconds (trainyard/container/metricship.py);
5. ships the last metrics lines, flushes the logs, reports `Completed`, `Failed` (with the failure reason)
   or `Interrupted`, and exits with the driver's status.

The status object is rewritten whole at `<state_uri>/hosts/algo-N/status.json` at every phase change:
`{"host", "instance_id", "attempt", "phase", "message", "time", "exit_code", "failure_reason", "phase_times",
"phases"}`: `phase_times` says when the host entered each phase, `phases` is the host's cold start as timed
phases (trainyard/container/phases.py: `capacity` and `image` from the instance's LaunchTime and the times
the user data hands over, `peers` and `data` timed here, the driver's `code`, `first_step` and `upload` read
from its phases file); the object is also rewritten, phase unchanged, when the driver's phases change. The
first host's metrics parts are next to it, under `<state_uri>/hosts/algo-1/metrics/`.

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
from collections.abc import Callable

from trainyard.container.contract import render_contract, write_contract
from trainyard.container.failure import headline
from trainyard.container.hang import HANG_WATCH_ENV
from trainyard.container.hostnames import HOSTS_FILE, RESOLVES_ENV, update_hosts_file
from trainyard.container.imds import SPOT_POLL_S, Imds, SpotWatcher
from trainyard.container.lifeline import Lifeline
from trainyard.container.logship import CWL_EVENT_BYTES, LogShipper
from trainyard.container.metricship import METRICS_FILE, MetricsShipper
from trainyard.container.peers import PEER_WAIT_S, find_peers, host_index, host_name, own_instance
from trainyard.container.phases import HOST_PHASES_FILE, PhaseLog, boot_phases, merge, read_phases, settle
from trainyard.container.staging import FSX_ROOT, stage_channel
from trainyard.job.facts import RDZV_PORT
from trainyard.job.jsonio import now_iso
from trainyard.job.spec import JobSpec
from trainyard.job import storage
from trainyard.job.storage import s3_client
from trainyard.job.uris import join, split_s3

PHASES = ("Starting", "Downloading", "Training", "Uploading", "Completed", "Failed", "Interrupted")
FINAL_PHASES = ("Completed", "Failed", "Interrupted")
LOG_GROUP = "/trainyard/jobs"

# SIGTERM -> SIGKILL for the driver after a notice: of the ~120 s warning, 100 s for the emergency
# checkpoint and the artifact upload, the rest for the final status and the log tail
INTERRUPT_GRACE_S = 100.0
STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL when the agent itself is stopped (or max_run passes)
WAIT_POLL_S = 0.2  # how often the agent checks on the driver, the notice and the clock
READER_JOIN_S = 10.0  # after the driver exits, how long its output pipe may take to drain

# the driver's line that announces the artifact upload on the first host (trainyard/container/driver.py, _say)
_UPLOAD_LINE = "driver: uploading model and output data"


def job_name_from_state_uri(state_uri: str) -> str:
    """`<output_path>/<job>/trainyard` -> `<job>`."""
    _, sep, rest = state_uri.rstrip("/").partition("://")
    parts = rest.split("/")  # [bucket, ..., job, "trainyard"] (file:// URIs: ["", ..., job, "trainyard"])
    if not sep or len(parts) < 3 or parts[-1] != "trainyard" or not parts[-2]:
        raise ValueError(f"state URI {state_uri!r} is not <output_path>/<job>/trainyard")
    return parts[-2]


def status_uri(state_uri: str, host: str) -> str:
    return join(state_uri, "hosts", host, "status.json")


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
    storage.put_bytes(uri, text.encode(), "application/json")


def get_text(uri: str) -> str:
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    with open(uri[len("file://"):]) as fh:
        return fh.read()


class StatusWriter:
    """Rewrites the host's status object at every phase change. After a final phase only another final
    phase is written, and after `Interrupted` nothing but a final one. `host_phases()` gives the host's
    timed phases to write with it (`publish()` writes them without a phase change)."""

    def __init__(self, state_uri: str, host: str, instance_id: str, attempt: int, say: Callable[[str], None],
                 host_phases: Callable[[], list[dict]] = list):
        self.uri = status_uri(state_uri, host)
        self.doc = {"host": host, "instance_id": instance_id, "attempt": attempt, "phase": None,
                    "phase_times": {}, "phases": []}
        self.say = say
        self.host_phases = host_phases
        self.phases: list[str] = []
        self._lock = threading.Lock()
        self._put_lock = threading.Lock()  # one put at a time, never an older document over a newer one
        self._made = self._sent = 0  # documents made, and the newest one put

    @property
    def phase(self) -> str | None:
        return self.doc["phase"]

    def write(self, phase: str, message: str, *, exit_code: int | None = None,
              failure_reason: str | None = None) -> bool:
        assert phase in PHASES, phase
        with self._lock:
            current = self.doc["phase"]
            if current in FINAL_PHASES and phase not in FINAL_PHASES:
                return False
            if current == "Interrupted" and phase == "Uploading":
                return False
            t = now_iso()
            self.doc.update(phase=phase, message=message, time=t, exit_code=exit_code,
                            failure_reason=failure_reason[:1024] if failure_reason else None)
            self.doc["phase_times"].setdefault(phase, t)
            # at the end, a phase still running ended with the host (a first step never seen did not happen)
            self.doc["phases"] = settle(self.host_phases(), t) if phase in FINAL_PHASES else self.host_phases()
            self.phases.append(phase)
            text, n = self._made_doc()
        self.say(f"status {phase}: {message}")
        return self._put(text, n)

    def publish(self) -> bool:
        """Write the host's phases again when they changed (the phase stays; nothing is said)."""
        with self._lock:
            phases = self.host_phases()
            if self.doc["phase"] is None or self.doc["phase"] in FINAL_PHASES or phases == self.doc["phases"]:
                return False
            self.doc["phases"] = phases
            text, n = self._made_doc()
        return self._put(text, n)

    def _made_doc(self) -> tuple[str, int]:
        self._made += 1
        return json.dumps(self.doc, indent=1), self._made

    def _put(self, text: str, n: int) -> bool:
        with self._put_lock:
            if n < self._sent:  # a newer document went out meanwhile (another thread's)
                return True
            try:
                put_text(self.uri, text)
            except Exception as e:  # training goes on; the controller then sees a late phase, not a crash
                self.say(f"could not write {self.uri}: {type(e).__name__}: {e}")
                return False
            self._sent = n
        return True


# -- the agent ------------------------------------------------------------------------------------


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Agent:
    def __init__(self, *, state_uri: str, region: str, attempt: int, root: str, hosts_file: str = HOSTS_FILE):
        self.state_uri, self.region, self.attempt = state_uri.rstrip("/"), region, attempt
        self.root = root.rstrip("/") or "/"
        self.hosts_file = hosts_file
        self.job_name = job_name_from_state_uri(self.state_uri)
        self.host = "algo-?"
        self.instance_id = "?"
        self.logs: LogShipper | None = None
        self.status: StatusWriter | None = None
        self.metrics: MetricsShipper | None = None  # the first host's only: metrics() reads algo-1's rows
        self.proc: subprocess.Popen | None = None
        self.lifeline = Lifeline()
        self.notice: dict | None = None
        self.stop_signal: int | None = None
        self._wake = threading.Event()  # set by a signal or the spot notice: cuts every wait short
        self.phases = PhaseLog()  # the host phases timed here (the driver's are in its own file)
        self.driver_phases_file = f"{self.root}/{HOST_PHASES_FILE}"

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

    def host_phases(self) -> list[dict]:
        """This host's timed phases: the agent's and the driver's (container/phases.py)."""
        return merge(self.phases.entries, read_phases(self.driver_phases_file))

    def run(self) -> int:
        started = now_iso()
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, self._on_signal)
        imds = Imds()
        launch_index = int(imds.require("/latest/meta-data/ami-launch-index"))
        instance_id = imds.require("/latest/meta-data/instance-id")
        me = own_instance(self._client("ec2"), instance_id)
        index = host_index(me)  # the host-index tag, else the launch index
        launched = me.get("LaunchTime")  # EC2's: when RunInstances asked for it
        for entry in boot_phases(launched.isoformat() if launched else None, started, os.environ):
            self.phases.add(entry["Phase"], entry["StartTime"], entry["EndTime"])
        local_ip = imds.get("/latest/meta-data/local-ipv4") or "?"
        self.host, self.instance_id = host_name(index), instance_id
        try:
            self.logs = LogShipper(self._client("logs"), LOG_GROUP, f"{self.job_name}/{self.host}").start()
        except Exception as e:  # no CloudWatch: the job still runs, its output on the console
            self.say(f"CloudWatch Logs unavailable, logging to the console only: {type(e).__name__}: {e}")
        self.status = StatusWriter(self.state_uri, self.host, instance_id, self.attempt, self.say, self.host_phases)
        watcher = SpotWatcher(imds, float(os.environ.get("TRAINYARD_SPOT_POLL_S", SPOT_POLL_S)), self._on_notice,
                              self.say).start()
        code = 1
        try:
            self.status.write("Starting", f"instance {instance_id} ({local_ip}), host index {index} "
                                          f"(launch index {launch_index}), attempt {self.attempt}")
            code = self._run(index)
        except Exception as e:
            self._ship_metrics()  # before the final status, as _finish does
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
        spec = JobSpec.from_json(get_text(join(self.state_uri, "spec.json")))
        if spec.job_name != self.job_name:
            raise ValueError(f"{self.state_uri}/spec.json is for job {spec.job_name!r}, not {self.job_name!r}")
        if index >= spec.instance_count:
            raise ValueError(f"host index {index} but the job has {spec.instance_count} instance(s)")
        deadline = time.monotonic() + spec.max_run  # even with no controller left, the instance ends
        with self.phases.timed("peers"):
            peers = find_peers(self._client("ec2"), spec.job_name, self.attempt, spec.instance_count,
                               timeout=float(os.environ.get("TRAINYARD_PEER_WAIT_S", PEER_WAIT_S)), say=self.say,
                               stop=self._interrupted, wake=self._wake)
            if peers[index].instance_id != self.instance_id:
                self.say(f"warning: DescribeInstances has {peers[index].instance_id} at host index {index}, "
                         f"IMDS says this is {self.instance_id}")
            self._add_host_names({host_name(p.launch_index): p.private_ip for p in peers})
        master_addr = os.environ.get("TRAINYARD_MASTER_ADDR") or peers[0].private_ip
        master_port = int(os.environ.get("TRAINYARD_MASTER_PORT") or RDZV_PORT)
        self._check_interrupt()

        self.status.write("Downloading", f"downloading input data ({len(spec.channels)} channel(s)); "
                                         f"master {master_addr}:{master_port}")
        fsx_root = os.environ.get("TRAINYARD_FSX_ROOT", FSX_ROOT)
        with self.phases.timed("data", enabled=bool(spec.channels)):
            for ch in spec.channels:
                stage_channel(ch.name, ch.uri, f"{self.root}/input/data/{ch.name}", distribution=ch.distribution,
                              host_index=index, host_count=spec.instance_count, fsx_root=fsx_root,
                              stop=self._interrupted, say=self.say)
                self._check_interrupt()
        contract = render_contract(spec, index, root=self.root, master_addr=master_addr, master_port=master_port,
                                   network_interface=default_interface(), num_cpus=os.cpu_count())
        write_contract(contract, self.root)
        if index == 0:
            self.metrics = MetricsShipper(f"{self.root}/output/data/{METRICS_FILE}", self.state_uri, self.host,
                                          self.attempt, self.say).start()

        self.status.write("Training", f"training on {spec.instance_count} host(s) x {spec.processes_per_host} "
                                      f"process(es); master {master_addr}:{master_port}")
        code, why = self._run_driver(deadline)
        return self._finish(code, why)

    def _add_host_names(self, names: dict[str, str]) -> None:
        """`algo-N` -> the peers' private addresses in the hosts file, before the driver starts: SageMaker
        scripts resolve `SM_HOSTS[0]` or write hostfiles with these names. Without write access (an image
        run as a user other than root) the job goes on, and the log says so."""
        try:
            update_hosts_file(names, self.hosts_file)
        except OSError as e:
            self.say(f"warning: could not add the host names to {self.hosts_file}: {e}")
            return
        self.say(f"host names in {self.hosts_file}: " + ", ".join(f"{n} {a}" for n, a in names.items()))
        if self.hosts_file == HOSTS_FILE:  # the container's own: every program resolves them
            os.environ[RESOLVES_ENV] = "1"

    def _check_interrupt(self) -> None:
        why = self._interrupted()
        if why:
            raise InterruptedError(why)

    def _run_driver(self, deadline: float) -> tuple[int, str | None]:
        """Run the driver to its end. Returns (its exit status, why it was ended early or None)."""
        # no process here sees every host: the driver watches its own ranks for hangs (container/hang.py)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", HANG_WATCH_ENV: "driver"}
        self._check_interrupt()
        # the driver kills its ranks when this agent is gone, however it ended (container/lifeline.py)
        self.proc = proc = subprocess.Popen(
            [sys.executable, "-m", "trainyard.container.driver", "--root", self.root], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            pass_fds=self.lifeline.hand_over(env))
        reader = threading.Thread(target=self._pump, args=(proc,), name="driver-output", daemon=True)
        reader.start()
        why: str | None = None
        kill_at: float | None = None
        seen_phases = None
        while True:
            self._wake.wait(WAIT_POLL_S)
            self._wake.clear()
            if proc.poll() is not None:
                break
            seen_phases = self._publish_phases(seen_phases)
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

    def _publish_phases(self, seen: tuple | None) -> tuple | None:
        """Write the status again when the driver's phases file changed since `seen` (its stamp, returned)."""
        try:
            st = os.stat(self.driver_phases_file)
        except OSError:
            return seen
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # each rewrite is a new file (os.replace)
        if stamp != seen:
            self.status.publish()
        return stamp

    def _pump(self, proc: subprocess.Popen) -> None:
        upload_line = f"[{self.host}] {_UPLOAD_LINE}"
        for raw in iter(lambda: proc.stdout.readline(CWL_EVENT_BYTES), b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            self.emit(line)
            if line == upload_line and self.status.phase == "Training":
                self.status.write("Uploading", "uploading the model and output data")

    def _ship_metrics(self) -> None:
        """Stop the metrics thread after a last round (once)."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

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
        self._ship_metrics()  # the final status tells the controller to read the metrics and the logs:
        if self.logs is not None:  # ship them first
            self.logs.flush()
        if code == 0:
            self.status.write("Completed", "training completed", exit_code=0)
        elif why is not None and not why.startswith("MaxRuntimeExceeded"):
            self.status.write("Interrupted", f"{why}; the driver exited with status {code}", exit_code=code,
                              failure_reason=why)
        else:
            reason = why or failure or result.get("reason") or \
                f"{self.host}: the driver exited with status {code} and left no failure report"
            self.status.write("Failed", headline(reason), exit_code=code, failure_reason=reason)
        return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainyard.container.node")
    p.add_argument("--state-uri", required=True, help="<output_path>/<job>/trainyard")
    p.add_argument("--region", required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--root", default=os.environ.get("TRAINYARD_ML_ROOT", "/opt/ml"))
    p.add_argument("--hosts-file", default=os.environ.get("TRAINYARD_HOSTS_FILE", HOSTS_FILE),
                   help="where the algo-N host names are added (default /etc/hosts)")
    a = p.parse_args(argv)
    try:
        agent = Agent(state_uri=a.state_uri, region=a.region, attempt=a.attempt, root=a.root,
                      hosts_file=a.hosts_file)
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
