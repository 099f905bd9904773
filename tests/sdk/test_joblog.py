"""A job's log: stamped lines per file, read back merged in time order (trainyard/sdk/jobs/joblog.py)."""
import os
import subprocess
import sys
import time

from trainyard.sdk.jobs.joblog import LinePump, LogReader, parse, stamp, stamped, text_of
from trainyard.sdk.jobs.metrics import scrape_files


def test_stamp_round_trips_to_the_millisecond():
    t = 1795939262.123  # 2026-11-29T...
    s = stamp(t)
    assert s.endswith(".123Z") and len(s) == 24
    back, text = parse(stamped("[algo-1/0] step 1", t))
    assert abs(back - t) < 1e-3 and text == "[algo-1/0] step 1"
    assert parse("no stamp here") == (None, "no stamp here")
    assert text_of(stamped("  indented text ", t)) == "  indented text "


def test_files_are_merged_by_time_and_unstamped_lines_follow_their_predecessor(tmp_path):
    a, b = tmp_path / "supervisor.log", tmp_path / "algo-1.log"
    a.write_text(f"{stamped('[trainyard] Starting', 100.0)}\n{stamped('[trainyard] Completed', 103.0)}\n")
    b.write_text(f"{stamped('[algo-1/0] step 1', 101.0)}\nTraceback-like unstamped line\n"
                 f"{stamped('[algo-1/0] step 2', 102.0)}\npartial line without newline")
    lines = LogReader([str(a), str(b)]).poll(final=True)
    assert [text_of(x) for x in lines] == ["[trainyard] Starting", "[algo-1/0] step 1",
                                           "Traceback-like unstamped line", "[algo-1/0] step 2",
                                           "[trainyard] Completed"]
    assert parse(lines[2])[0] == parse(lines[1])[0]  # took the time of the line before it


def test_a_follower_holds_back_fresh_lines_so_a_late_earlier_line_comes_first(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    now = time.time()
    a.write_text(stamped("second", now + 5) + "\n")
    reader = LogReader([str(a), str(b)])
    assert reader.poll() == []  # too fresh: another file may still bring an earlier line
    b.write_text(stamped("first", now + 4) + "\n")  # written later, stamped earlier
    old = stamped("old", now - 10)
    with open(a, "a") as fh:
        fh.write(old + "\n")
    assert [text_of(x) for x in reader.poll()] == ["old"]  # old enough to be sure of; the others wait
    assert [text_of(x) for x in reader.poll(final=True)] == ["first", "second"]


def test_the_pump_stamps_every_line_of_a_pipe_and_keeps_lines_whole(tmp_path):
    out = tmp_path / "algo-1.log"
    code = "import sys\nfor i in range(200): sys.stdout.write(f'line {i}\\n'); sys.stdout.flush()\nprint('no newline at the end', end='')"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    pump = LinePump(p.stdout, str(out))
    p.wait(timeout=60)
    assert pump.join(10)
    lines = out.read_text().splitlines()
    assert len(lines) == 201
    times = [parse(x)[0] for x in lines]
    assert None not in times and times == sorted(times)
    assert [text_of(x) for x in lines] == [f"line {i}" for i in range(200)] + ["no newline at the end"]


def test_scraped_metrics_carry_the_time_of_their_line(tmp_path):
    log = tmp_path / "algo-1.log"
    log.write_text(f"{stamped('[algo-1/0] loss=2.5', 1000.0)}\n{stamped('[algo-1/0] loss=1.5', 1010.0)}\n")
    os.utime(log, (5000, 5000))
    rows = scrape_files([str(log)], [{"Name": "loss", "Regex": "^loss=([0-9.]+)"}])  # anchored after the prefix
    assert [(round(r["timestamp"]), r["loss"]) for r in rows] == [(1000, 2.5), (1010, 1.5)]


def test_an_older_jobs_unstamped_file_reads_as_it_is(tmp_path):
    old = tmp_path / "algo-1.log"
    old.write_text("[algo-1/0] step 1\n[algo-1/0] step 2\n")
    assert LogReader([str(old)]).poll(final=True) == ["[algo-1/0] step 1", "[algo-1/0] step 2"]
