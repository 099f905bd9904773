"""A job without a distribution: its entry point as one plain `python` process (container/plainrun.py)."""
import os
import signal
import sys
import textwrap
import threading

from trainyard.container.plainrun import build_plain_command, run_plain
from tests.waiting import eventually

SCRIPT = textwrap.dedent("""
    import os, sys, time
    print("env", *(f"{k}={os.environ.get(k, '-')}" for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")))
    print("args", *sys.argv[1:])
    print(" 10%|#  |\\r 50%|##### |\\r100%|##########|")  # a progress bar's redraws
    if "--fail" in sys.argv:
        raise ValueError("boom in the plain script")
    if "--wait" in sys.argv:
        import signal
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(0)))
        print("ready", flush=True)
        time.sleep(60)
""")


def _run(tmp_path, *args, monkeypatch):
    (tmp_path / "code").mkdir(exist_ok=True)
    (tmp_path / "code" / "train.py").write_text(SCRIPT)
    monkeypatch.setenv("RANK", "5")  # as if the driver had it: the process must not
    monkeypatch.setenv("WORLD_SIZE", "9")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    cmd = build_plain_command("train.py", "script", list(args))
    return run_plain(cmd, str(tmp_path / "code"), host="algo-2", rank=1, log_dir=str(tmp_path / "logs"),
                     master_addr="algo-1", master_port=7777)


def test_the_plain_process_has_no_launchers_variables_and_its_lines_are_prefixed(tmp_path, monkeypatch, capfd):
    code, failure = _run(tmp_path, "--lr", "0.1", monkeypatch=monkeypatch)
    assert (code, failure) == (0, None)
    out = capfd.readouterr().out
    assert "[algo-2/1] env RANK=- LOCAL_RANK=- WORLD_SIZE=- MASTER_ADDR=algo-1 MASTER_PORT=7777\n" in out, out
    assert "[algo-2/1] args --lr 0.1\n" in out
    # each redraw of a progress bar on a line of its own, prefixed (the log splits at carriage returns)
    assert "[algo-2/1]  10%|#  |\n[algo-2/1]  50%|##### |\n[algo-2/1] 100%|##########|\n" in out, out
    # the files where the first-step watch and the failure report read a rank's output (torchrun's layout)
    logged = (tmp_path / "logs" / "plain" / "attempt_0" / "0" / "stdout.log").read_text()
    assert logged.startswith("env RANK=-") and "args --lr 0.1" in logged


def test_a_failing_plain_process_is_reported_with_its_traceback(tmp_path, monkeypatch):
    code, failure = _run(tmp_path, "--fail", monkeypatch=monkeypatch)
    assert code == 1 and failure is not None
    assert failure.reason().startswith("algo-2 rank 1 (local rank 0) exited with code 1:\nTraceback")
    assert failure.reason().endswith("ValueError: boom in the plain script")


def test_sigterm_to_the_driver_reaches_the_plain_process(tmp_path, monkeypatch):
    """The supervisor stops a host by SIGTERM to its driver: the process gets it, and the driver reports 128+15
    as torchrun does."""
    out = tmp_path / "logs" / "plain" / "attempt_0" / "0" / "stdout.log"

    def stop_when_ready():  # "ready" in the file: the tee runs, so the driver's handlers are in place
        eventually(lambda: out.exists() and "ready" in out.read_text(), 30, interval=0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    stopper = threading.Thread(target=stop_when_ready, daemon=True)
    stopper.start()
    code, failure = _run(tmp_path, "--wait", monkeypatch=monkeypatch)
    stopper.join(5)
    assert (code, failure) == (128 + signal.SIGTERM, None)
    assert "got SIGTERM" in out.read_text()
    assert signal.getsignal(signal.SIGTERM) is before  # the driver's own handling back


def test_a_module_entry_point_runs_with_dash_m():
    assert build_plain_command("pkg.train", "module", ["--x", "1"], python="py") == [
        "py", "-m", "pkg.train", "--x", "1"]
    assert build_plain_command("train.py", "script", [], python=sys.executable) == [sys.executable, "train.py"]
