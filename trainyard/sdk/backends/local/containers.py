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
import hashlib
import json
import os
import resource
import shutil
import subprocess
from collections.abc import Callable, Mapping

import trainyard
from trainyard.errors import ConfigError

ENGINES = ("podman", "docker")  # podman first: no daemon
LABEL = "trainyard.job"
SHM_BYTES = 1 << 30
LIFELINE_FD = 3  # where --preserve-fds 1 puts the lifeline in the container
VERSION_LABEL = "org.opencontainers.image.version"
SOURCE_LABEL = "trainyard.source-digest"


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


def check_image(engine: tuple[str, str], ref: str, sdk_version: str, runner=subprocess.run,
                sdk_sources: str | None = None) -> str | None:
    """The image is in the engine's store and holds this SDK's Trainyard (the driver's contract with the SDK).
    Returns a warning when its Trainyard was built from other sources at the same version (`sdk_sources`: the SDK's
    `image.source_digest`, default: of the installed package), else None."""
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
    if version is None:
        raise ConfigError("image_uri", f"{ref} is not a Trainyard image (it has no {VERSION_LABEL} label): a local "
                                       "job with image_uri runs each host in a Trainyard image; build one with "
                                       "`trainyard image build --variant cpu`, or drop image_uri to run the hosts "
                                       "as processes of this machine")
    if version != sdk_version:
        raise ConfigError("image_uri", f"{ref} holds Trainyard {version or 'of an unknown version'}, and this SDK is "
                                       f"{sdk_version}: the SDK and the driver in the image must be one version; "
                                       "build the image from this checkout (`trainyard image build --variant cpu`), "
                                       "or drop image_uri to run the hosts as processes of this machine")

    if sdk_sources is None:  # the package this module belongs to
        sdk_sources = source_digest(os.path.dirname(os.path.abspath(trainyard.__file__)))
    if labels.get(SOURCE_LABEL) != sdk_sources:
        return (f"{ref} holds Trainyard {version} built from other sources than this SDK's (image "
                f"{labels.get(SOURCE_LABEL) or 'unrecorded'}, SDK {sdk_sources}): its driver may differ from this "
                "checkout; `trainyard image build --variant cpu` builds this one")
    return None


_AWS_FILES = ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
              "AWS_CA_BUNDLE")  # name files of this machine, which a container does not see


def aws_env(environ: Mapping[str, str], session_factory=None) -> dict[str, str]:
    """What a host's container needs to reach the object store the job uses, where it is not the embedded store
    (which passes its own endpoint and key): this process's AWS_* settings, and the credentials boto3 resolves
    here (a profile, SSO, the shared files) as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN,
    as SageMaker local mode hands its containers the session's credentials. Temporary credentials expire with
    their session: a job that outlives them loses access to S3."""
    out = {k: v for k, v in environ.items() if k.startswith("AWS_") and k not in _AWS_FILES}
    if "AWS_ACCESS_KEY_ID" not in out:
        try:
            if session_factory is None:
                import boto3

                session_factory = boto3.Session
            session = session_factory()
            creds = session.get_credentials()
            frozen = creds.get_frozen_credentials() if creds is not None else None
        except Exception:  # noqa: BLE001 - no credentials anywhere: the job's S3 calls will say so
            frozen, session = None, None
        if frozen is not None and frozen.access_key:
            out.update(AWS_ACCESS_KEY_ID=frozen.access_key, AWS_SECRET_ACCESS_KEY=frozen.secret_key)
            if frozen.token:
                out["AWS_SESSION_TOKEN"] = frozen.token
        if session is not None and session.region_name and "AWS_DEFAULT_REGION" not in out:
            out["AWS_DEFAULT_REGION"] = session.region_name
    return out


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
                netns: str | None = None, mounts: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> list[str]:
    """The command that runs one host's driver in a container of `image` (see the module docstring). `addresses`:
    each host name's address; `netns`: the emulated network's namespace of this host (None: this machine's
    network); `mounts`: more folders bound at their own path; `extra`: more options (the pip mounts)."""
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
    return [*cmd, *extra, "--workdir", "/opt/ml", image, "python", "-m", "trainyard.container.driver", *driver_args]


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


def source_digest(package_dir: str) -> str:
    """SHA-256 (16 hex digits) of the Python files of the `trainyard` package at `package_dir`, by relative path:
    the same for the checkout an image is built from and for the SDK installed from it (editable or not), so a
    local job tells an image of other sources than the SDK's, at one version number."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, package_dir).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as fh:
                h.update(hashlib.file_digest(fh, "sha256").hexdigest().encode() + b"\0")
    return h.hexdigest()[:16]
