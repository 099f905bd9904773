"""The job report (`trainyard report JOB`, `job.report(path)`): one self-contained HTML file.

Fast: reports of fake jobs (metrics rows and a describe() dict written here): every section, nothing fetched
from a network, and missing data explained instead of drawn empty. Slow: a real 2 x 2 local job with the
built-in trainer, its report written through the CLI and rendered in headless Chromium: the screenshot is
not blank and every plot container holds the SVG plotly drew.
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import uuid
import zlib
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import numpy as np
import pytest

from trainyard import Estimator
from trainyard.job.spec import build_spec
from trainyard.sdk.jobs import report
from trainyard.sdk.cli import main
from trainyard.sdk.jobs.joblog import stamped
from trainyard.sdk.jobs.jobstate import job_dir, write_json

plotly = pytest.importorskip("plotly", reason="the report needs plotly: pip install 'trainyard[report]'")

PLOTS = ["metrics", "training", "throughput", "step-time", "ranks", "communication", "memory", "checkpoints",
         "timeline"]
SECTIONS = PLOTS + ["health", "fingerprint", "cost"]
T0 = datetime(2026, 11, 24, 8, 0, 0, tzinfo=timezone.utc)
# a reference to anything outside the file, in its HTML (inline scripts' text left out: plotly.js holds URLs in
# strings it never fetches for these plots): a script or stylesheet by URL, or any src/href that leaves the file
EXTERNAL = re.compile(r"""(?:<script[^>]*\ssrc\s*=|<link[^>]*\shref\s*=|\s(?:src|href)\s*=\s*["']?(?:https?:)?//)""",
                      re.I)
CHROMIUM_MISSING = ("headless Chromium renders the report in this test and none is installed: apt-get install "
                    "chromium (Debian's package; `make test` installs it when run as root)")
# the bar colours of the intra-host and inter-host series (report._SIDE_COLOURS), as drawn: solid fills
BAR_RGB = [(0x1F, 0x77, 0xB4), (0xD6, 0x27, 0x28)]


class FakeJob:
    """What the report reads of a job: its name, spec, describe(), metrics() and log_text()."""

    def __init__(self, desc, rows, log=None, spec=None):
        self.name, self.desc, self.rows, self.spec = desc["TrainingJobName"], desc, rows, spec
        if log is not None:
            self.log_text = lambda: log

    def describe(self):
        return self.desc

    def metrics(self):
        return self.rows


def _row(step: int) -> dict:
    comm = {"tp": {"intra_bytes": 4_000_000, "inter_bytes": 0, "intra_s": 0.01, "inter_s": 0.0},
            "dp_shard": {"intra_bytes": 2_000_000, "inter_bytes": 6_000_000, "intra_s": 0.02, "inter_s": 0.09}}
    row = {"step": step, "loss": 8.0 - step * 0.5, "lr": 0.001 * step, "grad_norm": 2.0 / step,
           "tokens_per_s": 1000.0 + step, "mfu": 0.04, "tflops_per_device": 0.002, "step_time_s": 0.3,
           "compute_s": 0.18, "comm_intra_s": 0.03, "comm_inter_s": 0.09,
           "checkpoint_blocked_s": 0.25 if step % 3 == 0 else 0.0, "cpu_rss_bytes": 700_000_000 + step,
           "peak_memory_bytes": 2_000_000_000, "param_bytes": 10_000, "grad_bytes": 10_000, "optim_bytes": 20_000,
           "model_state_bytes": 40_000, "comm_by_dim": comm}
    if step % 3 == 0:  # every rank's compute of the steps compared (the built-in trainer's straggler check)
        row["rank_compute_s"] = {str(s): [0.18, 0.18, 0.18, 0.4 if step == 6 else 0.19] for s in range(step - 2, step + 1)}
    if step == 1:
        row["fingerprint"] = {"device": "cpu", "device_count": 2, "cpu_model": "Test CPU 9000", "torch": "2.13.0",
                              "peak_tflops_per_device": 0.08, "peak_source": "measured at start-up"}
    return row


def _full_job() -> FakeJob:
    def at(s):
        return T0 + timedelta(seconds=s)

    transitions = [{"Status": "Starting", "StartTime": at(0), "EndTime": at(2), "StatusMessage": "Launching"},
                   {"Status": "Training", "StartTime": at(2), "EndTime": at(60), "StatusMessage": "Training"},
                   {"Status": "Completed", "StartTime": at(60), "StatusMessage": "Training job completed"}]
    phases = {h: [{"Phase": "capacity", "StartTime": at(0.5), "EndTime": at(1 + i)},  # shaped as describe() has them
                  {"Phase": "code", "StartTime": at(1 + i), "EndTime": at(2 + i)},
                  {"Phase": "first_step", "StartTime": at(2 + i), "EndTime": at(8)}]
              for i, h in enumerate(["algo-1", "algo-2"])}
    phases["algo-1"].append({"Phase": "upload", "StartTime": at(58).isoformat()})  # an ISO string, not ended
    desc = {"TrainingJobName": "report-full", "TrainingJobStatus": "Completed", "SecondaryStatus": "Completed",
            "SecondaryStatusTransitions": transitions, "HostPhases": phases, "CreationTime": at(0),
            "TrainingStartTime": at(2), "TrainingEndTime": at(60), "LastModifiedTime": at(60),
            "ResourceConfig": {"InstanceType": "local", "InstanceCount": 2},
            "HyperParameters": {"model": '"tiny"', "steps": "6"},
            "Warnings": ["straggler: rank 3 (algo-2) 2.22x the median step for 3 steps"],
            "HealthCheck": {"Hosts": {h: {"compute_tflops": 0.1, "ratio": 1.0, "intra_gbps": 1.2, "inter_gbps": 0.6,
                                          "ranks": 2} for h in ("algo-1", "algo-2")}, "SlowHosts": []},
            "EstimatedCost": {"Amount": 0.0123, "Currency": "USD", "InstanceHours": 0.0167, "PricePerHour": 0.74,
                              "Market": "on-demand", "Source": "test price list"}}
    log = "\n".join(stamped(text, at(s).timestamp()) for s, text in [
        (10, "[algo-1/0] checkpoint step 3: staged in 0.250 s, uploading in the background"),
        (11, "[algo-2/3] checkpoint step 3 saved to s3://b/ckpt/step-00000003"),
        (12.5, "[algo-1/0] checkpoint step 3 saved to s3://b/ckpt/step-00000003"),
        (20, "[algo-1/0] checkpoint step 6: staged in 0.300 s, uploading in the background"),
        (21, "[algo-1/0] checkpoint step 6 saved to s3://b/ckpt/step-00000006")])
    spec = SimpleNamespace(processes_per_host=2, distribution={"mics": {"partition_group_size": 2}},
                           entry_point="trainyard.engine.train")
    return FakeJob(desc, [_row(s) for s in range(1, 7)], log, spec)


def _external(page: str) -> str | None:
    """The first reference out of the file in the page's HTML, else None."""
    m = EXTERNAL.search(re.sub(r"(<script[^>]*>).*?</script>", r"\1</script>", page, flags=re.S | re.I))
    return m.group(0) if m else None


def _sections(page: str) -> dict[str, str]:
    """{section id: its HTML}."""
    return dict(re.findall(r'<section id="([a-z-]+)">(.*?)</section>', page, re.S))


def test_every_section_drawn_from_a_full_job(tmp_path):
    path = report.write_report(_full_job(), str(tmp_path / "out" / "full.html"))
    assert path == str(tmp_path / "out" / "full.html")
    page = open(path, encoding="utf-8").read()
    sections = _sections(page)
    assert set(SECTIONS) | {"job"} <= set(sections)
    for key in PLOTS:
        assert f'data-plot="{key}"' in sections[key] and f'id="plot-{key}"' in sections[key], key
    assert 'class="missing"' not in page
    # the rows' peak was measured at start-up (a CPU): the MFU says so, where a datasheet's peak does not
    assert "final loss 5, median 1,004 tokens/s, median MFU 4.00% of a measured peak" in page
    assert "measured at start-up on this machine" in sections["throughput"]
    assert "Test CPU 9000" in sections["fingerprint"] and "measured at start-up" in sections["fingerprint"]
    assert "0.0123" in sections["cost"] and "on-demand" in sections["cost"] and "USD" in sections["cost"]
    assert "partition_group_size" in sections["job"] and "2 x local, 2 process(es) per host" in sections["job"]
    assert "no HostPhases" not in sections["timeline"]
    assert "startup: until training ran" in sections["timeline"]  # 8 s of 60: a zoomed panel of its own
    assert re.search(r'"y":\["algo-2"\]', sections["timeline"])  # a lane per host


def test_mfu_is_labelled_only_where_its_peak_was_measured():
    rows = [_row(1), _row(2)]
    assert report._summary(rows).endswith("median MFU 4.00% of a measured peak, 2 step rows (steps 1..2)")
    rows[0]["fingerprint"]["peak_source"] = "datasheet: H100 SXM bfloat16 dense (NVIDIA H100 80GB HBM3)"
    assert "median MFU 4.00%, 2 step rows" in report._summary(rows)
    del rows[0]["fingerprint"]  # a script's own rows: nothing says, nothing added
    assert "median MFU 4.00%, 2 step rows" in report._summary(rows)


def test_the_file_is_self_contained(tmp_path):
    from plotly.offline import get_plotlyjs

    page = open(report.write_report(_full_job(), str(tmp_path / "r.html")), encoding="utf-8").read()
    assert _external(page) is None, _external(page)
    assert _external('<img src="https://example.com/x.png">') and _external('<script src="plotly.min.js"></script>')
    assert page.count(get_plotlyjs()[:200]) == 1  # plotly.js inlined once, not once per plot
    assert page.count("Plotly.newPlot(") == len(PLOTS)


def test_checkpoint_times_read_from_the_log():
    assert report._checkpoint_log(_full_job()) == {3: {"staged_s": 0.25, "upload_s": 2.5},
                                                   6: {"staged_s": 0.3, "upload_s": 1.0}}


def test_missing_data_is_explained_not_drawn(tmp_path):
    desc = {"TrainingJobName": "report-empty", "TrainingJobStatus": "InProgress", "SecondaryStatus": "Starting",
            "ResourceConfig": {"InstanceType": "local", "InstanceCount": 1}}
    page = open(report.write_report(FakeJob(desc, []), str(tmp_path / "e.html")), encoding="utf-8").read()
    sections = _sections(page)
    assert "data-plot=" not in page and "Plotly.newPlot(" not in page
    for key in SECTIONS:
        assert '<p class="missing">' in sections[key], key
    assert "no metrics row has a `step`" in sections["training"]
    assert "neither SecondaryStatusTransitions nor HostPhases" in sections["timeline"]
    assert "no metrics row has a fingerprint" in sections["fingerprint"] and "no EstimatedCost" in sections["cost"]
    assert "no step metrics" in page


def test_an_older_job_draws_what_it_has_and_names_the_rest(tmp_path):
    desc = {"TrainingJobName": "report-old", "TrainingJobStatus": "Completed", "SecondaryStatus": "Completed",
            "SecondaryStatusTransitions": [{"Status": "Training", "StartTime": T0},
                                           {"Status": "Completed", "StartTime": T0 + timedelta(seconds=9)}],
            "TrainingEndTime": T0 + timedelta(seconds=9)}
    rows = [{"step": s, "loss": 3.0 / s} for s in (1, 2, 3)] + [{"timestamp": 1.0, "acc": 0.5}]
    page = open(report.write_report(FakeJob(desc, rows, log=""), str(tmp_path / "o.html")), encoding="utf-8").read()
    sections = _sections(page)
    assert 'data-plot="training"' in sections["training"]
    assert "Not in the metrics: lr, grad_norm" in sections["training"]
    assert "Not in the metrics: tokens_per_s, mfu, tflops_per_device" in sections["throughput"]
    assert "no compute_s" in sections["step-time"] and "no comm_by_dim" in sections["communication"]
    assert "no checkpoint_blocked_s" in sections["checkpoints"]
    assert 'data-plot="timeline"' in sections["timeline"] and "no HostPhases" in sections["timeline"]
    assert "final loss 1, 3 step rows (steps 1..3)" in page


def test_metrics_without_steps_are_drawn_against_time_and_the_step_sections_say_so_once(tmp_path):
    """(issue 34) The README's quickstart job: its loss comes from metric_definitions (rows of a time and a
    value, no step). The report drew nothing and showed the same long note in 5 sections."""
    desc = {"TrainingJobName": "report-quickstart", "TrainingJobStatus": "Completed", "SecondaryStatus": "Completed"}
    rows = [{"timestamp": T0.timestamp() + 10 * i, "loss": 1.0 / (i + 1)} for i in range(3)]
    page = open(report.write_report(FakeJob(desc, rows, log=""), str(tmp_path / "q.html")), encoding="utf-8").read()
    sections = _sections(page)
    assert 'data-plot="metrics"' in sections["metrics"] and "loss" in sections["metrics"]
    assert "by their log line" in sections["metrics"]
    assert page.count("no metrics row has a `step`") == 1  # the training section's, once
    for key in ("throughput", "step-time", "communication", "memory"):
        assert "see the first section" in sections[key], key


def test_a_scripts_own_step_metrics_are_drawn_and_the_known_ones_stay_in_their_sections(tmp_path):
    desc = {"TrainingJobName": "report-own", "TrainingJobStatus": "Completed", "SecondaryStatus": "Completed"}
    rows = [{"step": s, "loss": 3.0 / s, "accuracy": 0.5 + s / 10, "note": "text"} for s in (1, 2, 3)]
    page = open(report.write_report(FakeJob(desc, rows, log=""), str(tmp_path / "s.html")), encoding="utf-8").read()
    sections = _sections(page)
    assert "accuracy (by step)" in sections["metrics"] and "loss (by step)" not in sections["metrics"]
    assert 'data-plot="training"' in sections["training"]


def test_without_plotly_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'trainyard[report]'")):
        report.write_report(_full_job(), str(tmp_path / "x.html"))


def test_a_profiled_job_lists_its_traces_from_the_profiler_output(tmp_path):
    out = tmp_path / "out"
    spec = build_spec(job_name="report-prof", entry_point="trainyard.engine.train", entry_kind="module",
                      instance_type="local", processes_per_host=2, output_path=f"file://{out}",
                      profiler={"steps": [2, 3, 7], "ranks": [0, 1]})
    traces = out / "report-prof" / "profiler-output"
    traces.mkdir(parents=True)
    (traces / "rank0-steps2-3.pt.trace.json").write_bytes(b"x" * 3000)
    (traces / "rank1-steps7-7.pt.trace.json").write_bytes(b"y" * 10)
    desc = {**_full_job().desc, "TrainingJobName": "report-prof"}
    page = open(report.write_report(FakeJob(desc, [_row(s) for s in (1, 2)], spec=spec), str(tmp_path / "p.html")),
                encoding="utf-8").read()
    section = _sections(page)["profiler"]
    assert 'class="missing"' not in section
    assert "<th>rank0-steps2-3.pt.trace.json</th><td>2.9 KiB, file://" in section
    assert f"{traces}/rank0-steps2-3.pt.trace.json" in section and "<th>rank1-steps7-7.pt.trace.json</th><td>10 B" in section
    assert "Steps 2-3, 7 of rank(s) 0, 1" in section
    # traces not there (yet): said, not drawn
    spec2 = spec.evolve(job_name="report-prof2")
    page = open(report.write_report(FakeJob({**desc, "TrainingJobName": "report-prof2"}, [], spec=spec2),
                                    str(tmp_path / "q.html")), encoding="utf-8").read()
    assert "nothing under file://" in _sections(page)["profiler"] and "report-prof2/profiler-output" in page
    # a job without a profiler has no such section
    assert "profiler" not in _sections(open(report.write_report(_full_job(), str(tmp_path / "r.html")),
                                            encoding="utf-8").read())


# ---- a job folder: job.report() and the command line


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _job_folder(name: str) -> None:
    """A finished job's folder as the local backend leaves it: spec, status, algo-1's metrics, no log."""
    d = job_dir(name)
    os.makedirs(f"{d}/logs")
    os.makedirs(f"{d}/hosts/algo-1/output/data")
    spec = build_spec(job_name=name, entry_point="train.py", entry_kind="script", instance_type="local",
                      instance_count=2, processes_per_host=1, output_path="s3://bkt/out")
    with open(f"{d}/spec.json", "w") as fh:
        fh.write(spec.to_json())
    write_json(f"{d}/status.json", {"TrainingJobStatus": "Completed", "SecondaryStatus": "Completed",
                                    "SecondaryStatusTransitions": [], "CreationTime": T0.isoformat(),
                                    "LastModifiedTime": T0.isoformat(), "TrainingEndTime": T0.isoformat()})
    with open(f"{d}/hosts/algo-1/output/data/metrics.jsonl", "w") as fh:
        fh.writelines(json.dumps(_row(s)) + "\n" for s in (1, 2))


def test_job_report_and_the_command(home, tmp_path, monkeypatch, capsys):
    from trainyard.sdk.backends import open_job

    _job_folder("rep-job")
    monkeypatch.chdir(tmp_path)
    assert open_job("rep-job").report() == "rep-job-report.html" and os.path.isfile(tmp_path / "rep-job-report.html")
    out = tmp_path / "reports" / "r.html"
    assert main(["report", "rep-job", "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    assert "Trainyard job rep-job" in out.read_text(encoding="utf-8")
    assert main(["report", "no-such-job"]) == 2
    err = capsys.readouterr().err
    assert main(["metrics", "no-such-job"]) == 2  # the same one line as the other job commands
    assert err == capsys.readouterr().err and "no job named 'no-such-job'" in err
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    assert main(["report", "rep-job", "-o", str(out)]) == 1
    assert "pip install 'trainyard[report]'" in capsys.readouterr().err


# ---- a real job, rendered in headless Chromium


def png_pixels(path: str) -> np.ndarray:
    """(height, width, channels) of an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes): chunks,
    zlib, then each row's filter undone (PNG spec section 9)."""
    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        pos += 12 + n  # length, type, body, CRC
        if kind == b"IHDR":
            w, h, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
        elif kind == b"IDAT":
            idat.append(body)
    bpp = 3 if colour == 2 else 4  # RGB or RGBA
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, 1 + w * bpp)
    out = np.zeros((h, w * bpp), np.uint8)
    prev = out[0].copy()
    for y in range(h):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:  # None
            out[y] = line
        elif kind == 1:  # Sub: a running sum along the row, per channel
            out[y] = (np.cumsum(line.reshape(w, bpp).astype(np.int64), axis=0) % 256).reshape(-1)
        elif kind == 2:  # Up
            out[y] = line + prev
        else:  # Average, Paeth: each byte needs the one to its left, decoded
            out[y] = _unfilter_sequential(kind, line.tolist(), prev.tolist(), bpp)
        prev = out[y]
    return out.reshape(h, w, bpp)


def _unfilter_sequential(kind: int, line: list[int], up: list[int], bpp: int) -> list[int]:
    row = [0] * len(line)
    for i, x in enumerate(line):
        a, b = (row[i - bpp] if i >= bpp else 0), up[i]
        if kind == 3:
            row[i] = (x + ((a + b) >> 1)) & 255
            continue
        c = up[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        row[i] = (x + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return row


def _chromium(exe: str, profile: str, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on its own profile folder; scripts get 10 s of virtual time before the output."""
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={profile}", "--virtual-time-budget=10000", *args],
                          capture_output=True, text=True, timeout=180)


def _plot_containers(dom: str) -> dict[str, str]:
    """{plot key: the DOM inside its container, up to the next container or the end of its section}."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'<div class="plot" data-plot="([a-z-]+)"', dom)]
    out = {}
    for i, (pos, key) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(dom)
        out[key] = dom[pos:end].split("</section>", 1)[0]
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_report_of_a_real_two_by_two_job_renders_every_plot(tmp_path, capsys):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip(CHROMIUM_MISSING)
    hps = {"model": "tiny", "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "seed": 3, "lr": 0.01,
           "warmup_steps": 2, "decay_steps": 16, "steps": 6, "checkpoint_every": 3,  # as tests/e2e/test_builtin_trainer
           "straggler_check_every": 2}  # the ranks compared at steps 4 and 6 (after 2 warm-up steps): their plot
    est = Estimator(entry_point="trainyard.engine.train", instance_type="local", instance_count=2, processes_per_host=2,
                    hyperparameters=hps, checkpoint_s3_uri=f"s3://e2e-report/{uuid.uuid4().hex[:8]}", max_run=400)
    est.fit(logs=False)
    job = est.latest_training_job
    out = tmp_path / "report.html"
    assert main(["report", job.name, "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    page = out.read_text(encoding="utf-8")
    assert _external(page) is None
    assert 'class="missing"' not in _sections(page)["checkpoints"]

    url = out.as_uri()
    shot = tmp_path / "report.png"
    r = _chromium(exe, str(tmp_path / "profile"), f"--screenshot={shot}", "--window-size=1200,6000", url)
    assert shot.exists(), r.stderr[-3000:]
    dom = _chromium(exe, str(tmp_path / "profile"), "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-3000:]

    containers = _plot_containers(dom.stdout)
    assert sorted(containers) == sorted(PLOTS)  # the real job has data for every plot
    for key, inner in containers.items():  # drawn: plotly's SVG with at least one trace in it
        assert 'class="main-svg"' in inner and re.search(r'class="trace (scatter|bars)', inner), key

    px = png_pixels(str(shot))
    assert px.shape[:2] == (6000, 1200)
    flat = px[:, :, :3].reshape(-1, 3)
    colours = np.unique(flat[::5], axis=0)
    assert len(colours) > 50, f"the screenshot is nearly blank: {len(colours)} colours"
    for rgb in BAR_RGB:  # the intra-/inter-host bars were painted, not only their containers
        assert (flat == rgb).all(axis=1).sum() > 500, rgb
