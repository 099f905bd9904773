"""The driver's pure parts: failure reasons, root-cause choice; a stop while the host finishes."""
import json
import os
import signal
import subprocess
import sys

from trainyard.container.driver import write_failure
from trainyard.container.failure import FAILURE_REASON_LIMIT, RankFailure, root_cause


def _f(**kw):
    base = dict(host="algo-1", rank=0, local_rank=0, exitcode=1, signal="", time=10.0, last_lines="ValueError: boom")
    base.update(kw)
    return RankFailure(**base)


def test_root_cause_prefers_the_cause_over_its_echoes():
    echo = _f(rank=0, time=9.0, last_lines="RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    cause = _f(host="algo-2", rank=3, time=9.5)
    assert root_cause([echo, cause]) is cause
    assert root_cause([_f(rank=2, time=5.0), _f(rank=1, time=6.0)]).rank == 2
    terminated_peer = _f(rank=2, exitcode=-15, signal="SIGTERM", time=1.0, last_lines="")
    assert root_cause([terminated_peer, cause]) is cause
    oom = _f(rank=5, exitcode=-9, signal="SIGKILL", time=1.0, last_lines="")
    assert root_cause([oom, echo]) is oom
    # when every failure looks like an echo, one that ended on its own beats one torchrun terminated
    assert root_cause([terminated_peer, echo]) is echo
    # a rank that raised its own error and was still exiting (its atexit waiting on a peer) when torchrun's
    # SIGTERM came is the cause, not the peer that saw the connection close
    raised = _f(rank=2, exitcode=-15, signal="SIGTERM", time=9.9,
                last_lines="[rank2]: Traceback (most recent call last):\n[rank2]: ValueError: boom on rank 2")
    assert not raised.is_echo and root_cause([echo, raised]) is raised


def test_reason_names_host_rank_code_signal_and_fits_the_limit():
    r = _f(host="algo-2", rank=3, local_rank=1).reason()
    assert r.startswith("algo-2 rank 3 (local rank 1) exited with code 1:") and r.endswith("ValueError: boom")
    assert "killed by SIGKILL" in _f(exitcode=-9, signal="SIGKILL").reason()
    long = _f(last_lines="\n".join(f"line {i} " + "x" * 80 for i in range(100)) + "\nKeyError: last").reason()
    assert len(long) <= FAILURE_REASON_LIMIT and long.endswith("KeyError: last") and long.startswith("algo-1 rank 0")


def test_failure_file_never_overwrites_the_users(tmp_path):
    os.makedirs(tmp_path / "output")
    write_failure(str(tmp_path), "ours")
    assert (tmp_path / "output" / "failure").read_text() == "ours"
    (tmp_path / "output" / "failure").write_text("the user's own reason")
    write_failure(str(tmp_path), "ours again")
    assert (tmp_path / "output" / "failure").read_text() == "the user's own reason"
    json.dumps(_f().to_dict())  # the failure travels as JSON between driver and supervisor


def test_retry_class_of_a_failure_reason():
    from trainyard.container.failure import retry_class

    assert retry_class("Hang: rank 3 (algo-2) stopped in backward at step 41 (SIGSTOP)") == "hang"
    assert retry_class(_f(exitcode=-9, signal="SIGKILL", last_lines="").reason()) == "killed process"
    assert retry_class("algo-2: the driver exited with status -9 and no report") == "lost host"
    echo = _f(last_lines="RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [198.18.0.2]:1")
    assert retry_class(echo.reason()) == "collective error"
    assert retry_class(_f(last_lines="OSError: [Errno 28] No space left on device").reason()) == "disk full"
    # the user's own errors are never retried: an exception, an import error, bad hyperparameters
    for text in ("ValueError: boom on rank 3", "ModuleNotFoundError: No module named 'nope'",
                 "error: argument --lr: invalid float value: 'x'"):
        assert retry_class(_f(last_lines=f"Traceback (most recent call last):\n{text}").reason()) is None


def test_a_silent_rank_is_dated_by_the_launcher_not_by_its_first_words(tmp_path):
    """Rank 3 was killed first (the launcher saw it at 1000); rank 2 ended 30 s later, killed by the launcher.
    Neither spoke near its end: their stderr files are from their start, rank 2's the older."""
    from trainyard.container.failure import from_rank_logs

    def failure(rank, local_rank, timestamp, words_at):
        err = tmp_path / "run" / "attempt_0" / str(local_rank) / "stderr.log"
        err.parent.mkdir(parents=True, exist_ok=True)
        err.write_text("some warning at start\n")
        os.utime(err, (words_at, words_at))
        return from_rank_logs(host="algo-2", rank=rank, local_rank=local_rank, exitcode=-9, when=float(timestamp),
                              stderr=str(err))

    first, later = failure(3, 1, 1000, words_at=950.0), failure(2, 0, 1030, words_at=900.0)
    assert (first.time, later.time) == (1000.0, 1030.0) and root_cause([later, first]) is first
    assert abs(failure(3, 1, 1000, words_at=1000.4).time - 1000.4) < 1e-3  # last words at its end: the finer clock


def test_a_rank_silent_on_stderr_is_reported_with_its_stdout_or_as_silent(tmp_path):
    """The evidence for a rank that exits without a traceback: its stdout's last lines, or the fact that it
    printed nothing at all (both were a bare head before)."""
    import functools

    from trainyard.container.failure import from_rank_logs

    folder = tmp_path / "run" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    (folder / "stderr.log").write_text("")
    (folder / "stdout.log").write_text("step 3/10 loss 2.5\nexiting: my own check failed\n")
    failure = functools.partial(from_rank_logs, host="algo-1", rank=0, local_rank=0, exitcode=1, when=1000.0,
                                stderr=str(folder / "stderr.log"))
    got = failure()
    assert got.reason() == ("algo-1 rank 0 (local rank 0) exited with code 1:\n(nothing on stderr; its last lines "
                            "on stdout:)\nstep 3/10 loss 2.5\nexiting: my own check failed")
    (folder / "stdout.log").write_text("")
    assert failure().reason() == (
        "algo-1 rank 0 (local rank 0) exited with code 1:\n(it printed nothing on stdout or stderr)")


def test_first_cause_among_the_hosts_reasons():
    from trainyard.container.failure import first_cause

    echo = "algo-1 rank 0 (local rank 0) exited with code 1:\nRuntimeError: Connection closed by peer [10.0.0.2]:1"
    waiting = "Hang: rank 0 (algo-1) is behind in backward at step 4 (last in all_reduce #9); rank 1 waits in x #9"
    frozen = "Hang: rank 3 (algo-2) stopped in backward at step 4 (SIGSTOP); rank 2 waits in all_gather #10"
    cause = "algo-2 rank 3 (local rank 1) exited with code 1:\nValueError: boom"
    assert first_cause([echo, waiting, frozen]) == frozen
    assert first_cause([echo, waiting]) == waiting and first_cause([echo, cause, frozen]) == cause
    assert first_cause([echo]) == echo


def test_a_sigterm_while_the_host_finishes_lets_it_finish():
    """A stop that lands in the last sync or the upload used to end the driver at once, with no report."""
    code = ("import os, signal, time\n"
            "from trainyard.container.driver import finishing\n"
            "with finishing(print):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(0.2)\n"
            "    print('uploaded')\n"
            "assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(5)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines() == ["uploaded", "asked to stop while finishing: finished first"], r.stderr
    assert r.returncode == -signal.SIGTERM  # outside, a SIGTERM ends the driver as before
