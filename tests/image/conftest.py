"""The CPU image, built once per test session from this checkout (`trainyard image build --variant cpu`), and the
engine that runs its containers. Where no container engine or mmdebstrap can be had, the image tests say why
and skip: `make test` installs podman, buildah, mmdebstrap and runc where apt-get runs as root."""
import os
import shutil
import subprocess
import time

import pytest

from trainyard.sdk import image
from trainyard.sdk.backends.local import containers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_SECONDS: dict[str, float] = {}


@pytest.fixture(scope="session")
def engine():
    from trainyard.errors import ConfigError

    try:
        return containers.find_engine()
    except ConfigError as e:
        pytest.skip(f"no container engine here ({e}); `make test` installs podman where apt-get runs as root")


@pytest.fixture(scope="session")
def cpu_image(engine):
    missing = [t for t in ("mmdebstrap",) if not shutil.which(t)]
    if missing:
        pytest.skip(f"the CPU image's base needs {', '.join(missing)} (apt-get install mmdebstrap; `make test` "
                    "installs it where apt-get runs as root)")
    started = time.monotonic()
    ref = image.build(ROOT, variant="cpu")
    BUILD_SECONDS[ref] = time.monotonic() - started
    return ref


def run_in(engine, ref: str, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """`<engine> run --rm <ref> ARGS` with this machine's limits (sdk/backends/local/containers.py), output captured."""
    name, path = engine
    cmd = [path, "run", "--rm", *containers.run_options(engine), *kw.pop("options", []), ref, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def leftovers(engine, job: str) -> dict[str, list[str]]:
    """What of `job` the engine and the mount table still hold."""
    _, path = engine
    ps = subprocess.run([path, "ps", "-a", "--filter", f"label={containers.LABEL}={job}", "--format", "{{.Names}}"],
                        capture_output=True, text=True).stdout.split()
    nets = [n for n in subprocess.run([path, "network", "ls", "--format", "{{.Name}}"], capture_output=True,
                                      text=True).stdout.split() if job in n]
    with open("/proc/self/mounts") as fh:
        mounts = [line.split()[1] for line in fh if job in line]
    return {k: v for k, v in {"containers": ps, "networks": nets, "mounts": mounts}.items() if v}
