"""The bandwidth probe: the bus-bandwidth formula, a real 2-process run under torchrun with gloo on the CPU,
and the driver's way of running it (its own torchrun, stopped when it runs past its time)."""
import os
import re
import socket
import subprocess
import sys
import time

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


@pytest.mark.slow
def test_the_driver_runs_the_probe_with_its_own_torchrun(tmp_path, capfd, monkeypatch):
    """The command the driver builds for the probe (the module, the job's hosts and processes, another port)
    runs to the end and each rank prints its line, prefixed as the job's ranks are."""
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[algo-1/${rank}] ")
    monkeypatch.setenv("TRAINYARD_PROBE_SIZE_MIB", "1")
    monkeypatch.setenv("TRAINYARD_PROBE_ITERS", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on the CPU even where a GPU is
    port = driver.probe_port(_free_port() - 1, {})
    cmd = driver.build_torchrun_command(nnodes=1, node_rank=0, nproc_per_node=2, master_addr="127.0.0.1",
                                        master_port=port, entry_point=driver.PROBE_MODULE, entry_kind="module",
                                        args=[], log_dir=str(tmp_path / "probe"))
    assert cmd[-2:] == ["--module", "trainyard.container.probe"]
    assert driver.run_probe(cmd, str(tmp_path), timeout=PROBE_TIMEOUT_S) == 0
    out = capfd.readouterr()
    text = out.out + out.err
    found = _lines(text)
    assert sorted(found) == [0, 1], text
    assert all(mib == 1 and iters == 2 for _, mib, iters in found.values())
    assert re.search(r"^\[algo-1/1\] bandwidth probe: rank 1: ", text, re.M), text


def test_a_probe_past_its_time_is_stopped(tmp_path):
    start = time.monotonic()
    code = driver.run_probe([sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path), timeout=0.5)
    assert code is None and time.monotonic() - start < 30
