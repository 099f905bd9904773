"""bench/kernels_tune.py's plumbing on CPU: its clear exit without a GPU, and under --tiny (Triton's interpreter,
tiny shapes) every candidate of an op run, checked against eager and written to the JSON. Its times mean nothing
here; the sweep itself is for a GPU."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "kernels_tune.py")


def _run(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_without_a_gpu_it_says_so():
    proc = _run("--json", "/nonexistent/never-written.json", env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    assert _run("--ops", "softmax").returncode == 2  # argparse: unknown op named


def test_tiny_runs_every_candidate_against_eager(tmp_path):
    out = tmp_path / "tune.json"
    proc = _run("--tiny", "--ops", "swiglu,ce", "--repeats", "1", "--no-compile", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import kernels_tune
    finally:
        sys.path.pop(0)
    for op in ("swiglu", "ce"):
        ours = [r for r in result["rows"] if r["op"] == op and r["impl"].startswith("ours")]
        assert [r["impl"] for r in ours] == [f"ours: {name}" for name, _ in kernels_tune.CANDIDATES[op]]
        for r in ours:  # each ran, under its own TUNING, and matches eager
            assert "note" not in r and r["ms"] > 0 and r["max_rel_err"] < 1e-5, r
        assert result["summary"][op]["best"] is not None
    assert {r["impl"] for r in result["rows"] if r["op"] == "swiglu"} >= {"eager", "compile", "liger"}
    assert result["compile_check"] == {"note": "skipped (--no-compile)"}
