"""The training processes' sitecustomize (trainyard/container/worker_site): a process group the script left
open is destroyed at exit, gloo's threads get the GIL before the interpreter ends, and the sitecustomize it hides
still runs."""
import os
import subprocess
import sys

from trainyard.container.driver import WORKER_SITE
from trainyard.sdk.backends.local.backend import free_port

SCRIPT = ("import atexit, torch.distributed as dist; "
          "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1); "
          "atexit._run_exitfuncs(); print('initialized after exit handlers:', dist.is_initialized())")


def _run(pythonpath: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(port=free_port())], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_an_open_process_group_is_destroyed_at_exit_and_the_hidden_sitecustomize_runs(tmp_path):
    assert "initialized after exit handlers: True" in _run([])  # without it, the group outlives the handlers
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("print('hidden sitecustomize ran')\n")
    out = _run([WORKER_SITE, str(hidden)])
    assert "initialized after exit handlers: False" in out and "hidden sitecustomize ran" in out


THREADED = """
import sys, threading
sys.setswitchinterval(1e-6)  # the threads switch often, loaded machine or not: a collision is near certain
def w(tag):
    for i in range(20000):
        print(f"{tag} line {i} " + "x" * 40)
ts = [threading.Thread(target=w, args=(t,)) for t in "AB"]
[t.start() for t in ts]; [t.join() for t in ts]
"""


def test_two_threads_printing_unbuffered_never_share_a_line(tmp_path):
    import re

    def mangled(pythonpath: list[str]) -> int:
        out = tmp_path / "out.txt"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath), "PYTHONUNBUFFERED": "1"}
        with open(out, "w") as fh:  # a file, as torchrun's redirects give the ranks
            subprocess.run([sys.executable, "-c", THREADED], env=env, stdout=fh, check=True, timeout=120)
        lines = out.read_text().splitlines(keepends=True)
        return sum(not re.fullmatch(r"[AB] line \d+ x{40}\n", ln) for ln in lines)

    assert mangled([]) > 0  # the bare interpreter splits print's text and newline: lines collide
    assert mangled([WORKER_SITE]) == 0


RAISES = """
import atexit, time, torch.distributed as dist
dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)
atexit.register(lambda: print('the script s own exit handler ran', flush=True))
class SlowTeardown:  # stands for the interpreter's teardown of a loaded process: freed at finalization
    def __del__(self, sleep=time.sleep):  # bound now: the module's globals may be gone by then (with dill
        sleep(6)                          # installed, torch.distributed imports it and the order changes)
keep = SlowTeardown()
raise ValueError('boom')
"""


def test_a_rank_that_raises_exits_with_status_1_without_the_slow_teardown():
    def run(pythonpath: list[str]) -> tuple[subprocess.CompletedProcess, float]:
        import time

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
        start = time.monotonic()
        r = subprocess.run([sys.executable, "-c", RAISES.format(port=free_port())], env=env, capture_output=True,
                           text=True, timeout=120)
        return r, time.monotonic() - start

    bare, bare_s = run([])
    assert bare.returncode == 1 and bare_s >= 6  # the interpreter's teardown: what torchrun's SIGTERM can cut short
    ours, ours_s = run([WORKER_SITE])
    assert ours.returncode == 1 and ours_s < bare_s - 5
    assert "ValueError: boom" in ours.stderr and "the script s own exit handler ran" in ours.stdout


LATE_THREAD = """
import atexit, sys, threading, time, types
dist = sys.modules["torch.distributed"] = types.ModuleType("torch.distributed")  # used, then destroyed
dist.is_available, dist.is_initialized = (lambda: True), (lambda: False)
sys.setswitchinterval(10)  # this thread keeps the GIL unless it blocks: as in an exit that gives nothing away
gate, done = threading.Event(), []
t = threading.Thread(target=lambda: (gate.wait(), done.append(1)), daemon=True)
t.start()
time.sleep(0.2)  # t waits at the gate
gate.set()  # now t needs the GIL, as gloo's worker does to free the last work it ran
atexit._run_exitfuncs()
print("the waiting thread ran before the interpreter's end:", bool(done))
"""


def test_the_exit_gives_a_thread_waiting_for_the_gil_its_turn_before_the_interpreter_ends():
    """gloo's worker threads free their last work's tensors a moment after the script's barrier returned; in the
    interpreter's finalization that aborted the process (SIGABRT) after its work was done."""
    def run(pythonpath):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
        r = subprocess.run([sys.executable, "-c", LATE_THREAD], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout
    assert "interpreter's end: False" in run([])
    assert "interpreter's end: True" in run([WORKER_SITE])
