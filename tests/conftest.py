"""Shared fixtures: a real moto S3 server over HTTP on 127.0.0.1, and an isolated Trainyard home."""
import gc
import os
import re

import botocore.session
import pytest

# Every boto3.Session (the tests make hundreds: one per job, backend call and check) gets botocore's loader of its
# own, which parses the service models again: EC2's JSON alone takes 0.3-0.5 s. One loader for the whole process
# parses each model once (a user's session already keeps its loader for every client it makes).
_loaders: dict = {}


class _OncePaths(list):
    """A loader's search paths, each kept once: boto3 appends its data folder at every Session."""

    def append(self, path):
        if path not in self:
            super().append(path)


def _shared_loader(search_path_string=None, _create=botocore.session.create_loader):
    if search_path_string not in _loaders:
        loader = _loaders[search_path_string] = _create(search_path_string)
        loader._search_paths = _OncePaths(loader.search_paths)
    return _loaders[search_path_string]


botocore.session.create_loader = _shared_loader


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Collecting imports every test module (torch, transformers, triton, moto): objects that all live on, so the
    garbage collector is off meanwhile, then they are frozen out of every later collection (as the preload server
    does, container/preload.py): 14.0 -> 10.0 s for a collection on the CI machine. A wrapper, so that it also ends
    in pytest-xdist's controller, which collects nothing."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def pytest_unconfigure(config):
    gc.unfreeze()  # collectable again at exit: triton's bindings (nanobind) report what is left then as leaks

# Triton decides at `@triton.jit` time whether a kernel runs compiled or in its interpreter, so the switch
# must be set before any test imports trainyard.kernels: CPU tensors then run the Triton kernels through the
# interpreter (how CI tests them); ops called with backend="eager" (and kernels off, the default) are unaffected.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def trainyard_home(tmp_path_factory):
    """Every test session gets its own Trainyard home (jobs, embedded store); the store is stopped at the end."""
    home = str(tmp_path_factory.mktemp("trainyard-home"))
    saved = os.environ.get("TRAINYARD_HOME")
    os.environ["TRAINYARD_HOME"] = home
    os.environ.pop("AWS_ENDPOINT_URL", None)
    try:
        yield home
    finally:
        from trainyard.sdk.store import stop_store

        stop_store()
        if saved is None:
            os.environ.pop("TRAINYARD_HOME", None)
        else:
            os.environ["TRAINYARD_HOME"] = saved


@pytest.fixture(autouse=True)
def _aws_environment_restored():
    """`trainyard.Session()` exports the embedded store's endpoint and credentials into os.environ where no AWS is
    configured (as a notebook wants it); each test gets back the AWS variables it started with."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    yield
    for k in [k for k in os.environ if k.startswith("AWS_") and k not in saved]:
        del os.environ[k]
    os.environ.update(saved)


@pytest.fixture(scope="session")
def moto_server():
    """A moto server on a free loopback port, separate from the SDK's embedded store."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_endpoint(moto_server, monkeypatch):
    """Points this test (and the processes it spawns) at the moto server: boto3 and s3fs both honour
    AWS_ENDPOINT_URL. Returns the URL."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return moto_server


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    """A fresh bucket on the moto server; returns its name."""
    import boto3

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") or "bucket"
    name = name if len(name) >= 3 else name + "-bucket"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def _busy_and_idle() -> tuple[float, float]:
    """The machine's busy and idle CPU seconds so far, all cores together (/proc/stat's first line)."""
    with open("/proc/stat") as fh:
        ticks = [int(x) for x in fh.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / hz, idle / hz


if os.environ.get("TRAINYARD_SUITE_PROFILE"):  # a JSON line per case: wall seconds, busy and idle core-seconds

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import json
        import time

        start, (busy, idle) = time.monotonic(), _busy_and_idle()
        yield
        busy2, idle2 = _busy_and_idle()
        with open(os.environ["TRAINYARD_SUITE_PROFILE"], "a") as fh:
            fh.write(json.dumps({"test": item.nodeid, "wall": round(time.monotonic() - start, 2),
                                 "busy": round(busy2 - busy, 1), "idle": round(idle2 - idle, 1)}) + "\n")
