"""A host's timed phases (container/phases.py) and the first-step watch (container/firststep.py): fast, no job."""
import json
import os
from datetime import datetime, timedelta, timezone

from trainyard.container.firststep import FirstStepWatch, rank_logs
from trainyard.engine.components.contract import FIRST_STEP_ENV, mark_first_step
from trainyard.container.phases import (IMAGE_END_ENV, IMAGE_START_ENV, USERDATA_START_ENV, PhaseLog, boot_phases,
                                        merge, read_phases, settle)

T0 = datetime(2026, 11, 24, 8, 0, 0, tzinfo=timezone.utc)


def _t(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat()


def test_a_phase_log_saves_every_change_for_another_process(tmp_path):
    path = str(tmp_path / "deep" / "host-phases.json")  # its folder is made
    log = PhaseLog(path)
    log.add("capacity", _t(0), _t(1))
    with log.timed("code"):
        assert read_phases(path)[-1] == {"Phase": "code", "StartTime": log.entries[-1]["StartTime"]}  # running
    log.start("first_step")
    assert [p["Phase"] for p in read_phases(path)] == ["capacity", "code", "first_step"]
    assert "EndTime" in read_phases(path)[1] and "EndTime" not in read_phases(path)[2]
    log.drop("first_step")  # never seen: it did not happen
    with log.timed("probe", enabled=False):
        pass
    assert [p["Phase"] for p in read_phases(path)] == ["capacity", "code"]
    try:
        with log.timed("upload"):
            raise OSError("network down")
    except OSError:
        pass
    assert read_phases(path)[-1]["Phase"] == "upload" and "EndTime" in read_phases(path)[-1]
    assert read_phases(str(tmp_path / "none.json")) == []
    (tmp_path / "half.json").write_text('{"phases": [')
    assert read_phases(str(tmp_path / "half.json")) == []


def test_merge_orders_by_start_and_settle_ends_what_still_runs():
    supervisor = [{"Phase": "data", "StartTime": _t(0), "EndTime": _t(2)}]
    driver = [{"Phase": "capacity", "StartTime": _t(2.5), "EndTime": _t(3)}, {"Phase": "code", "StartTime": _t(3)},
              {"Phase": "first_step", "StartTime": _t(5)}]
    merged = merge(driver, supervisor)
    assert [p["Phase"] for p in merged] == ["data", "capacity", "code", "first_step"]
    assert settle(merged, _t(9)) == [*merged[:2], {"Phase": "code", "StartTime": _t(3), "EndTime": _t(9)}]
    assert settle(merged, _t(1))[2]["EndTime"] == _t(3)  # never before its start


def test_boot_phases_from_the_launch_time_and_the_user_datas_times():
    env = {USERDATA_START_ENV: "2026-11-24T08:00:40.125+00:00", IMAGE_START_ENV: "2026-11-24T08:00:41.000+00:00",
           IMAGE_END_ENV: "2026-11-24T08:01:30.500+00:00"}
    capacity, image = boot_phases(_t(0), _t(95), env)
    assert capacity == {"Phase": "capacity", "StartTime": _t(0), "EndTime": _t(40.125)}
    assert image == {"Phase": "image", "StartTime": _t(41), "EndTime": _t(90.5)}
    # without the user data's times (an agent started by hand): capacity ends at the agent's start, no image
    assert boot_phases(_t(0), _t(95), {}) == [{"Phase": "capacity", "StartTime": _t(0), "EndTime": _t(95)}]
    assert boot_phases(None, _t(95), {IMAGE_START_ENV: "garbage", IMAGE_END_ENV: _t(1)}) == []


def _watch(tmp_path, regexes=(), seen=None):
    metrics = tmp_path / "output" / "data" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    return FirstStepWatch(str(metrics), rank_logs(str(tmp_path / "torchrun")), regexes,
                          on_seen=(seen if seen is not None else []).append), metrics


def _rank_file(tmp_path, local_rank: int, name: str = "stdout.log"):
    d = tmp_path / "torchrun" / "none_abc" / "attempt_0" / str(local_rank)
    d.mkdir(parents=True, exist_ok=True)
    return d / name


def test_the_first_step_is_a_new_metrics_row(tmp_path):
    watch, metrics = _watch(tmp_path)
    assert not watch.check()
    metrics.write_text('{"step": 1, "loss": 2.')  # half a line: not yet
    assert not watch.check()
    with open(metrics, "a") as fh:
        fh.write('5}\n')
    assert watch.check()
    resumed, _ = _watch(tmp_path)  # a resumed job appends to the same file: the old rows do not count
    assert not resumed.check()


def test_the_first_step_is_a_step_line_or_a_metric_definitions_match(tmp_path):
    watch, _ = _watch(tmp_path, regexes=[r"world=(\d+)"])
    out = _rank_file(tmp_path, 1)
    out.write_text("loading\nresumed from step 3 at s3://b/ckpt\nwarmup_steps=10\n")
    assert not watch.check()
    with open(out, "a") as fh:
        fh.write("rank=1 world=4\n")  # what the job's metric_definitions turn into a metric row
    assert watch.check()
    plain, _ = _watch(tmp_path / "other")
    err = _rank_file(tmp_path / "other", 0, "stderr.log")
    err.write_text("Step 10: loss 1.2\n")
    assert plain.check()


def test_the_watch_thread_reports_once_and_stops(tmp_path):
    seen: list[str] = []
    watch, metrics = _watch(tmp_path, seen=seen)
    watch.poll = 0.01
    watch.start()
    metrics.write_text(json.dumps({"step": 1}) + "\n")
    watch._thread.join(timeout=10)
    watch.stop()
    assert watch.seen and len(seen) == 1 and datetime.fromisoformat(seen[0]).tzinfo is not None
    idle, _ = _watch(tmp_path / "idle")
    idle.start()
    idle.stop()
    assert not idle.seen and os.path.isdir(tmp_path / "idle")


def test_the_first_step_is_the_engines_marker_file(tmp_path, monkeypatch):
    marker = tmp_path / "torchrun" / "first-step"
    marker.parent.mkdir(parents=True)
    watch = FirstStepWatch(str(tmp_path / "metrics.jsonl"), rank_logs(str(tmp_path / "torchrun")), [],
                           on_seen=[].append, marker=str(marker))
    assert not watch.check()
    monkeypatch.delenv(FIRST_STEP_ENV, raising=False)
    mark_first_step()  # outside a job: nothing
    assert not marker.exists()
    monkeypatch.setenv(FIRST_STEP_ENV, str(marker))
    mark_first_step()
    mark_first_step()  # every rank calls it: the second is a no-op
    assert watch.check()
