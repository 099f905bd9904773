"""The in-container driver: contract in, the host's processes, failure file and artifacts out.

    python -m trainyard.container.driver [--root /opt/ml] [--log-dir DIR] [--status-file PATH]

1. reads `<root>/input/config/trainyard.json` and renders the contract again to get the SM_* environment;
2. fetches the code (`sourcedir.tar.gz`) into `<root>/code`;
   with a `requirements.txt` there, pip installs it into an overlay (trainyard/container/requirements.py),
   put first on PYTHONPATH and PATH for every rank; so it does the framework versions the job asks for that
   the environment lacks (`transformers_version='4.26'` beside transformers 5: `framework_pins`);
3. sets the NCCL/EFA variables that the devices it finds call for (trainyard/container/efa.py; the job's own values
   win) and logs one line saying what it found and set;
4. with `TRAINYARD_BANDWIDTH_PROBE=1` in the job's environment, runs the bandwidth probe
   (trainyard/container/probe.py) first, started as in 5: same hosts and processes, its own rendezvous port (so
   does the job's `health_check`: trainyard/container/health.py);
5. starts the host's processes as torchrun would with a static rendezvous (trainyard/container/launcher.py: the
   same variables, without importing torch; a failure comes back as structured data: rank, exit code or signal),
   every rank's output prefixed `[algo-2/3]`;
   a job without a distribution runs its entry point as one plain `python` process instead, as SageMaker does
   (trainyard/container/plainrun.py, `JobSpec.launcher`);
6. on failure writes `<root>/output/failure` (never over one the user wrote) naming host, rank, exit code or
   signal and the rank's last lines;
7. on the first host, tars `<root>/model` and `<root>/output/data` to `<output_path>/<job>/output/`.

It times what it does as the host's phases (trainyard/container/phases.py) in `--phases-file`: `capacity`
(when the local supervisor says when it spawned this driver), `code`, `probe`, `first_step` (the
launch -> the first step seen, trainyard/container/firststep.py) and, on the first host, `upload`.

Folders mirrored to object storage while the job runs and a last time when it ends, whatever the outcome
(`folder_sync.FolderSync`, `start_syncs`): with `checkpoint_s3_uri`, a user script's checkpoint folder, restored
before it starts (`ckpt_sync.CheckpointSync`; the built-in trainer writes to the URI itself); with
`tensorboard_output_config`, the TensorBoard folder; with a profiler, the traces folder. A file that cannot be
uploaded fails the job, naming it.

Exit status: 0 success, 1 failure, 128+N when stopped by signal N.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from trainyard.container import efa, lifeline, requirements
from trainyard.container.hostnames import RESOLVES_ENV
from trainyard.job import catalog, lease, space, storage
from trainyard.job.jsonio import write_json
from trainyard.job.spec import BUILTIN_TRAINER, JobSpec
from trainyard.job.plan.hardware import bf16_peak_tflops
from trainyard.container.ckpt_sync import CheckpointSync
from trainyard.container.codefetch import fetch_code
from trainyard.container.contract import JOB_FILE, PLATFORM_ENV, render_contract, under_root, user_args
from trainyard.container.folder_sync import DEFAULT_INTERVAL_S, FolderSync
from trainyard.container.failure import RankFailure, headline
from trainyard.container.hang import HANG_WATCH_ENV, HostHangWatch, heartbeat_dir
from trainyard.engine.components.contract import FIRST_STEP_ENV
from trainyard.engine.components.process_exit import exit_now
from trainyard.engine.components.heartbeat import ENV as HEARTBEAT_ENV
from trainyard.container.firststep import FirstStepWatch, rank_logs
from trainyard.container.metricship import METRICS_FILE
from trainyard.container.launcher import run_processes
from trainyard.container.plainrun import build_plain_command, run_plain
from trainyard.container.phases import FIRST_STEP, HOST_PHASES_FILE, REQUESTED_ENV, PhaseLog
from trainyard.job.jsonio import now_iso
from trainyard.job.logstamp import stamped

PROBE_MODULE = "trainyard.container.probe"
HEALTH_MODULE = "trainyard.container.health"
WORKER_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_site")
PROBE_ENV = "TRAINYARD_BANDWIDTH_PROBE"
# the probe's whole run: a torch import per rank, rendezvous, a few all-reduces; minutes mean trouble
PROBE_TIMEOUT_S = 300.0
PROBE_STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL for a pre-flight check past its time
# seconds between scans of the synced folders: checkpoints, and the TensorBoard and profiler outputs
CHECKPOINT_SYNC_ENV = "TRAINYARD_CHECKPOINT_SYNC_S"
OUTPUT_SYNC_ENV = "TRAINYARD_OUTPUT_SYNC_S"


def launch_line(spec: JobSpec, index: int, master_addr: str, master_port: int) -> str:
    """What the host starts, in one short line: the entry point and its arguments as the user gave them, the
    processes, and where they meet (launcher.py), or that it runs once as plain python (`plainrun`)."""
    entry = " ".join([spec.entry_point if spec.entry_kind == "script" else f"-m {spec.entry_point}",
                      *user_args(spec.hyperparameters)])
    where = f"host {index + 1} of {spec.instance_count}"
    if spec.launcher == "python":
        return f"launching python {entry} once, {where} (no distribution: no launcher, as on SageMaker)"
    return (f"launching {entry} on {spec.processes_per_host} process(es), {where} (rendezvous at "
            f"{master_addr}:{master_port})")


def _say(host: str, msg: str) -> None:
    print(f"[{host}] driver: {msg}", flush=True)


def configure_network(host: str, environ=None, detect=efa.detect) -> None:
    """Add the NCCL/EFA variables the devices call for to `environ` (default: this process's) and log one
    line: `[algo-1] driver: EFA: 4 device(s), aws-ofi-nccl 1.9.1; set FI_EFA_USE_HUGE_PAGE=0 ...`. A host
    with neither GPUs nor EFA devices (a CPU host: gloo, no NCCL) gets the same variables and no line."""
    environ = os.environ if environ is None else environ
    try:
        found = detect()
        line = efa.configure(environ, found)
        environ.setdefault("TRAINYARD_EFA_DEVICES", str(len(found.efa_devices)))  # the engine's fingerprint
        if not found.gpus and not found.efa_devices:
            return
    except Exception as e:  # detection must never fail a job: NCCL then runs on its own defaults
        line = f"EFA/NCCL detection failed ({type(e).__name__}: {e}); set nothing"
    _say(host, line)


def probe_requested(environ) -> bool:
    return environ.get(PROBE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def probe_port(master_port: int, environ) -> int:
    """The probe's rendezvous port: `TRAINYARD_PROBE_PORT`, or the one after the job's. Not the job's own:
    a host that finished the probe early would otherwise reach the master's probe store, still closing,
    instead of the training one."""
    return int(environ.get("TRAINYARD_PROBE_PORT") or master_port + 1)


def run_check(run: HostRun, module: str, args: list[str], log_dir: str, port: int, timeout: float) -> int | None:
    """A pre-flight check (the bandwidth probe, the health check: `module`) on the job's hosts and processes, started
    as the job's own are (launcher.py) at its own rendezvous `port`, its ranks' files under `log_dir`. Returns its
    exit status, or None when it ran past `timeout` and was stopped. A signal that stopped the driver meanwhile (the
    launcher passed it on to the check's ranks) is raised again here: it ends the driver as it would have without
    the check, never a training started after it."""
    spec = run.spec
    code, _ = run_processes([sys.executable, "-u", "-m", module, *args], run.code_dir, host=run.host,
                            node_rank=run.index, nnodes=spec.instance_count, nproc=spec.processes_per_host,
                            master_addr=run.master_addr, master_port=port, log_dir=log_dir, grace=PROBE_STOP_GRACE_S,
                            timeout=timeout, preload=(module,))
    if code is not None and code > 128:
        signal.raise_signal(code - 128)
    return code


def run_training(launch: Callable[[], tuple[int, RankFailure | None]], host: str, log_dir: str, *, phases: PhaseLog,
                 metrics_file: str, regexes: list[str],
                 hang_timeout_s: float | None = None) -> tuple[int, RankFailure | None, str]:
    """`launch()` (`launcher.run_processes`, or `plainrun.run_plain`: their ranks' files under `log_dir`), timed as the
    `first_step` phase: from here to the first step the watch sees; no step seen, no phase. Where the driver watches
    its own ranks for hangs (`TRAINYARD_HANG_WATCH=driver`: EC2 nodes), the third value is the hang's diagnosis once
    the watch fired ("" otherwise)."""
    phases.start(FIRST_STEP)
    marker = os.path.join(log_dir, "first-step")  # the engine creates it after its first step (on every rank)
    if os.path.exists(marker):
        os.remove(marker)
    os.environ[FIRST_STEP_ENV] = marker
    beats = heartbeat_dir(log_dir)  # every rank's heartbeat and, on a hang, its stacks (container/hang.py)
    shutil.rmtree(beats, ignore_errors=True)
    os.environ[HEARTBEAT_ENV] = beats
    # NCCL jobs: torch's flight recorder keeps the last collectives of each rank and dumps them next to the
    # heartbeats when NCCL's watchdog times out (no effect with gloo)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(beats, "nccl_trace_rank_"))
    watch = FirstStepWatch(metrics_file, rank_logs(log_dir), regexes, lambda t: phases.end(FIRST_STEP, t),
                           marker=marker).start()
    hangs = None
    if os.environ.get(HANG_WATCH_ENV) == "driver" and hang_timeout_s:
        hangs = HostHangWatch(beats, hang_timeout_s, say=lambda m: _say(host, m)).start()
    try:
        code, failure = launch()
        return code, failure, hangs.reason if hangs is not None else ""
    finally:
        watch.stop()
        if hangs is not None:
            hangs.stop()
        if not watch.seen:
            phases.drop(FIRST_STEP)


def start_syncs(spec: JobSpec, root: str, env: dict, say, syncs: list[FolderSync]) -> None:
    """Start mirroring this host's job folders to object storage, appending each to `syncs` as it starts (so that
    the caller stops every one that started, even when a later one fails): a user script's checkpoint folder,
    restored first (the built-in trainer reads and writes checkpoint_s3_uri itself), the TensorBoard folder (event
    files grow every step: each scan uploads what changed) and the profiler's traces folder."""
    def interval(name: str) -> float:
        return float(env.get(name) or DEFAULT_INTERVAL_S)

    on_sagemaker = env.get(PLATFORM_ENV) == "sagemaker"  # SageMaker syncs the checkpoint and TensorBoard folders
    if spec.checkpoint_s3_uri and spec.entry_point != BUILTIN_TRAINER and not on_sagemaker:
        sync = CheckpointSync(env["SM_CHECKPOINT_DIR"], spec.checkpoint_s3_uri, interval=interval(CHECKPOINT_SYNC_ENV),
                              say=say)
        restored = sync.restore()
        if restored:
            say(f"restored {restored} checkpoint file(s) from {spec.checkpoint_s3_uri}")
        syncs.append(sync.start())
    tb = spec.tensorboard_output_config
    if tb is not None and not on_sagemaker:
        syncs.append(FolderSync(under_root(tb.container_local_output_path, root), tb.uri(spec.job_name),
                                interval=interval(OUTPUT_SYNC_ENV), settle=False, say=say, what="tensorboard").start())
    prof = spec.profiler
    if prof is not None:
        syncs.append(FolderSync(under_root(prof.local_path, root), prof.uri(spec.output_path, spec.job_name),
                                interval=interval(OUTPUT_SYNC_ENV), say=say, what="profiler").start())


def stop_syncs(syncs: list[FolderSync], status: dict) -> str:
    """The last sync of every folder; returns what could not be uploaded ("" when everything was), and counts the
    files each uploaded in `status` (`checkpoint_files_uploaded`, `tensorboard_files_uploaded`, ...)."""
    problems = []
    for sync in syncs:
        lost = sync.stop()
        status[f"{sync.what}_files_uploaded"] = sync.files_uploaded
        if lost:
            problems.append(f"{len(lost)} {sync.what} file(s) could not be uploaded to {sync.uri}: "
                            + "; ".join(f"{k}: {v}" for k, v in sorted(lost.items())[:3]))
    return "; ".join(problems)


def upload_artifacts(spec, root: str) -> list[str]:
    """Tar the model and the output data to `<output_path>/<job>/output/`. Returns the URIs written."""
    prefix = storage.output_prefix(spec.output_path, spec.job_name)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for src, name in ((f"{root}/model", "model.tar.gz"), (f"{root}/output/data", "output.tar.gz")):
            archive = os.path.join(tmp, name)
            with tarfile.open(archive, "w:gz") as tar:
                for entry in sorted(os.listdir(src)) if os.path.isdir(src) else []:
                    tar.add(os.path.join(src, entry), arcname=entry)
            storage.put_file(archive, f"{prefix}/{name}")
            written.append(f"{prefix}/{name}")
    return written


def write_failure(root: str, reason: str) -> None:
    """`<root>/output/failure`, unless the user's script already wrote one; written on a full disk too (the
    reserve, job/space.py)."""
    path = f"{root}/output/failure"
    if os.path.exists(path) and os.path.getsize(path) > 0:
        return

    def write() -> None:
        with open(path, "w") as fh:
            fh.write(reason)

    space.write_anyway(root, write)


FULL_BYTES = 2 << 20  # less free space than this when a job fails (beside our 1 MiB reserve): the disk filled


def full_disk(root: str, reason: str) -> str:
    """When the job failed because the disk filled (its error says so, or the disk is full now: the rank's own
    error may not have reached a log on that disk): the reason, with the file system named, after the files of
    the model folder are removed (written on a full disk, they may be partial; and they hold the space)."""
    free = space.free_bytes(root)
    said = "No space left on device" in reason or "Errno 28" in reason
    if not said and (free is None or free >= FULL_BYTES):
        return reason
    removed = []
    for dirpath, _, names in os.walk(f"{root}/model"):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                os.remove(path)
                removed.append(os.path.relpath(path, f"{root}/model"))
            except OSError:
                pass
    note = f"no space left on device on the file system of {root} ({space.free_bytes(root)} bytes free now)"
    if not said:
        note += " (the rank's own error may be lost: its log is on that disk)"
    if removed:
        note += f"; removed the model folder's files, which may be partial: {', '.join(removed[:5])}"
    return f"{reason}\n{note}"


@dataclass
class HostRun:
    """One host's run of the job, as `prepare` read it from the contract files."""
    spec: JobSpec
    job: dict
    index: int
    host: str
    root: str
    master_addr: str
    status_file: str
    log_dir_arg: str | None
    phases: PhaseLog
    status: dict = field(default_factory=dict)

    @property
    def code_dir(self) -> str:
        return f"{self.root}/code"

    def say(self, msg: str) -> None:
        _say(self.host, msg)


def prepare(argv: list[str] | None) -> HostRun:
    """The host's job from `<root>/input/config/trainyard.json`, its contract in this process's environment, an
    earlier attempt's failure report gone, room reserved for the last reports, the supervisor watched."""
    started = now_iso()  # this host runs: the end of its `capacity` phase
    p = argparse.ArgumentParser(prog="python -m trainyard.container.driver")
    p.add_argument("--root", default=os.environ.get("TRAINYARD_ML_ROOT", "/opt/ml"))
    p.add_argument("--log-dir", default=None, help="the ranks' log files (default: a temporary folder)")
    p.add_argument("--status-file", default=None, help="JSON result of this host (default: <root>/output/host-status.json)")
    p.add_argument("--phases-file", default=None,
                   help=f"this host's phase timings (default: <root>/{HOST_PHASES_FILE})")
    a = p.parse_args(argv)
    # the launcher's follower threads and ours share stdout: each write a whole line (see worker_site/sitecustomize.py)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)
    root = a.root.rstrip("/")
    phases = PhaseLog(a.phases_file or f"{root}/{HOST_PHASES_FILE}")
    requested = os.environ.pop(REQUESTED_ENV, None)  # not for the ranks: they inherit this environment
    if requested:
        phases.add("capacity", requested, started)

    with open(f"{root}/{JOB_FILE}") as fh:
        job = json.load(fh)
    spec = JobSpec.model_validate(job["spec"])
    index = job["host_index"]
    host = spec.hosts[index]
    # SageMaker's MASTER_ADDR is the first host's name; where every program of this host resolves it
    # (container/hostnames.py), the launcher gets the name too, so the ranks see MASTER_ADDR=algo-1
    master_addr = spec.hosts[0] if os.environ.get(RESOLVES_ENV) == "1" else job["master_addr"]
    contract = render_contract(spec, index, root=root, master_addr=master_addr, master_port=job["master_port"],
                               network_interface=job["network_interface"], num_cpus=job["num_cpus"])
    os.environ.update(contract.env)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # every line of rank R on this host reaches the log as "[algo-2/R] ..."
    os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = f"[{host}/${{rank}}] "
    run = HostRun(spec=spec, job=job, index=index, host=host, root=root, master_addr=master_addr,
                  status_file=a.status_file or f"{root}/output/host-status.json", log_dir_arg=a.log_dir,
                  phases=phases, status={"host": host, "started": time.time()})
    try:  # an earlier attempt's report in this host's folder (local retries reuse it) is not this attempt's
        os.remove(f"{root}/output/failure")
    except FileNotFoundError:
        pass
    space.reserve(root)  # room for the failure report and the status on a full disk (job/space.py)
    lifeline.watch(lambda: _supervisor_lost(host, root, run.status_file, run.status))
    return run


def install_code(run: HostRun) -> None:
    """The job's code in `<root>/code`, its requirements.txt in an overlay every rank sees first, and the
    ranks' site (each ends its process group at exit if the script did not: worker_site/sitecustomize.py)."""
    spec = run.spec
    with run.phases.timed("code", enabled=bool(spec.code_uri)):
        if spec.code_uri:
            run.say(f"fetching code from {spec.code_uri}")
            fetch_code(spec.code_uri, run.code_dir)
        if spec.entry_kind == "script" and not os.path.isfile(os.path.join(run.code_dir, spec.entry_point)):
            raise FileNotFoundError(f"entry point {spec.entry_point!r} is not in the code at {spec.code_uri}")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (WORKER_SITE, os.environ.get("PYTHONPATH")) if p)
        pins = requirements.framework_pins(spec.framework, run.code_dir)  # transformers_version='4.26', ...
        overlay = requirements.prepare(run.code_dir, requirements.default_cache_root(), say=run.say, pins=pins)
        if overlay is not None:
            overlay.activate(os.environ)
            run.say(f"requirements.txt: {overlay.summary()}")


def probe(run: HostRun, log_dir: str) -> None:
    """With TRAINYARD_BANDWIDTH_PROBE=1, the bandwidth probe on every host and process; its failure is said,
    and training starts all the same."""
    spec = run.spec
    if not probe_requested(os.environ):
        return
    if spec.world_size <= 1:
        run.say("bandwidth probe skipped: the job has one process, nothing crosses a link")
        return
    port = probe_port(run.job["master_port"], os.environ)
    timeout = float(os.environ.get("TRAINYARD_BANDWIDTH_PROBE_TIMEOUT_S", PROBE_TIMEOUT_S))
    run.say(f"bandwidth probe: {spec.world_size} process(es), rendezvous on port {port}")
    with run.phases.timed("probe"):
        probe_code = run_check(run, PROBE_MODULE, [], os.path.join(log_dir, "probe"), port, timeout)
    if probe_code != 0:
        why = f"ran past {timeout:.0f} s" if probe_code is None else f"exited with status {probe_code}"
        run.say(f"bandwidth probe {why}; training starts all the same")


# what a healthy GPU's bf16 matmul of the check reaches, as a share of its datasheet peak (an H100 reaches 0.7-0.8):
# the figure a host alone is held to, where it has no peers to be compared with
HEALTHY_MATMUL_SHARE = 0.6


def expected_matmul_tflops(instance_type: str) -> float | None:
    """HEALTHY_MATMUL_SHARE of the instance type's GPU's bf16 datasheet peak (the planner's table); None for a CPU
    host or a GPU the table lacks."""
    peak = bf16_peak_tflops(instance_type)
    return round(HEALTHY_MATMUL_SHARE * peak, 1) if peak else None


def health_check(run: HostRun, log_dir: str) -> str:
    """With the job's `health_check`, the pre-flight check on every host and process (container/health.py): each
    host's figures said, the first host's written as a metrics row (`health_check`: describe()'s HealthCheck and
    the report read it); returns the reason to fail the job with ("" to train)."""
    spec, check = run.spec, run.spec.health_check
    if check is None:
        return ""
    out = os.path.join(log_dir, "health")
    shutil.rmtree(out, ignore_errors=True)
    port = probe_port(run.job["master_port"], os.environ) + 1  # beside the probe's: never the job's own
    expected = expected_matmul_tflops(spec.instance_type)
    args = ["--out", out, "--min-ratio", str(check.min_ratio)] + (
        ["--expected-tflops", str(expected)] if expected else []) + (
        ["--turns"] if catalog.lookup(spec.instance_type).is_local else [])  # emulated hosts share this machine
    run.say(f"health check: {spec.world_size} process(es) on {spec.instance_count} host(s), rendezvous on port {port}")
    with run.phases.timed("health"):
        code = run_check(run, HEALTH_MODULE, args, os.path.join(log_dir, "health-logs"), port,
                         float(os.environ.get("TRAINYARD_HEALTH_CHECK_TIMEOUT_S", PROBE_TIMEOUT_S)))
    try:
        with open(os.path.join(out, "health.json")) as fh:
            result = json.load(fh)
    except (OSError, ValueError):
        why = "ran past its time" if code is None else f"exited with status {code} and wrote no figures"
        reason = f"Health check: the check itself {why} on {run.host} (its ranks' output is in the job's log)"
        if check.on_failure == "continue":
            run.say(f"{reason}; training starts all the same (health_check on_failure='continue')")
            return ""
        return reason
    for host, h in result["hosts"].items():
        figures = [f"compute {h['compute_tflops']:.3g} TFLOP/s" + (f" ({h['ratio']:.2f}x its peers)" if h["ratio"]
                                                                   else "")]
        figures += [f"{what} all-reduce {h[key]:.3g} GB/s" for key, what in (("intra_gbps", "intra-host"),
                                                                               ("inter_gbps", "inter-host"))
                    if h[key] is not None]
        if h["efa"]["devices"]:
            figures.append(f"EFA {h['efa']['devices']} device(s), provider {h['efa']['provider'] or 'unset'}")
        run.say(f"health check: {host}: {', '.join(figures)}")
    unjudged = result.get("unjudged") or []
    if unjudged:
        run.say(f"health check: {', '.join(unjudged)}: no other host and no figure expected of {spec.instance_type} "
                "to compare its compute with: not judged")
    going_on = bool(result["slow"]) and check.on_failure == "continue"
    if run.index == 0:  # one row for the job: the first host's metrics file, shipped and mirrored as the others
        row = {"timestamp": time.time(), "health_check": result}
        if going_on:  # describe()'s Warnings
            row["warnings"] = [f"{result['reason']}; training went on (health_check on_failure='continue')"]
        metrics = f"{run.root}/output/data/{METRICS_FILE}"
        os.makedirs(os.path.dirname(metrics), exist_ok=True)
        with open(metrics, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    if not result["slow"]:
        return ""
    if going_on:
        run.say(f"{result['reason']}; training starts all the same (health_check on_failure='continue')")
        return ""
    return result["reason"]


def preloaded(entry_point: str, entry_kind: str, checkpoint_s3_uri: str | None = None) -> tuple[str, ...]:
    """What the host's processes import once before they are forked (launcher.py, preload.py): trainyard's own
    entry modules (the built-in trainer), whose imports read no process's own variable, and with checkpoints in S3
    s3fs, which the trainer imports when it looks for one to resume (0.8 s of CPU a process: aiobotocore, aiohttp
    and, where installed, httpx2); a user's script or module starts in a fresh interpreter, as under torchrun."""
    if entry_kind != "module" or entry_point.split(".")[0] != "trainyard":
        return ()
    return (entry_point, "s3fs") if checkpoint_s3_uri else (entry_point,)


def train(run: HostRun, log_dir: str) -> tuple[int, RankFailure | None, str]:
    """The job's entry point on the host's processes (launcher.py), or as one plain process (`JobSpec.launcher`):
    (exit code, the failed rank, FailureReason)."""
    spec = run.spec
    port, args = run.job["master_port"], user_args(spec.hyperparameters)
    if spec.launcher == "python":
        launch = functools.partial(run_plain, build_plain_command(spec.entry_point, spec.entry_kind, args),
                                   run.code_dir, host=run.host, rank=run.index, log_dir=log_dir,
                                   master_addr=run.master_addr, master_port=port)
    else:
        cmd = build_plain_command(spec.entry_point, spec.entry_kind, args)
        launch = functools.partial(run_processes, [cmd[0], "-u", *cmd[1:]],  # unbuffered, as torchrun runs them
                                   run.code_dir, host=run.host, node_rank=run.index, nnodes=spec.instance_count,
                                   nproc=spec.processes_per_host, master_addr=run.master_addr, master_port=port,
                                   log_dir=log_dir, preload=preloaded(spec.entry_point, spec.entry_kind,
                                                                     spec.checkpoint_s3_uri))
    run.say(launch_line(spec, run.index, run.master_addr, port))
    code, failure, hang = run_training(launch, run.host, log_dir, phases=run.phases,
                                       metrics_file=f"{run.root}/output/data/{METRICS_FILE}",
                                       regexes=[d["Regex"] for d in spec.metric_definitions],
                                       hang_timeout_s=spec.hang_timeout_s)
    if hang:
        return 1, failure, hang  # its ranks were ended by the watch: the diagnosis says why
    return code, failure, failure.reason() if failure is not None else ""


def finish(run: HostRun, code: int, failure: RankFailure | None, reason: str, lost: str) -> int:
    """The host's end, whatever the outcome: a sync that lost files fails the job, the failure report (never
    over the user's), the artifacts from the first host, and the status file. Returns the exit status."""
    host, root, status = run.host, run.root, run.status
    if lost:
        message = f"{host} driver: {lost}"
        run.say(message)
        if code == 0:
            code, reason = 1, message
    status.update(exit_code=code, finished=time.time())
    if code == 1:
        reason = full_disk(root, reason)
        write_failure(root, reason)
        with open(f"{root}/output/failure") as fh:
            reason = fh.read(1024)
        run.say("FAILED: " + headline(reason))
    if run.index == 0 and os.environ.get(PLATFORM_ENV) == "sagemaker":
        run.say("SageMaker uploads /opt/ml/model and /opt/ml/output/data")
    elif run.index == 0:  # artifacts are uploaded whatever the outcome: nothing is lost on failure or stop
        try:
            run.say("uploading model and output data")
            with run.phases.timed("upload"):
                status["artifacts"] = upload_artifacts(run.spec, root)
        except Exception as e:
            if code == 0:
                code, reason = 1, f"{host} driver: uploading artifacts failed: {type(e).__name__}: {e}"
                write_failure(root, reason)
            run.say(f"uploading artifacts failed: {e}")
    status.update(exit_code=code, reason=reason, failure=failure.to_dict() if failure else None)
    space.write_anyway(root, lambda: write_json(run.status_file, status))
    run.say({0: "completed", 1: "failed"}.get(code, f"stopped (exit {code})"))
    return code


def main(argv: list[str] | None = None) -> int:
    """prepare -> code -> folder syncs and network -> probe -> train -> finish (the syncs' last pass and the
    first host's lease end before `finish`, whatever happened)."""
    run = prepare(argv)
    failure: RankFailure | None = None
    syncs: list[FolderSync] = []
    # the first host keeps the job's checkpoint locations leased while it runs (job/lease.py)
    leases = lease.Heartbeat(lease.locations(run.spec) if run.index == 0 else [], run.spec.job_name,
                             say=run.say).start()
    try:
        install_code(run)
        start_syncs(run.spec, run.root, os.environ, run.say, syncs)
        configure_network(run.host)
        log_dir = run.log_dir_arg or tempfile.mkdtemp(prefix="trainyard-torchrun-")
        probe(run, log_dir)
        reason = health_check(run, log_dir)
        if reason:  # a host far below its peers: the job fails before training
            code = 1
        else:
            code, failure, reason = train(run, log_dir)
    except Exception as e:  # the driver itself failed: the job fails with that reason
        code, reason = 1, f"{run.host} driver: {type(e).__name__}: {e}"
    lifeline.yield_if_lost()  # the supervisor is gone: its thread ends this driver and says why
    with finishing(run.say):
        lost = stop_syncs(syncs, run.status)  # the last sync runs whatever the outcome
        leases.stop()
        return finish(run, code, failure, reason, lost)


@contextlib.contextmanager
def finishing(say: Callable[[str], None]):
    """A SIGTERM while the host finishes (the last sync, the upload of the model and output data, its report) is
    noted, not obeyed: it used to end the driver there at once, the upload cut short and no report written, so the
    supervisor took a host it had stopped itself for a lost one. Whoever stops the host still bounds this with its
    SIGKILL (the local supervisor after STOP_GRACE_S, as SageMaker after 120 s)."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's (in-process tests)
        yield
        return
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if got:
            say("asked to stop while finishing: finished first")


def _supervisor_lost(host: str, root: str, status_file: str, status: dict) -> None:
    """The lifeline broke: the supervisor (or node agent) is gone. Every process below this one is killed at
    once, the reason written where it is read without the supervisor (the failure file, this host's status,
    the host's log file when the supervisor named it), and the driver exits (container/lifeline.py)."""
    lifeline.kill_below(os.getpid())
    message = "the job's supervisor ended while the job ran; this host's ranks were stopped"
    reason = f"{host} driver: {message}"
    try:
        write_failure(root, reason)
        write_json(status_file, {**status, "exit_code": 1, "reason": reason, "finished": time.time()})
        log = os.environ.get(lifeline.HOST_LOG_ENV)
        if log:  # the supervisor pumped our output into it; now nobody reads the pipe
            with open(log, "a") as fh:
                fh.write(stamped(f"[{host}] driver: {message}") + "\n")
    finally:
        os._exit(1)


if __name__ == "__main__":
    exit_now(main())  # after the exit handlers, without the interpreter's teardown
