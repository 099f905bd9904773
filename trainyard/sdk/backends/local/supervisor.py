"""The supervisor of one local job: prepares the hosts, runs one driver per host, ends them all.

    python -m trainyard.sdk.backends.local.supervisor <job folder>

Started detached by `LocalBackend.launch`, so a job outlives the `fit()` that started it (`wait=False`,
`Estimator.attach`). It is a child subreaper: workers that torchrun starts in their own sessions, and any
process they leave behind, end up as its descendants, and every one of them is killed when the job ends
(success, failure, `stop()`, `max_run`). No orphan survives, also when this process itself is killed: every
driver holds its lifeline (container/lifeline.py) and kills its ranks the moment this process is gone.

It writes the job's status document (`jobstate.Status`): the secondary status transitions (Starting, written
by `launch()`; PreparingTrainingStack, Downloading and Training as it gets there; Uploading when the first
host's driver starts its upload; the outcome), and `HostPhases` (trainyard/container/phases.py): each
host's `data` phase (the staging of its channels, timed here) merged with the phases its driver times in
`hosts/algo-N.phases.json` (`capacity` from the spawn time this process hands it, `code`, `first_step`,
`upload`), read again whenever that file changes.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from urllib.parse import urlparse

from trainyard.container import attempts, hostnames
from trainyard.container.contract import render_contract, write_contract
from trainyard.container.failure import ECHO_SETTLE_S, RankFailure, root_cause
from trainyard.container.hang import HangWatch, respond
from trainyard.container.hostnames import RESOLVES_ENV
from trainyard.container.lifeline import ENV as LIFELINE_ENV
from trainyard.container.lifeline import HOST_LOG_ENV, Lifeline, descendants, signal_all
from trainyard.container.phases import REQUESTED_ENV, PhaseLog, merge, read_phases, settle
from trainyard.container.staging import list_channel, stage_channel
from trainyard.sdk.jobs.joblog import LinePump, stamped
from trainyard.sdk.backends.local.backend import free_port
from trainyard.sdk.jobs.jobstate import Status, now_iso, read_json, record_outcome, write_json
from trainyard.job import space
from trainyard.errors import ConfigError
from trainyard.job.spec import JobSpec
from trainyard.sdk import image, image_base
from trainyard.sdk.backends.local import containers
from trainyard.sdk.backends.local import netem
from trainyard.sdk.backends.local.netem import in_host
from trainyard.sdk.store import Endpoint, keep_alive

POLL_S = 0.1
FAILURE_SETTLE_S = 2.0  # after the first host fails, how long the others get to report their own end
STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL: time for torchrun to stop its workers and algo-1 to upload
LOG_DRAIN_S = 10.0  # after the last process ended, how long the log pumps get to write what they read
STORE_PING_S = 60.0  # keeps the embedded store from idling out while the job runs
PR_SET_CHILD_SUBREAPER = 36  # prctl option, <linux/prctl.h>
MOUNT_POINT = "/opt/ml"


def _log(msg: str) -> None:
    print(stamped(f"[trainyard] {msg}"), flush=True)


def set_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def private_opt_ml_works(probe_dir: str) -> bool:
    """Root with working private mount namespaces: each host can see its own root at /opt/ml."""
    if os.geteuid() != 0:
        return False
    try:
        os.makedirs(MOUNT_POINT, exist_ok=True)
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                            f'mount --bind "$0" {MOUNT_POINT}', probe_dir], capture_output=True, timeout=10)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class Supervisor:
    def __init__(self, jobdir: str):
        # handlers first: a stop() that comes while we start must stop the job, not kill us mid-way
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, self._on_signal)
        self.jobdir = jobdir
        self.spec = JobSpec.from_json(open(f"{jobdir}/spec.json").read())
        self.runtime = read_json(f"{jobdir}/runtime.json")
        os.environ.update(self.runtime.get("env", {}))  # staging and drivers use the job's endpoint
        self.status = Status(f"{jobdir}/status.json")
        self.stop_reason: str | None = None  # "Stopped" or "MaxRuntimeExceeded"
        self.drivers: dict[int, subprocess.Popen] = {}  # pid -> driver
        self.pumps: list[LinePump] = []  # each driver's output, stamped, into logs/<host>.log
        self.exits: dict[str, int] = {}  # host -> exit status
        # hosts whose drivers this process stopped (terminate): never lost hosts, and without a report of their own
        # not failures either, whatever their status (143 once handled, -15 where the driver had no handler yet,
        # -9 past the grace)
        self.terminated: set[str] = set()
        self.plan = None  # the emulated network's names and addresses, when the job has one
        self.relay = None
        self.driver_env: dict[str, str] = {}
        self.phases = {host: PhaseLog() for host in self.spec.hosts}  # what this process times per host
        self._reasons: dict[str, str] = {}  # host -> the reason its driver wrote, once it failed
        timeout = self.spec.hang_timeout_s
        self.hang_watch = HangWatch(f"{jobdir}/torchrun/*/heartbeat/rank-*.json", timeout) if timeout else None
        self.next_hang_check = 0.0
        self.hang_reason = ""
        self.phase_files: dict[str, tuple] = {}  # host -> (its driver's phases file's stamp, its entries)
        self.lifeline = Lifeline()  # the drivers stop their ranks when this process ends (container/lifeline.py)
        # with image_uri: each host is a container of the image (sdk/backends/local/containers.py)
        self.engine = containers.find_engine() if self.spec.image_uri else None
        self.pip: image_base.PipMounts | None = None  # this machine's pip settings for the containers

    def _on_signal(self, signum, _frame) -> None:
        self.stop_reason = self.stop_reason or "Stopped"

    def stop_requested(self) -> bool:
        if os.path.exists(f"{self.jobdir}/stop-requested"):
            self.stop_reason = self.stop_reason or "Stopped"
        return self.stop_reason is not None

    # -- preparation ------------------------------------------------------------------------------
    def network_up(self) -> None:
        """With `emulated_network`: namespaces, shaped links, and a relay to the object store."""
        net = self.spec.emulated_network
        self.plan = netem.Plan.for_job(self.spec.job_name, self.spec.instance_count, netem.taken_nets())
        for warning in netem.up(self.plan, net.bandwidth_mbit, net.delay_ms):
            _log(f"warning: {warning}")
        _log(f"emulated network: hosts at {self.plan.host_addr(0)}..{self.plan.host_addr(self.spec.instance_count - 1)}, "
             f"links shaped to {net.bandwidth_mbit} Mbit/s")
        endpoint = urlparse(os.environ.get("AWS_ENDPOINT_URL") or "")
        if endpoint.hostname in ("127.0.0.1", "localhost"):  # this loopback is not the hosts': relayed from theirs
            self.relay = netem.Relay([self.plan.host_ns(i) for i in range(self.spec.instance_count)],
                                     ("127.0.0.1", endpoint.port))
        # gloo picks its address by the host name, which resolves to loopback: name the interface
        self.driver_env["GLOO_SOCKET_IFNAME"] = "eth0"

    def network_down(self) -> None:
        if self.relay is not None:
            self.relay.close()
        if self.plan is not None:
            netem.down(self.plan)
            left = netem.leftovers(self.plan.tag)
            if left:
                _log(f"warning: could not remove {left}")

    def prepare_hosts(self, private: bool) -> None:
        spec = self.spec
        for i, host in enumerate(spec.hosts):
            hostdir = f"{self.jobdir}/hosts/{host}"
            contract = render_contract(
                spec, i, root=MOUNT_POINT if private else hostdir,
                master_addr=self.plan.host_addr(0) if self.plan else "127.0.0.1",
                master_port=self.runtime["master_port"], network_interface="eth0" if self.plan else "lo",
                num_cpus=os.cpu_count(),
            )
            write_contract(contract, hostdir)

    def stage_channels(self) -> None:
        """Each host's share of each channel into its folder (trainyard/container/staging.py, as on EC2),
        host after host, each timed as that host's `data` phase; a stop request ends it between two files."""
        spec = self.spec
        listings: dict[str, list | None] = {}  # each channel is listed once, for all hosts (by the first)

        def stop() -> str | None:
            return self.stop_reason if self.stop_requested() else None

        try:
            for i, host in enumerate(spec.hosts):
                with self.phases[host].timed("data", enabled=bool(spec.channels)):
                    for ch in spec.channels:
                        if ch.name not in listings:
                            listings[ch.name] = None if ch.uri.startswith("fsx://") else list_channel(ch.name, ch.uri)
                        stage_channel(ch.name, ch.uri, f"{self.jobdir}/hosts/{host}/input/data/{ch.name}",
                                      distribution=ch.distribution, host_index=i, host_count=spec.instance_count,
                                      files=listings[ch.name], stop=stop,
                                      say=lambda msg, host=host: _log(f"{host}: {msg}"))
        except InterruptedError:
            return  # run() sees the stop request

    # -- running ----------------------------------------------------------------------------------
    def start_drivers(self, private: bool) -> None:
        """One driver per host. Each starts through the host-names launcher (trainyard/container/hostnames.py):
        `algo-1`..`algo-N` resolve on every host, to loopback or, with the emulated network, to the hosts'
        addresses; the launcher's first line in the host's log says how. With image_uri, in a container each."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.driver_env}
        addrs = [self.plan.host_addr(i) if self.plan else "127.0.0.1" for i in range(self.spec.instance_count)]
        if self.engine is not None:
            return self.start_containers(dict(zip(self.spec.hosts, addrs)))
        hosts_file, shim_dir = hostnames.prepare(dict(zip(self.spec.hosts, addrs)), f"{self.jobdir}/hostnames")
        for i, host in enumerate(self.spec.hosts):
            hostdir = f"{self.jobdir}/hosts/{host}"
            driver = [*hostnames.launcher_command(host, hosts_file, shim_dir),
                      sys.executable, "-m", "trainyard.container.driver",
                      "--log-dir", f"{self.jobdir}/torchrun/{host}",
                      "--status-file", f"{self.jobdir}/hosts/{host}.status.json",
                      "--phases-file", self._phases_file(host)]
            if private:
                cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                       f'mount --bind "$0" {MOUNT_POINT} && exec "$@"', hostdir, *driver, "--root", MOUNT_POINT]
            else:
                cmd = [*driver, "--root", hostdir]
            if self.plan is not None:
                cmd = in_host(self.plan, i, cmd)
            # the host is asked for now: its driver ends `capacity` when it runs (container/phases.py)
            host_env = {**env, REQUESTED_ENV: now_iso(), HOST_LOG_ENV: f"{self.jobdir}/logs/{host}.log"}
            p = subprocess.Popen(cmd, env=host_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, cwd=hostdir, pass_fds=self.lifeline.hand_over(host_env))
            self.pumps.append(LinePump(p.stdout, f"{self.jobdir}/logs/{host}.log"))
            self.drivers[p.pid] = p

    def start_containers(self, addresses: dict[str, str]) -> None:
        """One container of the job's image per host, running its driver (sdk/backends/local/containers.py): the job's own
        settings in its environment (the endpoint and key, the cache, TRAINYARD_* settings; with a store that is
        not the embedded one, the AWS settings and credentials of this process), nothing else of this process's."""
        base = {k: v for k, v in os.environ.items() if k.startswith("TRAINYARD_")}
        if not self.runtime.get("embedded_store"):  # S3 or an endpoint the user configured: their credentials
            base.update(containers.aws_env(os.environ))
        job_env = {**base, **self.runtime.get("env", {}), **self.driver_env, "PYTHONUNBUFFERED": "1",
                   RESOLVES_ENV: "1", LIFELINE_ENV: str(containers.LIFELINE_FD)}
        job_env.pop("TRAINYARD_HOME", None)
        cache = self.runtime.get("env", {}).get("TRAINYARD_REQUIREMENTS_CACHE")
        if cache:
            os.makedirs(cache, exist_ok=True)
        # requirements.txt installs from this machine's package indexes, as in host mode: its pip settings (index
        # URLs, find-links, certificate, constraints) as a pip.conf with every local path mounted read-only
        if self.pip is None:
            _log(f"hosts run in containers of {self.spec.image_uri} ({self.engine[0]})")
            self.pip = image_base.pip_mounts(image.TORCH_VERSION, folder=f"{self.jobdir}/pip", pins=False)
        job_env["PIP_CONFIG_FILE"] = f"{image_base.MOUNT}/pip.conf"
        for i, host in enumerate(self.spec.hosts):
            host_env = {**job_env, REQUESTED_ENV: now_iso(), HOST_LOG_ENV: f"{self.jobdir}/logs/{host}.log"}
            run = containers.run_command(
                self.engine, self.spec.image_uri, job=self.spec.job_name, host=host, jobdir=self.jobdir,
                hostdir=f"{self.jobdir}/hosts/{host}", addresses=addresses, env=host_env,
                netns=self.plan.host_ns(i) if self.plan else None, mounts=(cache,) if cache else (),
                extra=tuple(self.pip.args()),
                driver_args=["--root", MOUNT_POINT, "--log-dir", f"{self.jobdir}/torchrun/{host}",
                             "--status-file", f"{self.jobdir}/hosts/{host}.status.json",
                             "--phases-file", self._phases_file(host)])
            fd = self.lifeline.read_fd
            p = subprocess.Popen(containers.with_lifeline_at_3(run, fd), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(fd,))
            self.pumps.append(LinePump(p.stdout, f"{self.jobdir}/logs/{host}.log"))
            self.drivers[p.pid] = p

    # -- status: host phases and the upload ----------------------------------------------------------
    def _phases_file(self, host: str) -> str:
        return f"{self.jobdir}/hosts/{host}.phases.json"

    def record_phases(self, ended: bool = False) -> None:
        """Bring `HostPhases` up to date (a driver's phases file is read again when it changed), and add the
        Uploading transition once the first host's driver has begun its upload. `ended`: the job is over;
        every file is read a last time, and a phase still running ended with the job (a first step never
        seen is dropped)."""
        for host in self.spec.hosts:
            path = self._phases_file(host)
            try:
                st = os.stat(path)
            except OSError:
                continue
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # a rewrite is a new file (os.replace)
            if ended or self.phase_files.get(host, (None,))[0] != stamp:
                self.phase_files[host] = (stamp, read_phases(path))
        phases = {h: merge(self.phases[h].entries, self.phase_files.get(h, (None, []))[1]) for h in self.spec.hosts}
        if ended:
            now = now_iso()
            phases = {h: settle(entries, now) for h, entries in phases.items()}
        if phases != self.status.doc.get("HostPhases"):
            self.status.update(HostPhases=phases)
        upload = next((e for e in phases[self.spec.hosts[0]] if e["Phase"] == "upload"), None)
        if upload is not None and self.status.doc["SecondaryStatus"] == "Training":
            self.status.transition("Uploading", "Uploading model and output data", at=upload["StartTime"])

    def drain_logs(self) -> None:
        """Every line the processes wrote is in the log files before the job's outcome is recorded."""
        deadline = time.monotonic() + LOG_DRAIN_S
        for pump in self.pumps:
            if not pump.join(max(0.0, deadline - time.monotonic())):
                _log(f"warning: {pump.path} may miss its last lines (a process still holds its output open)")

    def reap(self) -> None:
        """Collect exited children: drivers (by pid) and orphans reparented to us."""
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            p = self.drivers.get(pid)
            if p is not None:
                p.returncode = os.waitstatus_to_exitcode(st)
                self.exits[self._host(pid)] = p.returncode

    def _host(self, pid: int) -> str:
        return self.spec.hosts[list(self.drivers).index(pid)]

    def running(self) -> bool:
        return len(self.exits) < len(self.drivers)

    def terminate(self) -> None:
        """SIGTERM the drivers (torchrun stops its workers; algo-1 uploads), then SIGKILL what is left."""
        alive = [p for p, d in self.drivers.items() if d.returncode is None]
        self.terminated.update(self._host(p) for p in alive)
        signal_all(alive, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.running() and time.monotonic() < deadline:
            self.reap()
            time.sleep(POLL_S)
        self.kill_everything()

    def kill_everything(self) -> None:
        if self.engine is not None:  # the containers are the engine's children, not ours: removed by label
            left = containers.remove_all(self.engine, self.spec.job_name)
            if left:
                _log(f"warning: could not remove the containers {left}")
        for _ in range(5):  # processes may fork while we kill: repeat until none is left
            left = descendants(os.getpid())
            if not left:
                break
            signal_all(left, signal.SIGKILL)
            time.sleep(0.05)
            self.reap()
        self.reap()

    def monitor(self, deadline: float | None = None) -> str:
        """Wait for the drivers until `deadline` (time.monotonic(); default: max_run from now). Returns
        'Completed', 'Failed' or the stop reason."""
        deadline = time.monotonic() + self.spec.max_run if deadline is None else deadline
        next_ping = time.monotonic() + STORE_PING_S
        while True:
            self.reap()
            if not self.running():
                return "Completed" if all(c == 0 for c in self.exits.values()) else "Failed"
            if any(c != 0 for c in self.exits.values()) and not self.stop_requested():
                first = time.monotonic()  # let the others report their own end
                while self.running():
                    causes = [f for f in self.failures() if not f.is_echo]
                    if time.monotonic() > first + (FAILURE_SETTLE_S if causes else ECHO_SETTLE_S):
                        break
                    self.reap()
                    time.sleep(POLL_S)
                self.terminate()
                return "Failed"
            if self.hung():
                self.terminate()
                return "Failed"
            if time.monotonic() > deadline:
                self.stop_reason = "MaxRuntimeExceeded"
            if self.stop_requested():
                _log(f"stopping the job ({self.stop_reason})")
                self.terminate()
                return self.stop_reason
            self.record_phases()
            if time.monotonic() > next_ping and self.runtime.get("embedded_store"):
                keep_alive(Endpoint(self.runtime["env"]["AWS_ENDPOINT_URL"], embedded=True))
                next_ping = time.monotonic() + STORE_PING_S
            time.sleep(POLL_S)

    def failures(self) -> list[RankFailure]:
        """The failures of the hosts that ended on their own, as their drivers reported them."""
        failures: list[RankFailure] = []
        for host, code in self.exits.items():
            path = f"{self.jobdir}/hosts/{host}.status.json"
            if code == 0 or code == 128 + signal.SIGTERM or (host in self.terminated and not os.path.exists(path)):
                continue  # a host stopped here that wrote no report: its end is this process's doing
            st = read_json(path) if os.path.exists(path) else {}
            reason = st.get("reason") or f"{host}: the driver exited with status {code} and no report"
            f = st.get("failure")
            failures.append(RankFailure(**f) if f else RankFailure(
                host=host, rank=-1, local_rank=-1, exitcode=code, signal="", time=st.get("finished", time.time()),
                last_lines=reason))
            self._reasons[host] = reason
        return failures

    def hung(self) -> bool:
        """True once the ranks' heartbeats say the job hangs (container/hang.py): then every rank's Python
        stacks are written (SIGUSR2), the diagnosis goes to `hang.json` and the log, and the hung ranks are
        killed so that their launchers end at once."""
        if self.hang_watch is None or time.monotonic() < self.next_hang_check:
            return False
        self.next_hang_check = time.monotonic() + 1.0
        beats = self.hang_watch.check(time.time())
        if beats is None:
            return False
        stacks = lambda b: f"{self.jobdir}/torchrun/{b.host}/heartbeat/stack-rank-{b.rank}.txt"  # noqa: E731
        self.hang_reason = respond(beats, stacks, f"{self.jobdir}/hang.json", _log)
        return True

    def failure_reason(self) -> str:
        """The root cause among the hosts that failed on their own (a hang's diagnosis when it hung)."""
        if self.hang_reason:
            return self.hang_reason
        failures = self.failures()
        if not failures:
            return "the job failed without a report from any host"
        return self._reasons[root_cause(failures).host]

    def train(self, private: bool) -> tuple[str, str]:
        """Run the drivers; a failure that a retry may cure (container/failure.py `retry_class`) starts the
        whole job again, up to `max_retry_attempts` times: the built-in trainer (and a script that calls
        `load_checkpoint`) resumes from the last committed checkpoint. Each attempt is recorded in the status
        document's `Attempts`. Returns (outcome, FailureReason)."""
        st = self.status
        attempt = 1
        deadline = time.monotonic() + self.spec.max_run  # max_run bounds the attempts together
        while True:
            spec, started = self.spec, now_iso()
            self.start_drivers(private)
            outcome = self.monitor(deadline)  # poll
            reason = self.failure_reason() if outcome == "Failed" else ""
            decision = attempts.decide(  # decide
                outcome=outcome, reason=reason, attempt=attempt, max_retry_attempts=spec.max_retry_attempts,
                instance_count=spec.instance_count, stopping=self.stop_requested(),
                lost_hosts=self.lost_hosts() if spec.elastic and outcome == "Failed" else (),
                elastic_min=spec.elastic.min_instance_count if spec.elastic else None)
            attempts.record(st, attempt, outcome, reason, decision.retry_class, StartTime=started, EndTime=now_iso(),
                            InstanceCount=spec.instance_count)
            if decision.action == "end":  # act
                if decision.why and decision.retry_class is None:
                    _log(decision.why)
                return outcome, reason
            if decision.action == "shrink":
                try:
                    self.shrink(decision.hosts)
                except ConfigError as e:
                    return outcome, f"{reason}\nelastic: {e}"
            attempt += 1
            _log(f"{decision.why}; restarting the whole job from its last committed checkpoint, attempt {attempt} of "
                 f"{spec.max_retry_attempts + 1}")
            st.transition("Restarting", f"{decision.why}; attempt {attempt} of {spec.max_retry_attempts + 1}")
            self.next_attempt(private)
            if decision.action == "shrink" and self.spec.channels:
                self.stage_channels()  # each host's share of a sharded channel changes with the host count
            st.transition("Training", f"attempt {attempt}: training on {self.spec.instance_count} host(s) x "
                                      f"{spec.processes_per_host} process(es)")

    def lost_hosts(self) -> list[str]:
        """Hosts whose driver vanished without a report: with `elastic`, lost for good (a local host stands
        for an instance that cannot come back)."""
        return [h for h, code in self.exits.items()
                if code not in (0, 128 + signal.SIGTERM) and h not in self.terminated
                and not os.path.exists(f"{self.jobdir}/hosts/{h}.status.json")]

    def shrink(self, count: int) -> JobSpec:
        """The job on its first `count` hosts from now on: the spec (and its layout) checked again for them.
        Raises ConfigError when the layout does not fit."""
        self.spec = self.spec.evolve(instance_count=count)  # validates the layout on the smaller world
        return self.spec

    def next_attempt(self, private: bool) -> None:
        """Forget the ended attempt: every process of it gone, its hosts' reports removed, a new rendezvous
        port in the contract."""
        self.kill_everything()
        self.drivers, self.exits, self._reasons, self.hang_reason, self.terminated = {}, {}, {}, "", set()
        if self.hang_watch is not None:
            self.hang_watch = HangWatch(self.hang_watch.pattern, self.hang_watch.timeout_s)
        for host in self.spec.hosts:
            try:
                os.remove(f"{self.jobdir}/hosts/{host}.status.json")
            except FileNotFoundError:
                pass
        self.runtime["master_port"] = free_port()
        self.prepare_hosts(private)

    def run(self) -> int:
        set_subreaper()
        space.reserve(self.jobdir)  # room for the final status, whatever fills the disk (job/space.py)
        write_json(f"{self.jobdir}/supervisor.json", {"pid": os.getpid(), "started": now_iso()})
        spec, st = self.spec, self.status
        outcome, reason = "Failed", ""
        try:
            st.transition("PreparingTrainingStack", "Preparing the hosts: /opt/ml, network, contract files")
            private = self.engine is not None or (  # a container sees its host's folder at /opt/ml
                self.runtime.get("private_opt_ml", True) and private_opt_ml_works(self.jobdir))
            st.update(PrivateOptMl=private)
            if spec.emulated_network is not None:
                self.network_up()
            self.prepare_hosts(private)
            st.transition("Downloading", f"Downloading input data ({len(spec.channels)} channel(s))")
            self.stage_channels()
            self.record_phases()
            if self.stop_requested():
                outcome = self.stop_reason
            else:
                st.transition("Training", f"Training on {spec.instance_count} host(s) x {spec.processes_per_host} "
                                          f"process(es); /opt/ml is {'private per host' if private else 'the host folder'}")
                outcome, reason = self.train(private)
        except Exception as e:
            outcome, reason = "Failed", f"{type(e).__name__}: {e}"
        finally:
            self.kill_everything()
            self.drain_logs()
            try:
                self.network_down()
            except Exception as e:  # never lose the job's final status over a cleanup error
                _log(f"warning: removing the emulated network failed: {e}")
        try:
            self.record_phases(ended=True)
        except Exception as e:  # never lose the job's final status over its timings
            _log(f"warning: recording the hosts' phases failed: {e}")
        artifacts = os.path.exists(f"{self.jobdir}/hosts/{spec.hosts[0]}.status.json")
        record_outcome(st, spec, outcome, reason, artifacts=artifacts, log=_log)
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    jobdir = argv[0]
    _log(f"supervisor pid {os.getpid()} for {jobdir}")
    return Supervisor(jobdir).run()


if __name__ == "__main__":
    sys.exit(main())
