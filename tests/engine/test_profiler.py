"""torch.profiler over the steps a job names on the ranks it names (components/profiler.py through te.mark_step,
te.log_metrics and te.finish), in one process with a profilerconfig.json written here: exactly those steps are
recorded, as a Chrome trace JSON per run of steps and rank; nothing on a rank that is not named."""
import json
import os

import pytest
import torch
from torch import nn

from trainyard.engine.components.contract import PROFILER_CONFIG
from trainyard.engine.components.profiler import StepProfiler, runs


def _job(tmp_path, monkeypatch, steps, ranks=(0,)) -> str:
    """profilerconfig.json as the contract writes it; returns the traces folder."""
    config, out = tmp_path / "config", tmp_path / "profiler"
    config.mkdir()
    (config / PROFILER_CONFIG).write_text(json.dumps({"ProfilingParameters": {"LocalPath": str(out)},
                                                      "Steps": list(steps), "Ranks": list(ranks)}))
    monkeypatch.setenv("SM_INPUT_CONFIG_DIR", str(config))
    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(tmp_path / "data"))
    return str(out)


def _train(steps: int, log: bool = True) -> None:
    """A user's loop: one Linear forward (one aten::addmm) and backward per step."""
    import trainyard.engine as te

    te.init({})
    try:
        model = nn.Linear(16, 16)
        x = torch.randn(4, 16)
        for step in range(1, steps + 1):
            te.mark_step(step)
            loss = model(x).square().mean()
            loss.backward()
            if log:
                te.log_metrics(step, {"loss": loss.item()})
    finally:
        te.finish()


def _trace(path: str) -> list[dict]:
    with open(path) as fh:
        trace = json.load(fh)
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"], "no events in the Chrome trace"
    return trace["traceEvents"]


def _count(events: list[dict], name: str) -> int:
    return sum(1 for e in events if e.get("name") == name)


def test_the_named_steps_of_rank_0_make_one_chrome_trace(tmp_path, monkeypatch, capsys):
    out = _job(tmp_path, monkeypatch, steps=[2, 3])
    _train(5)
    assert os.listdir(out) == ["rank0-steps2-3.pt.trace.json"]  # no half-written file left beside it
    events = _trace(f"{out}/rank0-steps2-3.pt.trace.json")
    assert _count(events, "aten::addmm") == 2  # the forward of steps 2 and 3, not of 1, 4 or 5
    assert _count(events, "[memory]") > 0  # profile_memory: the allocations
    assert any(e.get("args", {}).get("Input Dims") for e in events if e.get("name") == "aten::addmm")  # shapes
    assert "profiler: steps 2-3 of rank 0 written to rank0-steps2-3.pt.trace.json" in capsys.readouterr().out


def test_a_rank_not_named_records_nothing(tmp_path, monkeypatch):
    out = _job(tmp_path, monkeypatch, steps=[1, 2], ranks=[1])
    _train(3)
    assert not os.path.exists(out)
    assert StepProfiler.from_contract({"steps": [1], "ranks": [1], "dir": out}, 0, torch.device("cpu")) is None


def test_without_log_metrics_a_run_ends_at_the_next_step_or_at_finish(tmp_path, monkeypatch):
    out = _job(tmp_path, monkeypatch, steps=[1, 3])
    _train(3, log=False)  # step 3, the last, is still being recorded when finish() comes
    assert sorted(os.listdir(out)) == ["rank0-steps1-1.pt.trace.json", "rank0-steps3-3.pt.trace.json"]
    for name in os.listdir(out):
        assert _count(_trace(f"{out}/{name}"), "aten::addmm") == 1


def test_runs_and_a_job_resumed_in_the_middle_of_one(tmp_path):
    assert runs([7, 2, 3, 9, 8]) == [(2, 3), (7, 9)]
    prof = StepProfiler(steps=[2, 3, 4], rank=3, out_dir=str(tmp_path), device=torch.device("cpu"), say=lambda m: None)
    for step in (3, 4, 5):  # resumed after step 2: steps 3 and 4 of the run are recorded
        prof.at_step(step)
        torch.ones(2) @ torch.ones(2)
        prof.after_step(step)
    prof.close()
    assert prof.written == [f"{tmp_path}/rank3-steps3-4.pt.trace.json"] and os.listdir(tmp_path) == [
        "rank3-steps3-4.pt.trace.json"]


def test_a_profiler_without_a_folder_is_refused():
    with pytest.raises(ValueError, match="no folder"):
        StepProfiler(steps=[1], rank=0, out_dir="", device=torch.device("cpu"))


def test_on_cuda_the_run_also_leaves_a_memory_snapshot(tmp_path, monkeypatch):
    """The CUDA side without a GPU: the allocator history is recorded over the run (torch.cuda.memory's private
    API, fakes here) and dumped beside the trace, and the profiler asks for CUDA activities."""
    from trainyard.engine.components import profiler as module

    calls = []

    class FakeProfile:
        def __init__(self, activities, record_shapes, profile_memory):
            calls.append(("profile", tuple(activities), record_shapes, profile_memory))

        def start(self):
            calls.append("start")

        def stop(self):
            calls.append("stop")

        def export_chrome_trace(self, path):
            open(path, "w").write('{"traceEvents": [{"name": "x"}]}')

    monkeypatch.setattr(module, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls.append(("history", enabled, kw.get("max_entries"))))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: open(path, "wb").write(b"snapshot"))
    prof = StepProfiler(steps=[4], rank=2, out_dir=str(tmp_path), device=torch.device("cuda", 0), say=lambda m: None)
    prof.at_step(4)
    prof.after_step(4)
    assert calls == [("history", "all", module.MEMORY_HISTORY_ENTRIES),
                     ("profile", (module.ProfilerActivity.CPU, module.ProfilerActivity.CUDA), True, True),
                     "start", "synchronize", "stop", ("history", None, None)]
    assert sorted(os.listdir(tmp_path)) == ["rank2-steps4-4.memory.pickle", "rank2-steps4-4.pt.trace.json"]
