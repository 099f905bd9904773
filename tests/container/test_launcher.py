"""The host's launcher (container/launcher.py): torchrun's variables for each process, its files and prefixed
lines, the first failure ending the others, and the driver's signals passed on; with small plain-python
processes (no torch), each started as its own interpreter and forked from the preload server (preload.py)."""
import os
import signal
import sys
import threading
import time

import pytest

from trainyard.container.launcher import run_processes, worker_env

SCRIPT = """
import os, signal, sys, time
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")
print(" ".join(f"{k}={os.environ.get(k)}" for k in keys), flush=True)
mode = sys.argv[1]
local = int(os.environ["LOCAL_RANK"])
if mode == "fail" and local == 1:
    time.sleep(0.3)
    print("boom: rank 1 gives up", file=sys.stderr, flush=True)
    sys.exit(3)
if mode in ("fail", "wait"):
    def on_term(signum, frame):
        open(os.path.join(sys.argv[2], f"term-{local}"), "w").close()
        sys.exit(0 if mode == "wait" else 1)
    if local != 2:  # local rank 2 ignores SIGTERM: it gets SIGKILL after the grace
        signal.signal(signal.SIGTERM, on_term)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(sys.argv[2], f"up-{local}"), "w").close()
    time.sleep(60)
"""


@pytest.fixture(params=[(), ("json",)], ids=["fresh", "preloaded"])
def preload(request):
    return request.param


def _run(tmp_path, mode, capfd=None, **kw):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    return run_processes([sys.executable, str(script), mode, str(tmp_path)], str(tmp_path), host="algo-2",
                         node_rank=1, nnodes=2, nproc=3, master_addr="127.0.0.1", master_port=29511,
                         log_dir=str(tmp_path / "logs"), run_id="r1", **kw)


def test_each_process_gets_torchruns_variables():
    env = worker_env(local_rank=1, nproc=4, node_rank=2, nnodes=3, master_addr="algo-1", master_port=7000,
                     run_id="x", environ={"PATH": "/bin"})
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
                                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PATH")} == {
        "RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "2",
        "GROUP_WORLD_SIZE": "3", "ROLE_RANK": "9", "ROLE_WORLD_SIZE": "12", "MASTER_ADDR": "algo-1",
        "MASTER_PORT": "7000", "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PATH": "/bin"}
    one = worker_env(local_rank=0, nproc=1, node_rank=0, nnodes=1, master_addr="a", master_port=1, run_id="x",
                     environ={"OMP_NUM_THREADS": "8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert one["OMP_NUM_THREADS"] == "8" and one["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert "OMP_NUM_THREADS" not in worker_env(local_rank=0, nproc=1, node_rank=0, nnodes=1, master_addr="a",
                                               master_port=1, run_id="x", environ={})


def test_the_processes_run_with_their_files_and_prefixed_lines(tmp_path, capfd, preload):
    assert _run(tmp_path, "ok", preload=preload) == (0, None)
    out = capfd.readouterr().out
    for local, rank in ((0, 3), (1, 4), (2, 5)):
        line = (f"RANK={rank} LOCAL_RANK={local} WORLD_SIZE=6 LOCAL_WORLD_SIZE=3 GROUP_RANK=1 MASTER_ADDR=127.0.0.1 "
                f"MASTER_PORT=29511 TORCHELASTIC_USE_AGENT_STORE=False OMP_NUM_THREADS=")
        assert f"[algo-2/{rank}] {line}" in out, out
        folder, = (tmp_path / "logs").glob(f"r1_*/attempt_0/{local}")  # torchrun's layout: <run id>_<random>
        assert (folder / "stdout.log").read_text().startswith(line)


def test_the_first_failure_ends_the_others_and_is_reported(tmp_path, preload):
    t0 = time.monotonic()
    code, failure = _run(tmp_path, "fail", grace=2.0, preload=preload)
    took = time.monotonic() - t0
    assert code == 1 and (failure.rank, failure.local_rank, failure.exitcode) == (4, 1, 3), failure
    assert failure.reason().startswith("algo-2 rank 4 (local rank 1) exited with code 3:\nboom: rank 1 gives up")
    assert (tmp_path / "term-0").exists() and not (tmp_path / "term-2").exists()  # SIGTERM; rank 2 ignored it
    assert took < 15, took  # rank 2 got SIGKILL after the 2 s grace, not its 60 s sleep


def test_a_signal_to_the_driver_goes_on_to_every_process(tmp_path, preload):
    def stop_when_up():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all((tmp_path / f"up-{i}").exists() for i in range(3)):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_up, daemon=True).start()
    previous = signal.getsignal(signal.SIGTERM)
    code, failure = _run(tmp_path, "wait", grace=2.0, preload=preload)
    assert (code, failure) == (128 + signal.SIGTERM, None)
    assert (tmp_path / "term-0").exists() and (tmp_path / "term-1").exists()
    assert signal.getsignal(signal.SIGTERM) is previous  # the driver's own handlers back


def test_a_slow_reader_of_the_drivers_output_never_blocks_a_rank(tmp_path, monkeypatch):
    """The ranks write to their files; the lines reach the driver's output from there. A driver whose stdout
    nobody reads (a stalled log shipper) leaves the ranks running."""
    script = tmp_path / "chatty.py"
    script.write_text("import os, sys\nfor i in range(20000):\n    print(f'line {i} ' + 'x' * 40)\n"
                      "open(sys.argv[1], 'w').close()\n")
    read_end, write_end = os.pipe()  # 64 KB of buffer, never read: the first follow write past it blocks
    monkeypatch.setattr(sys, "stdout", os.fdopen(write_end, "w"))
    t0 = time.monotonic()
    code, _ = run_processes([sys.executable, str(script), str(tmp_path / "done")], str(tmp_path), host="algo-1",
                            node_rank=0, nnodes=1, nproc=1, master_addr="127.0.0.1", master_port=29512,
                            log_dir=str(tmp_path / "logs"))
    assert code == 0 and (tmp_path / "done").exists()
    assert time.monotonic() - t0 < 15  # the rank's 1 MB went to its file; only the driver's copy waited
    folder, = (tmp_path / "logs").glob("none_*/attempt_0/0")
    assert (folder / "stdout.log").read_text().count("\n") == 20000
    os.close(read_end)
