"""The preload server (container/preload.py): a host's processes forked from one process that imported their
modules once are what fresh interpreters would be (argv, environment, folder, session, files, exit statuses,
tracebacks), a server killed before it forked leaves nothing behind, and trainyard's preloaded entry modules
read no per-process variable while they are imported."""
import json
import os
import subprocess
import sys
import textwrap
import time

from trainyard.container.driver import HEALTH_MODULE, PROBE_MODULE, preloaded
from trainyard.container.launcher import run_processes
from trainyard.container.preload import PER_PROCESS

SCRIPT = """
import gc, json, os, sys
mode = sys.argv[1]
rank = int(os.environ["RANK"])
json.dump({"argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "session": os.getsid(0) == os.getpid(),
           "preloaded": "email.mime.text" in sys.modules, "path0": sys.path[0], "gc": gc.isenabled(),
           "frozen": gc.get_freeze_count(),
           "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "TORCHELASTIC_ERROR_FILE", "EXTRA")}},
          open(os.path.join(sys.argv[2], f"seen-{rank}.json"), "w"))
if mode == "raise" and rank == 1:
    raise RuntimeError("rank 1 broke")
if mode == "signal" and rank == 0:
    os.kill(os.getpid(), 9)
"""


def _run(tmp_path, mode, preload=("email.mime.text",), nproc=2, cmd=None, **kw):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    return run_processes(cmd or [sys.executable, str(script), mode, str(tmp_path)], str(tmp_path), host="algo-1",
                         node_rank=0, nnodes=1, nproc=nproc, master_addr="127.0.0.1", master_port=29513,
                         log_dir=str(tmp_path / "logs"), preload=preload, grace=2.0, **kw)


def _seen(tmp_path, rank):
    return json.loads((tmp_path / f"seen-{rank}.json").read_text())


def test_a_forked_process_is_what_a_fresh_one_would_be(tmp_path, monkeypatch):
    monkeypatch.setenv("EXTRA", "x")
    assert _run(tmp_path, "ok") == (0, None)
    for rank in (0, 1):
        seen = _seen(tmp_path, rank)
        assert seen["argv"] == [str(tmp_path / "w.py"), "ok", str(tmp_path)]
        assert seen["cwd"] == str(tmp_path) and seen["path0"] == str(tmp_path) and seen["name"] == "__main__"
        assert seen["session"] and seen["preloaded"]
        # the preload's objects frozen out of its collections (preload.py), the collector itself on, as in a fresh one
        assert seen["gc"] and seen["frozen"] > 1000, seen
        assert seen["env"]["RANK"] == seen["env"]["LOCAL_RANK"] == str(rank) and seen["env"]["EXTRA"] == "x"
        assert seen["env"]["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{rank}/error.json")
    # one server per launch, and its log beside the ranks' folders
    log, = (tmp_path / "logs").glob("none_*/preload.log")
    assert log.read_text() == ""


def test_a_module_entry_runs_as_main_with_its_file_as_argv0(tmp_path):
    (tmp_path / "entrymod.py").write_text(SCRIPT)
    cmd = [sys.executable, "-u", "-m", "entrymod", "ok", str(tmp_path)]
    assert _run(tmp_path, "ok", cmd=cmd, preload=("entrymod",)) == (0, None)
    seen = _seen(tmp_path, 1)
    assert seen["argv"][0] == str(tmp_path / "entrymod.py") and seen["name"] == "__main__"


def test_the_server_ends_without_tearing_its_imports_down(tmp_path):
    """The launcher waits for the server after the last process: a server that tore down what it imported (torch:
    0.5-1 s) would hold every launch that long. Here a preloaded module's exit hook that sleeps in the server."""
    (tmp_path / "slowexit.py").write_text(
        "import atexit, os, time\n_PID = os.getpid()\natexit.register(lambda: os.getpid() == _PID and time.sleep(5))\n")
    started = time.monotonic()
    assert _run(tmp_path, "ok", preload=("slowexit",)) == (0, None)
    assert time.monotonic() - started < 4.0
    assert _seen(tmp_path, 0)["preloaded"] is False and _seen(tmp_path, 1)["env"]["RANK"] == "1"


def test_an_uncaught_exception_and_a_signal_are_the_processes_own_statuses(tmp_path):
    code, failure = _run(tmp_path, "raise")
    assert code == 1 and (failure.rank, failure.exitcode) == (1, 1)
    assert "RuntimeError: rank 1 broke" in failure.last_lines
    code, failure = _run(tmp_path, "signal")
    assert code == 1 and (failure.rank, failure.exitcode, failure.signal) == (0, -9, "SIGKILL")


def test_a_module_that_fails_to_preload_fails_each_process_with_its_own_traceback(tmp_path):
    (tmp_path / "broken.py").write_text("raise ImportError('no such thing here')\n")
    cmd = [sys.executable, "-u", "-m", "broken"]
    code, failure = _run(tmp_path, "ok", cmd=cmd, preload=("broken",))
    assert code == 1 and failure.exitcode == 1 and "ImportError: no such thing here" in failure.last_lines
    log, = (tmp_path / "logs").glob("none_*/preload.log")
    assert "no such thing here" in log.read_text()


def test_a_server_ended_while_it_imports_ends_the_launch_and_leaves_nothing(tmp_path):
    """The server imports a module that sleeps; the launch's timeout stops it before it forked anything."""
    (tmp_path / "slowimport.py").write_text("import time\ntime.sleep(60)\n")
    code, failure = _run(tmp_path, "ok", preload=("slowimport",), timeout=1.0)
    assert (code, failure) == (None, None)
    assert not list(tmp_path.glob("seen-*.json"))
    left = subprocess.run(["pgrep", "-f", "trainyard.container.preload.*slowimport"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


def test_trainyards_preloaded_entries_read_no_process_variable_and_touch_no_gpu_on_import(tmp_path):
    """What the server imports under the host's variables only: a read of RANK (or another per-process
    variable) at import would be the server's, the same for every process. Nor may an import ask CUDA anything
    (`torch.cuda.is_available()`, `device_count()` ...): a CUDA driver initialised before the fork fails in every
    forked rank ("CUDA error: initialization error"). transformers' model code does, through torchao and
    torch._dynamo, so a host's ranks of `model hf` import it each on its own."""
    assert preloaded("trainyard.engine.train", "module") == ("trainyard.engine.train",)
    assert preloaded("trainyard.engine.train", "module", "s3://b/ckpt") == ("trainyard.engine.train", "s3fs")
    assert preloaded("train.py", "script") == () and preloaded("mypkg.train", "module") == ()
    assert preloaded("train.py", "script", "s3://b/ckpt") == ()
    # one process imports them all, in the servers' order (each module's reads are those its import added: the
    # union is what a server importing several of them reads)
    modules = ["trainyard.engine.train", "s3fs", PROBE_MODULE, HEALTH_MODULE]
    probe = textwrap.dedent(f"""
        import importlib, json, os, sys
        import torch
        reads, cuda = [], []
        class Watched(type(os.environ)):
            def __getitem__(self, key):
                reads.append(key)
                return super().__getitem__(key)
            def __contains__(self, key):
                reads.append(key)
                return super().__contains__(key)
        os.environ.__class__ = Watched
        for name in ("is_available", "device_count", "init", "_lazy_init", "get_device_name",
                     "get_device_capability", "current_device"):
            def asked(*args, _name=name, _real=getattr(torch.cuda, name), **kwargs):
                cuda.append(f"torch.cuda.{{_name}} from {{sys._getframe(1).f_code.co_filename}}")
                return _real(*args, **kwargs)
            setattr(torch.cuda, name, asked)
        found = {{}}
        for module in sys.argv[1:]:
            importlib.import_module(module)
            found[module] = [sorted(set(reads) & set({list(PER_PROCESS)!r})), cuda[:]]
            reads.clear()
            cuda.clear()
        print(json.dumps(found))
    """)
    # and a module that does both, last: the probe sees what it must
    (tmp_path / "asks.py").write_text("import os, torch\nos.environ.get('RANK')\ntorch.cuda.is_available()\n")
    out = subprocess.run([sys.executable, "-c", probe, *modules, "asks"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.splitlines()[-1])
    assert found.pop("asks") == [["RANK"], [f"torch.cuda.is_available from {tmp_path / 'asks.py'}"]], out.stdout
    assert found == {m: [[], []] for m in modules}, out.stdout


def test_one_process_is_started_as_its_own_interpreter(tmp_path):
    """A server would save nothing for one process: it is started as ever."""
    assert _run(tmp_path, "ok", nproc=1) == (0, None)
    assert not list((tmp_path / "logs").glob("none_*/preload.log"))
    assert not _seen(tmp_path, 0)["preloaded"]
