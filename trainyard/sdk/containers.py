"""Local jobs inside the training image: with `image_uri`, each emulated host is a container of that image, as
SageMaker local mode runs its image, and everything else about the job stays as in host mode.

    engine = find_engine()                         # ("podman", "/usr/bin/podman"), or docker with a daemon
    check_image(engine, ref)                       # exists here, built from this SDK's version
    cmd = run_command(engine, ref, job, host, ...) # podman run ... <image> python -m trainyard.container.driver ...
    remove_all(engine, job)                        # every container of the job, whatever state it is in

A host's container:
- binds the host's folder at `/opt/ml` and the job's folder at its own path (the driver writes its status,
  phases and torchrun's logs there, where the supervisor reads them, and the ranks' heartbeats, which the
  supervisor's hang watch reads);
- runs in this machine's network namespace, or, with `emulated_network`, in the host's namespace with its
  shaped link (`--network ns:...`); `algo-1..N` resolve inside it (`--add-host`), so the driver gives torchrun
  `algo-1` as the master address; the store is reached as in host mode (loopback, or the emulated network's
  relay);
- shares this machine's process ids (`--pid host`): the ranks' heartbeats name pids the supervisor can signal
  when it diagnoses a hang (so no `--init`, which needs a namespace of its own: the driver is the container's
  first process, gets the stop signal the engine forwards, and this machine's init reaps what is orphaned);
- gets the supervisor's lifeline as its descriptor 3 (`--preserve-fds 1`): when the supervisor ends, the driver
  inside kills its ranks, as in host mode;
- has the open-file and process limits this process has (podman asks for more than root may set on some
  machines) and a /dev/shm of SHM_BYTES (the 64 MB default is too small for data-loader workers);
- runs under runc where the engine's runtime is crun and the machine has a hybrid cgroup hierarchy (v1
  controllers and a v2 mount beside them), which crun 1.8 refuses (`run_options`).
Every container carries the label `trainyard.job=<job>`; `remove_all` is run at the end of every attempt and
of the job, so no container outlives it.
"""
from __future__ import annotations

import functools
import json
import resource
import shutil
import subprocess
from collections.abc import Callable, Mapping

from trainyard.job.errors import ConfigError

ENGINES = ("podman", "docker")  # podman first: no daemon
LABEL = "trainyard.job"
SHM_BYTES = 1 << 30
LIFELINE_FD = 3  # where --preserve-fds 1 puts the lifeline in the container
VERSION_LABEL = "org.opencontainers.image.version"


def find_engine(which: Callable[[str], str | None] = shutil.which, runner=subprocess.run) -> tuple[str, str]:
    """(name, path) of the engine that runs local hosts in containers: podman, or docker with a reachable daemon.
    ConfigError naming what to install."""
    for name in ENGINES:
        path = which(name)
        if not path:
            continue
        if name == "docker" and runner([path, "version", "--format", "{{.Server.Version}}"], capture_output=True,
                                       text=True, check=False).returncode != 0:
            continue  # a client without a daemon
        return name, path
    raise ConfigError("image_uri", "a local job in an image needs podman (`sudo apt-get install podman` on "
                                   "Debian/Ubuntu, `sudo dnf install podman` on Fedora) or docker with its daemon "
                                   "running; or drop image_uri to run the hosts as processes of this machine")


def check_image(engine: tuple[str, str], ref: str, sdk_version: str, runner=subprocess.run) -> None:
    """The image is in the engine's store and holds this SDK's Trainyard (the driver's contract with the SDK)."""
    name, path = engine
    r = runner([path, "image", "inspect", "--format", "{{json .Config.Labels}}", ref], capture_output=True, text=True,
               check=False)
    if r.returncode != 0:
        raise ConfigError("image_uri", f"{ref} is not in {name}'s images: a local job with image_uri runs each host "
                                       "in a Trainyard image; build one with `trainyard image build --variant cpu` "
                                       "(it prints the reference) or pull it, or drop image_uri to run the hosts as "
                                       "processes of this machine")
    labels = json.loads(r.stdout.strip() or "{}") or {}
    version = labels.get(VERSION_LABEL)
    if version != sdk_version:
        raise ConfigError("image_uri", f"{ref} holds Trainyard {version or 'of an unknown version'}, and this SDK is "
                                       f"{sdk_version}: the SDK and the driver in the image must be one version; "
                                       "build the image from this checkout (`trainyard image build --variant cpu`), "
                                       "or drop image_uri to run the hosts as processes of this machine")


def container_name(job: str, host: str) -> str:
    return f"{job}-{host}"


def _pid_max() -> int | None:
    try:
        with open("/proc/sys/kernel/pid_max") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def _limits() -> list[str]:
    """This process's open-file and process limits for the container (the engine's defaults may be more than
    this machine lets root set); the process limit at most the kernel's pid_max, which the runtime refuses to
    exceed (measured: 32768 starts, 32769 fails with 'error setting rlimit type 6')."""
    out = []
    for name, which in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        soft, hard = resource.getrlimit(which)
        if hard == resource.RLIM_INFINITY:
            continue  # the engine's default is then allowed
        soft = hard if soft == resource.RLIM_INFINITY else soft
        if name == "nproc" and _pid_max():
            soft, hard = min(soft, _pid_max()), min(hard, _pid_max())
        out += ["--ulimit", f"{name}={soft}:{hard}"]
    return out


def hybrid_cgroups(mounts_file: str = "/proc/self/mounts") -> bool:
    """cgroup v1 controllers mounted, and cgroup2 beside them (not at /sys/fs/cgroup itself)."""
    try:
        with open(mounts_file) as fh:
            kinds = [(line.split()[1], line.split()[2]) for line in fh if len(line.split()) > 2]
    except OSError:
        return False
    return any(t == "cgroup" for _, t in kinds) and any(t == "cgroup2" for _, t in kinds)


def engine_runtime(name: str, path: str, runner=subprocess.run) -> str | None:
    """The OCI runtime podman or buildah runs containers with ("crun", "runc"), None when it does not say."""
    try:
        r = runner([path, "info", "--format", "json"], capture_output=True, text=True, check=False)
        host = json.loads(r.stdout)["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    runtime = host.get("ociRuntime", {}).get("name") if name == "podman" else host.get("OCIRuntime")
    return runtime if isinstance(runtime, str) else None


@functools.lru_cache(maxsize=8)
def runtime_options(name: str, path: str, runner=subprocess.run, which: Callable[[str], str | None] = shutil.which,
                    mounts_file: str = "/proc/self/mounts") -> tuple[str, ...]:
    """`--runtime runc` where podman or buildah would run crun on a hybrid cgroup hierarchy (crun 1.8 fails there:
    "cannot set up cgroups"); nothing elsewhere. ConfigError naming the package when runc is missing."""
    if name not in ("podman", "buildah") or not hybrid_cgroups(mounts_file):
        return ()
    if engine_runtime(name, path, runner) != "crun":
        return ()
    runc = which("runc")
    if not runc:
        raise ConfigError("image_uri", f"{name} runs containers with crun, which fails on this machine's hybrid cgroup "
                                       "hierarchy (v1 controllers with a v2 mount): install runc (`sudo apt-get "
                                       "install runc`; Trainyard then passes --runtime runc)")
    return ("--runtime", runc)


def run_options(engine: tuple[str, str]) -> list[str]:
    """What every container of a job gets for this machine: its limits and, where needed, the runtime."""
    return [*runtime_options(*engine), *_limits()]


def run_command(engine: tuple[str, str], image: str, *, job: str, host: str, jobdir: str, hostdir: str,
                addresses: Mapping[str, str], env: Mapping[str, str], driver_args: list[str],
                netns: str | None = None, mounts: tuple[str, ...] = ()) -> list[str]:
    """The command that runs one host's driver in a container of `image` (see the module docstring). `addresses`:
    each host name's address; `netns`: the emulated network's namespace of this host (None: this machine's
    network); `mounts`: more folders bound at their own path."""
    name, path = engine
    cmd = [path, "run", "--rm", "--name", container_name(job, host), "--label", f"{LABEL}={job}",
           "--hostname", host, "--pid", "host", "--shm-size", str(SHM_BYTES),
           "--network", f"ns:/run/netns/{netns}" if netns else "host", *run_options(engine),
           "--volume", f"{hostdir}:/opt/ml", "--volume", f"{jobdir}:{jobdir}"]
    for folder in mounts:
        cmd += ["--volume", f"{folder}:{folder}"]
    for other, addr in addresses.items():
        cmd += ["--add-host", f"{other}:{addr}"]
    if name == "podman":
        cmd += ["--preserve-fds", "1"]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    return [*cmd, "--workdir", "/opt/ml", image, "python", "-m", "trainyard.container.driver", *driver_args]


def with_lifeline_at_3(cmd: list[str], fd: int) -> list[str]:
    """`cmd` run with descriptor `fd` (the lifeline's read end, handed to the engine) as its descriptor 3, which
    `--preserve-fds 1` passes into the container."""
    return ["sh", "-c", f'exec "$@" 3<&{fd}', "container-host", *cmd]


def remove_all(engine: tuple[str, str], job: str, runner=subprocess.run) -> list[str]:
    """Remove every container of `job` (running or not); returns the names of those still there after."""
    name, path = engine
    r = runner([path, "ps", "-a", "--filter", f"label={LABEL}={job}", "--format", "{{.Names}}"], capture_output=True,
               text=True, check=False)
    names = r.stdout.split()
    if names:
        runner([path, "rm", "-f", "-t", "0", *names] if name == "podman" else [path, "rm", "-f", *names],
               capture_output=True, text=True, check=False)
    r = runner([path, "ps", "-a", "--filter", f"label={LABEL}={job}", "--format", "{{.Names}}"], capture_output=True,
               text=True, check=False)
    return r.stdout.split()
