"""The live progress line of a followed job (sdk/jobs/live.py): `trainyard logs -f` on a pseudo-terminal draws it
with rich under the log lines; piped, the same figures come as plain `[progress]` lines with no control
characters. Jobs are folders faked as in test_cli.py, advanced by a timer while the command follows them."""
import io
import json
import os
import pty
import re
import select
import threading
import time
from datetime import datetime, timezone

from tests.sdk.test_cli import _piped, _sleeper, _tty_env, fake_job, home  # noqa: F401 (fixture)
from trainyard.sdk import packaging
from trainyard.sdk.jobs import live
from trainyard.sdk.jobs.joblog import stamped
from trainyard.sdk.jobs.jobstate import read_json, write_json
from trainyard.sdk.backends.local.backend import LocalJob

ROWS = [{"step": k, "loss": 3.0 - 0.5 * k, "tokens_per_s": 1000.0 * k, "mfu": 0.1 * k, "step_time_s": 30.0 * k}
        for k in range(1, 5)]
CONTROL = re.compile(r"\x1b\[")


def _advance(d, rows, lines, after_s=1.5):
    """After `after_s`: the job writes its rows and lines, then ends Completed."""
    def go():
        with open(f"{d}/hosts/algo-1/output/data/metrics.jsonl", "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        with open(f"{d}/logs/algo-1.log", "a") as fh:
            fh.writelines(stamped(line) + "\n" for line in lines)
        doc = read_json(f"{d}/status.json")
        end = datetime.now(timezone.utc).isoformat()
        doc.update(TrainingJobStatus="Completed", SecondaryStatus="Completed", TrainingEndTime=end,
                   LastModifiedTime=end)
        write_json(f"{d}/status.json", doc)
    t = threading.Timer(after_s, go)
    t.start()
    return t


def _follow(name, rows, lines, runner):
    sleeper = _sleeper()
    try:
        d = fake_job(name, "InProgress", metrics=rows[:2], log="[algo-1/0] step 1/4\n[algo-1/0] step 2/4",
                     supervisor_pid=sleeper.pid)
        timer = _advance(d, rows[2:], lines)
        out = runner(["logs", name, "-f"], _tty_env())
        timer.join()
        return out
    finally:
        sleeper.kill()


def test_logs_follow_draws_a_live_line_on_a_terminal(home, on_a_tty):
    out = _follow("live-tty", ROWS, ["[algo-1/0] step 3/4", "[algo-1/0] step 4/4"], on_a_tty)
    assert CONTROL.search(out)  # rich redraws the line in place
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    # 2 steps left at the last rows' 45 s a step
    assert "Training | step 2/4 | loss 2.0000 | 2,000 tok/s | MFU 20.0% | 1h00m0" in plain and "ETA 1m30s" in plain
    final = "Completed | step 4/4 | loss 1.0000 | 4,000 tok/s | MFU 40.0% |"
    assert final in plain and plain.rstrip().splitlines()[-1].startswith(final)  # the last state stays
    for k in range(1, 5):  # every log line once, above the live line
        assert plain.count(f"[algo-1/0] step {k}/4") == 1


def test_logs_follow_prints_plain_progress_lines_when_piped(home):
    out = _follow("live-pipe", ROWS, ["[algo-1/0] step 3/4", "[algo-1/0] step 4/4"], _piped)
    assert not CONTROL.search(out) and "\r" not in out
    progress = [line for line in out.splitlines() if line.startswith("[progress] ")]
    assert progress[0].startswith("[progress] Training | step 2/4 | loss 2.0000")
    assert progress[-1].startswith("[progress] Completed | step 4/4 | loss 1.0000 | 4,000 tok/s | MFU 40.0% |")
    assert out.splitlines()[-1] == progress[-1]
    assert [line.split(" ", 1)[1] for line in out.splitlines() if "step" in line and "[algo" in line] == [
        f"[algo-1/0] step {k}/4" for k in range(1, 5)]


def test_a_script_without_rows_is_followed_by_its_step_lines(home):
    lines = ["[algo-1/0] epoch 1 step 3/4 loss=0.75", "[algo-1/0] step 4/4 loss=0.5"]
    out = _follow("live-lines", [], lines, _piped)
    assert "[progress] Completed | step 4/4 | loss 0.5000 |" in out


def test_step_lines_without_a_total_and_metric_definitions_feed_the_line(home):
    """(issue 34) `step 5 loss 4.97` (the BYOM example's own output) and `step=5 loss=4.9` give the step (N from the
    `steps` hyperparameter) and the loss; a `metric_definitions` entry named loss feeds the loss of lines that name
    no step (the README quickstart's `epoch=E loss=L`)."""
    fake_job("forms", "InProgress", metric_definitions=[{"Name": "train:loss", "Regex": "loss=([0-9.]+)"}])
    p = live.Progress(LocalJob("forms"))
    p.total = 20  # as the steps hyperparameter would give it
    p.observe("step 5 loss 4.97", 1.0)
    assert (p.step, p.total, p.loss) == (5, 20, 4.97)
    p.observe("step=6 loss=4.9", 2.0)
    assert (p.step, p.loss) == (6, 4.9)
    p.observe("epoch=2 loss=0.125", 3.0)
    assert (p.step, p.loss) == (6, 0.125)
    p.observe("warmup_steps 7 done; step_time_s=3", 4.0)  # words that only contain "step" are not steps
    assert p.step == 6
    snap = p.snapshot()
    assert "step 6/20" in snap.text() and "loss 0.1250" in snap.text()


def test_progress_eta_and_quiet_plain_mode(home, monkeypatch):
    sleeper = _sleeper()
    try:
        fake_job("eta", "InProgress", supervisor_pid=sleeper.pid)
        p = live.Progress(LocalJob("eta"))
        for k, when in ((10, 100.0), (11, 102.0), (12, 104.0)):  # a script's lines, 2 s apart
            p.observe(f"step {k}/100 loss 1.5", when)
        snap = p.snapshot()  # 2 steps in 4 s: 88 steps left take 176 s
        assert (snap.step, snap.total, snap.eta_s, snap.phase) == (12, 100, 176.0, "Training")
        assert "ETA 2m56s" in snap.text()
        monkeypatch.setenv(live.MODE_ENV, "plain")
        out = io.StringIO()
        with live.Follow(LocalJob("eta"), show_lines=False, stream=out) as view:
            view.line(stamped("[algo-1/0] step 1/2"))
            view.tick()
        assert out.getvalue() == ""  # logs="None" piped: silent, as before
    finally:
        sleeper.kill()


def test_the_line_says_when_the_mfu_is_against_a_measured_peak(home):
    sleeper = _sleeper()
    try:
        first = {**ROWS[0], "fingerprint": {"device": "cpu", "peak_source": "measured at start-up: 1024^3 ..."}}
        fake_job("peak", "InProgress", metrics=[first, ROWS[1]], supervisor_pid=sleeper.pid)
        assert "MFU 20.0% of a measured peak |" in live.Progress(LocalJob("peak")).snapshot().text()
        gpu = {**ROWS[0], "fingerprint": {"device": "cuda", "peak_source": "datasheet: H100 SXM bfloat16 dense"}}
        fake_job("datasheet", "InProgress", metrics=[gpu, ROWS[1]], supervisor_pid=sleeper.pid)
        assert "MFU 20.0% |" in live.Progress(LocalJob("datasheet")).snapshot().text()
    finally:
        sleeper.kill()


def test_the_line_shows_the_newest_warning_of_the_rows(home):
    sleeper = _sleeper()
    try:
        named = {**ROWS[1], "warnings": ["straggler: rank 3 (algo-2) 1.42x the median step for 20 steps"]}
        fake_job("slow", "InProgress", metrics=[ROWS[0], named], supervisor_pid=sleeper.pid)
        text = live.Progress(LocalJob("slow")).snapshot().text()
        assert text.endswith(f"WARNING at step {named['step']}: straggler: rank 3 (algo-2) 1.42x the median step "
                             "for 20 steps"), text
        fake_job("clean", "InProgress", metrics=ROWS[:2], supervisor_pid=sleeper.pid)
        assert "WARNING" not in live.Progress(LocalJob("clean")).snapshot().text()
    finally:
        sleeper.kill()


def test_duration():
    assert [live.duration(s) for s in (0, 59.9, 61, 3600 + 62)] == ["0s", "59s", "1m01s", "1h01m02s"]


def test_code_upload_says_what_it_shipped(tmp_path, s3_bucket, capsys):
    (tmp_path / "train.py").write_text("x")
    (tmp_path / "weights.bin").write_bytes(os.urandom(3 << 20))  # incompressible: 3 MiB packaged
    pkg = packaging.package(str(tmp_path))
    uri = packaging.upload(pkg, f"s3://{s3_bucket}/code")
    err = capsys.readouterr().err
    assert re.fullmatch(rf"\[trainyard\] code: 2 file\(s\), 3\.0 MiB packaged, uploaded to {re.escape(uri)} "
                        r"in [0-9.]+ s\n", err), err
    packaging.upload(pkg, f"s3://{s3_bucket}/code")
    assert "has the same content already, not uploaded" in capsys.readouterr().err


def test_transfer_draws_a_bar_on_a_terminal(monkeypatch):
    monkeypatch.delenv(live.MODE_ENV, raising=False)
    for k in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(k, raising=False)
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as tty:
        with live.Transfer("upload", 4 << 20, stream=tty) as t:
            for _ in range(4):
                t.advance(1 << 20)
                time.sleep(0.3)
        tty.flush()
        out = b""
        while select.select([master], [], [], 0.2)[0]:
            out += os.read(master, 65536)
    os.close(master)
    text = out.decode()
    assert CONTROL.search(text) and "4.2 MB" in text  # rich's bar counts decimal megabytes
    assert re.search(r"\[trainyard\] upload in [0-9.]+ s", text)
