"""The bandwidth probe: the bus-bandwidth formula, a real 2-process run under torchrun with gloo on the CPU,
and the driver's way of running it (a launch of its own, as the job's processes start, stopped when it runs past
its time)."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from trainyard.container import driver, probe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE_TIMEOUT_S = 180  # two torch imports and a gloo rendezvous on a busy 2-core machine
LINE = re.compile(r"bandwidth probe: rank (\d+): all-reduce bus bandwidth ([0-9.]+) GB/s "
                  r"\(size ([0-9.]+) MiB, (\d+) iterations\)")


def test_bus_bandwidth_formula():
    # nccl-tests: busbw = algbw * 2(n-1)/n; 1 GB moved in 1 s on 8 ranks is 1.75 GB/s of bus bandwidth
    assert probe.bus_bandwidth_gbps(10**9, 1.0, 8) == pytest.approx(1.75)
    assert probe.bus_bandwidth_gbps(256 * 2**20, 0.01, 2) == pytest.approx(256 * 2**20 / 0.01 / 1e9)
    assert probe.bus_bandwidth_gbps(10**9, 1.0, 1) == 0.0  # nothing crosses a link
    assert probe.bus_bandwidth_gbps(10**9, 0.0, 4) == 0.0


def _lines(text: str) -> dict[int, tuple[float, float, int]]:
    return {int(m[1]): (float(m[2]), float(m[3]), int(m[4])) for m in LINE.finditer(text)}


@pytest.mark.slow
def test_probe_script_under_torchrun_with_gloo(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                        "--log-dir", str(tmp_path / "logs"), "--redirects", "3", "--tee", "3",
                        os.path.join(ROOT, "trainyard", "container", "probe.py"), "--device", "cpu", "--size-mib", "2",
                        "--iters", "3", "--warmup", "1"],
                       capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    found = _lines(r.stdout + r.stderr)
    assert sorted(found) == [0, 1], r.stdout + r.stderr
    for gbps, mib, iters in found.values():
        assert gbps > 0 and mib == 2 and iters == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, processes: int = 2):
    """What `driver.run_check` reads of the host's run: the job's hosts and processes, this host, its code."""
    spec = types.SimpleNamespace(instance_count=1, processes_per_host=processes)
    return types.SimpleNamespace(spec=spec, host="algo-1", index=0, master_addr="127.0.0.1", code_dir=str(tmp_path))


@pytest.mark.slow
def test_the_driver_runs_the_probe_with_its_own_launch(tmp_path, capfd, monkeypatch):
    """The probe as the driver runs it (the module, the job's hosts and processes, another port) runs to the end
    and each rank prints its line, prefixed as the job's ranks are."""
    monkeypatch.setenv("TRAINYARD_PROBE_SIZE_MIB", "1")
    monkeypatch.setenv("TRAINYARD_PROBE_ITERS", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on the CPU even where a GPU is
    port = driver.probe_port(_free_port() - 1, {})
    assert driver.run_check(_run(tmp_path), driver.PROBE_MODULE, [], str(tmp_path / "probe"), port,
                            PROBE_TIMEOUT_S) == 0
    out = capfd.readouterr()
    text = out.out + out.err
    found = _lines(text)
    assert sorted(found) == [0, 1], text
    assert all(mib == 1 and iters == 2 for _, mib, iters in found.values())
    assert re.search(r"^\[algo-1/1\] bandwidth probe: rank 1: ", text, re.M), text


def test_a_probe_past_its_time_is_stopped(tmp_path):
    """A check that never ends (here a module that sleeps: `timeit` of a 60 s sleep) is stopped at its time."""
    start = time.monotonic()
    code = driver.run_check(_run(tmp_path, 1), "timeit", ["-n", "1", "-r", "1", "-s", "import time", "time.sleep(60)"],
                            str(tmp_path / "logs"), _free_port(), timeout=0.5)
    assert code is None and time.monotonic() - start < 30


def test_a_driver_stopped_during_a_check_ends_as_it_would_without_it(tmp_path):
    """The launcher passes the driver's SIGTERM on to the check's ranks and returns; the driver then ends by that
    signal, as it did when the check was a child of its own: it never goes on to train."""
    script = tmp_path / "driver_stopped.py"
    script.write_text(f"""
import os, signal, sys, threading, types
sys.path.insert(0, {ROOT!r})
from trainyard.container import driver
spec = types.SimpleNamespace(instance_count=1, processes_per_host=1)
run = types.SimpleNamespace(spec=spec, host="algo-1", index=0, master_addr="127.0.0.1", code_dir={str(tmp_path)!r})
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
driver.run_check(run, "timeit", ["-n", "1", "-r", "1", "-s", "import time", "time.sleep(60)"], {str(tmp_path / "l")!r},
                 {_free_port()}, 120)
print("went on after the check")
""")
    start = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stdout, r.stderr)
    assert "went on" not in r.stdout and time.monotonic() - start < 30
