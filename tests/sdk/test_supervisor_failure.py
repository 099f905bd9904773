"""The supervisor waits for the host that caused a failure when the first host to fail only echoes it, and the
hosts it stopped itself are neither failures nor lost hosts."""
import json
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

from trainyard.sdk.backends.local import supervisor
from trainyard.sdk.backends.local.supervisor import Supervisor

ECHO = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [198.18.40.2]:25315"


class _Bare(Supervisor):
    """A supervisor over fake drivers: no job folder, no signal handlers."""

    def __init__(self, jobdir, hosts):
        self.jobdir, self.spec, self.runtime = jobdir, SimpleNamespace(hosts=hosts, max_run=60), {}
        self.stop_reason, self.drivers, self.exits, self._reasons = None, {}, {}, {}
        self.hang_watch, self.hang_reason, self.engine, self.terminated = None, "", None, set()

    def record_phases(self, ended=False):
        pass


def _driver(jobdir, host, rank, lines, after_s):
    """A process that, after `after_s`, writes a driver's failure report for `host` and exits 1."""
    failure = dict(host=host, rank=rank, local_rank=rank % 2, exitcode=1, signal="", time=time.time() + after_s,
                   last_lines=lines)
    report = {"host": host, "reason": f"{host} rank {rank} failed: {lines}", "failure": failure}
    code = (f"import json, time; time.sleep({after_s}); "
            f"open({f'{jobdir}/hosts/{host}.status.json'!r}, 'w').write({json.dumps(json.dumps(report))}); "
            f"raise SystemExit(1)")
    return subprocess.Popen([sys.executable, "-c", code])


def test_an_echo_waits_for_its_cause(tmp_path, monkeypatch):
    (tmp_path / "hosts").mkdir()
    monkeypatch.setattr(supervisor, "FAILURE_SETTLE_S", 0.5)  # shorter than the cause takes to report
    sup = _Bare(str(tmp_path), ["algo-1", "algo-2"])
    for p in (_driver(tmp_path, "algo-1", 1, ECHO, 0.0), _driver(tmp_path, "algo-2", 2, "ValueError: boom", 3.0)):
        sup.drivers[p.pid] = p
    assert sup.monitor() == "Failed"
    assert sup.failure_reason().startswith("algo-2 rank 2 failed: ValueError: boom")


def test_a_cause_does_not_wait_for_the_echoes(tmp_path, monkeypatch):
    (tmp_path / "hosts").mkdir()
    monkeypatch.setattr(supervisor, "STOP_GRACE_S", 5.0)
    sup = _Bare(str(tmp_path), ["algo-1", "algo-2"])
    for p in (_driver(tmp_path, "algo-1", 0, "ValueError: boom", 0.0), _driver(tmp_path, "algo-2", 2, ECHO, 30.0)):
        sup.drivers[p.pid] = p
    t0 = time.monotonic()
    assert sup.monitor() == "Failed"
    assert time.monotonic() - t0 < supervisor.FAILURE_SETTLE_S + 5.0 + 3.0  # settle, then SIGTERM
    assert sup.failure_reason().startswith("algo-1 rank 0 failed: ValueError: boom")


def test_a_host_the_supervisor_stopped_is_not_lost_however_its_driver_ended(tmp_path, monkeypatch):
    """algo-2's driver is killed (the host is gone: no report); algo-1's, stopped by the supervisor after the
    settle, dies of the SIGTERM itself (-15: a driver between its launches has no handler). Only algo-2 is lost
    (it used to be both, and an elastic job with one host to spare then restarted on both)."""
    (tmp_path / "hosts").mkdir()
    monkeypatch.setattr(supervisor, "FAILURE_SETTLE_S", 0.2)
    sup = _Bare(str(tmp_path), ["algo-1", "algo-2"])
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    for p in (subprocess.Popen(sleeper), subprocess.Popen(sleeper)):
        sup.drivers[p.pid] = p
    list(sup.drivers.values())[1].send_signal(signal.SIGKILL)
    assert sup.monitor() == "Failed"
    assert sup.exits == {"algo-2": -signal.SIGKILL, "algo-1": -signal.SIGTERM}
    assert sup.lost_hosts() == ["algo-2"]
    assert sup.failure_reason() == "algo-2: the driver exited with status -9 and no report"
