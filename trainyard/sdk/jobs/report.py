"""One job's report: a single self-contained HTML file of plots and tables (`trainyard report JOB`,
`job.report(path)`).

Read from the job handle only: `describe()` (status, times, `SecondaryStatusTransitions`, `HostPhases`,
`EstimatedCost`), `metrics()` (first, every number the job wrote that no other section plots, against its step,
or against its time for rows without one (`metric_definitions` scraped from the log); then the rows that have
a `step`: loss, lr, grad_norm, throughput, the step's time split, communication per mesh dimension, memory,
checkpoint stalls; the first `fingerprint`), the spec
(instance type and count, distribution) and `log_text()` (the trainer's checkpoint lines). Every section
is drawn from the data that exists; one whose data is missing says what is missing and why. A job with a
profiler also gets a table of its trace files (name, size, where they are), listed from its
`profiler-output/` prefix in object storage, where every host synced them.

plotly (the `report` extra) draws the plots; plotly.js is inlined once, in the page's head, so the file
opens without a network.
"""
from __future__ import annotations

import html
import json
import os
import re
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone

from trainyard.container.phases import FIRST_STEP
from trainyard.job import catalog, storage
from trainyard.sdk.jobs.format import human_duration, human_size, local_time
from trainyard.sdk.jobs.joblog import parse
from trainyard.sdk.jobs.metrics import measured_peak
from trainyard.sdk.store import ensure_store

INSTALL_HINT = "pip install 'trainyard[report]'"
PLOT_HEIGHT = 220  # pixels per subplot row: the page is one readable column of plots
# lines of one panel: equal values (parameters and gradients) stay told apart
DASHES = ["solid", "dash", "dot", "dashdot"]
PERCENT = 100.0  # MFU is a fraction in the metrics, plotted in percent
# no logo and no "Share chart..." button: the modebar's links out of the file
PLOT_CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["sendChartToCloud"]}
STARTUP_ZOOM = 0.2
NO_STEPS = ("no metrics row has a `step`: the built-in trainer appends one per step to metrics.jsonl; a script "
            "of your own appends rows such as {\"step\": 10, \"loss\": 2.3} to $SM_OUTPUT_DATA_DIR/metrics.jsonl")
MAX_PANELS = 12  # the metrics section's panels; the others are named
# what the sections after the metrics one plot from step rows (the metrics section draws the rest)
PLOTTED = frozenset({"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "tflops_per_device", "compute_s",
                     "comm_intra_s", "comm_inter_s", "checkpoint_blocked_s", "model_state_bytes", "param_bytes",
                     "grad_bytes", "optim_bytes", "peak_memory_bytes", "cpu_rss_bytes"})
_STAGED = re.compile(r"checkpoint step (\d+): staged in ([0-9.]+) s")
_SAVED = re.compile(r"checkpoint step (\d+) saved to ")


def _plotly():
    """plotly's graph objects and subplots, imported here: plotly is an optional extra."""
    try:
        import plotly.graph_objects as go
        from plotly.offline import get_plotlyjs
        from plotly.subplots import make_subplots
    except ImportError as e:
        raise ImportError(f"the job report draws its plots with plotly, which is not installed: {INSTALL_HINT}") from e
    return go, make_subplots, get_plotlyjs


@dataclass
class Section:
    """One part of the page: a plot (`fig`), a table (`table`: rows of label and value), and/or a `note`
    (what is missing and why, or how to read what is shown)."""

    key: str
    title: str
    fig: object | None = None
    table: list[tuple[str, str]] | None = None
    note: str = ""


def write_report(job, path: str) -> str:
    """Write the report of `job` (a TrainingJob, or anything with describe() and metrics()) to `path`;
    returns `path`."""
    go, make_subplots, get_plotlyjs = _plotly()
    desc = job.describe()
    rows = job.metrics()
    steps = [r for r in rows if isinstance(r.get("step"), (int, float))]
    p = _Plots(go, make_subplots, steps)
    stepped = [p.training(), p.throughput(), p.step_time(), p.ranks(desc), p.communication(), p.memory()]
    if not steps:  # one note says so (in the training section); the others point to the metrics plotted by time
        for section in stepped[1:]:
            section.note = "no step rows: see the first section for the metrics the job has"
    extra = p.metrics(rows)  # left out when the sections below plot every metric the job has
    sections = [*([extra] if extra.fig is not None or not rows else []), *stepped, p.checkpoints(_checkpoint_log(job)),
                p.timeline(desc), _health(desc), _fingerprint(rows), _cost(desc)]
    traces = _profiler_traces(job)
    if traces is not None:  # a job without a profiler has none to list
        sections.append(traces)
    page = _page(job, desc, steps, sections, get_plotlyjs())
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
    return path


def _series(steps: list[dict], key: str, scale: float = 1.0) -> tuple[list, list]:
    """(steps, values x scale) of the rows that have a number under `key`."""
    pts = [(r["step"], r[key]) for r in steps if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    return [s for s, _ in pts], [v * scale for _, v in pts]


def _missing(keys: list[str], steps: list[dict]) -> list[str]:
    return [k for k in keys if not _series(steps, k)[0]]


class _Plots:
    """The plotted sections, each from the step rows (and describe() / the log for the last two)."""

    def __init__(self, go, make_subplots, steps: list[dict]):
        self.go, self.make_subplots, self.steps = go, make_subplots, steps

    def _stacked(self, panels: list[tuple[str, list[tuple[str, str]]]], *, yformat: dict | None = None):
        """One subplot row per (y title, [(key, legend name)]) panel that has data, lines over the step."""
        panels = [(t, [(k, n) for k, n in lines if _series(self.steps, k)[0]]) for t, lines in panels]
        panels = [(t, lines) for t, lines in panels if lines]
        if not panels:
            return None
        fig = self.make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.08)
        for i, (title, lines) in enumerate(panels, 1):
            for j, (key, name) in enumerate(lines):
                x, y = _series(self.steps, key, PERCENT if key == "mfu" else 1.0)
                fig.add_trace(self.go.Scatter(x=x, y=y, name=name, mode="lines+markers", marker={"size": 4},
                                              line={"dash": DASHES[j % len(DASHES)]}), row=i, col=1)
            fig.update_yaxes(title_text=title, row=i, col=1, **(yformat or {}).get(title, {}))
        fig.update_xaxes(title_text="step", row=len(panels), col=1)
        return _layout(fig, len(panels))

    def metrics(self, rows: list[dict]) -> Section:
        """Every number the job wrote that no other section plots: a row with a `step` against its step, one
        without (a `metric_definitions` row, scraped from a log line) against its time. One panel per name."""
        s = Section("metrics", "Every metric the job wrote")
        panels: dict[str, tuple[list, list]] = {}
        for row in rows:
            step = row.get("step")
            x = step if isinstance(step, (int, float)) else _utc(row["timestamp"]) if isinstance(
                row.get("timestamp"), (int, float)) else None
            for key, value in row.items():
                numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
                if x is None or key in ("step", "timestamp") or not numeric or (key in PLOTTED and step is not None):
                    continue
                xs, ys = panels.setdefault(f"{key} (by step)" if step is not None else key, ([], []))
                xs.append(x)
                ys.append(value)
        if not panels:
            s.note = ("the job has no metrics rows: metric_definitions scrape them from the log, and a script "
                      "appends rows to $SM_OUTPUT_DATA_DIR/metrics.jsonl")
            return s
        names = sorted(panels)[:MAX_PANELS]
        fig = self.make_subplots(rows=len(names), cols=1, vertical_spacing=min(0.08, 0.3 / len(names)),
                                 subplot_titles=names)
        for i, name in enumerate(names, 1):
            xs, ys = panels[name]
            fig.add_trace(self.go.Scatter(x=xs, y=ys, name=name, mode="lines+markers", marker={"size": 4},
                                          showlegend=False), row=i, col=1)
            fig.update_xaxes(title_text="step" if name.endswith("(by step)") else "time (UTC)", row=i, col=1)
        s.fig = _layout(fig, len(names))
        rest = sorted(panels)[MAX_PANELS:]
        s.note = " ".join(filter(None, [
            "Rows without a step (metric_definitions scraped from the log) by their log line's time." if any(
                not n.endswith("(by step)") for n in names) else "",
            f"Not drawn ({len(rest)} more): {', '.join(rest)}." if rest else ""]))
        return s

    def training(self) -> Section:
        s = Section("training", "Loss, learning rate, gradient norm")
        if not self.steps:
            s.note = NO_STEPS
            return s
        s.fig = self._stacked([("loss", [("loss", "loss")]), ("lr", [("lr", "learning rate")]),
                               ("grad norm", [("grad_norm", "gradient norm (before clipping)")])])
        s.note = _absent(_missing(["loss", "lr", "grad_norm"], self.steps), "the script did not write them")
        return s

    def throughput(self) -> Section:
        s = Section("throughput", "Throughput and MFU")
        if not self.steps:
            s.note = NO_STEPS
            return s
        keys = ["tokens_per_s", "mfu", "tflops_per_device"]
        s.fig = self._stacked([("tokens/s", [("tokens_per_s", "tokens/s")]), ("MFU (%)", [("mfu", "MFU (%)")]),
                               ("TFLOP/s per device", [("tflops_per_device", "TFLOP/s per device")])])
        s.note = _absent(_missing(keys, self.steps), "jobs of older Trainyard versions and scripts of your own "
                                                     "do not write them; MFU needs the model's FLOPs per token")
        if _mfu_measured(self.steps):
            s.note = " ".join(filter(None, [s.note, MEASURED_MFU]))
        return s

    def step_time(self) -> Section:
        s = Section("step-time", "Step time: compute and communication")
        keys = [("compute_s", "compute"), ("comm_intra_s", "communication intra-host"),
                ("comm_inter_s", "communication inter-host")]
        colours = {"compute_s": "#2ca02c", "comm_intra_s": _SIDE_COLOURS["intra"],
                   "comm_inter_s": _SIDE_COLOURS["inter"]}
        present = [(k, n) for k, n in keys if _series(self.steps, k)[0]]
        if not present:
            s.note = NO_STEPS if not self.steps else (
                "the rows have no compute_s / comm_intra_s / comm_inter_s: only the built-in trainer's communication "
                "meter splits a step's time")
            return s
        fig = self.go.Figure([self.go.Bar(x=_series(self.steps, k)[0], y=_series(self.steps, k)[1], name=n,
                                          marker_color=colours[k]) for k, n in present])
        fig.update_layout(barmode="stack", xaxis_title="step", yaxis_title="seconds", legend_traceorder="normal")
        s.fig = _layout(fig, 1)
        s.note = ("step_time_s = compute + the time the step waited in collectives (communication that overlapped "
                  "with compute counts as compute). " + _absent([k for k, _ in keys if k not in dict(present)], ""))
        return s

    def ranks(self, desc: dict) -> Section:
        """Every rank's compute per step (the rows' `rank_compute_s`, which the built-in trainer writes each time
        it compares the ranks), and the stragglers it named (describe()'s Warnings)."""
        s = Section("ranks", "Ranks: each rank's compute per step, and the stragglers named")
        per: dict[int, list[tuple[int, float]]] = {}
        for row in self.steps:
            for step, values in (row.get("rank_compute_s") or {}).items():
                for rank, v in enumerate(values):
                    per.setdefault(rank, []).append((int(step), v))
        named = [w for w in desc.get("Warnings") or () if w.startswith("straggler: ")]
        if not per:
            s.note = ("no row has rank_compute_s: the built-in trainer compares its ranks every "
                      "straggler_check_every steps (not with one rank, nor when it is 0)")
            return s
        fig = self.go.Figure([self.go.Scatter(x=[p[0] for p in sorted(pts)], y=[p[1] for p in sorted(pts)],
                                              name=f"rank {rank}", mode="lines") for rank, pts in sorted(per.items())])
        fig.update_layout(xaxis_title="step", yaxis_title="compute s (step less the communication waited for)")
        s.fig = _layout(fig, 1)
        s.note = ("; ".join(named) if named else "no straggler named") + (
            ". A rank is named when its compute is straggler_ratio x its peers' median or more over straggler_steps "
            "consecutive steps (the median of its ratios); the others then wait for it in communication.")
        return s

    def communication(self) -> Section:
        s = Section("communication", "Communication per mesh dimension, intra- and inter-host")
        by_dim = [r["comm_by_dim"] for r in self.steps if isinstance(r.get("comm_by_dim"), dict)]
        if not by_dim:
            s.note = NO_STEPS if not self.steps else (
                "the rows have no comm_by_dim: the built-in trainer's communication meter writes it (jobs of older "
                "Trainyard versions and scripts of your own do not)")
            return s
        dims = sorted({d for row in by_dim for d in row})
        fig = self.make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                                 subplot_titles=("bytes sent per step (rank 0, mean)",
                                                 "seconds waited per step (rank 0, mean)"))
        for i, (unit, suffix) in enumerate((("bytes", "B"), ("s", "s")), 1):
            for side in ("intra", "inter"):
                y = [statistics.fmean(float(row.get(d, {}).get(f"{side}_{unit}", 0) or 0) for row in by_dim)
                     for d in dims]
                fig.add_trace(self.go.Bar(x=dims, y=y, name=f"{side}-host", legendgroup=side,
                                          showlegend=i == 1, marker_color=_SIDE_COLOURS[side]), row=1, col=i)
            fig.update_yaxes(tickformat="~s", ticksuffix=suffix, row=1, col=i)
        fig.update_layout(barmode="group")
        fig.update_annotations(font_size=13)
        s.fig = _layout(fig, 1, height=PLOT_HEIGHT + 120)
        s.fig.update_layout(margin_t=80, legend_y=1.18)  # the legend above the subplots' titles
        s.note = f"Means over {len(by_dim)} step(s); a group whose ranks are all on one host counts as intra-host."
        return s

    def memory(self) -> Section:
        s = Section("memory", "Memory")
        if not self.steps:
            s.note = NO_STEPS
            return s
        keys = ["model_state_bytes", "param_bytes", "grad_bytes", "optim_bytes", "peak_memory_bytes",
                "cpu_rss_bytes"]
        fmt = {"tickformat": "~s", "ticksuffix": "B"}
        s.fig = self._stacked([("model state (rank 0)", [("model_state_bytes", "model state"),
                                                         ("param_bytes", "parameters"), ("grad_bytes", "gradients"),
                                                         ("optim_bytes", "optimizer states")]),
                               ("process (rank 0)", [("peak_memory_bytes", "peak device memory (CUDA)"),
                                                     ("cpu_rss_bytes", "peak CPU resident memory")])],
                              yformat={"model state (rank 0)": fmt, "process (rank 0)": fmt})
        s.note = _absent(_missing(keys, self.steps), "peak_memory_bytes is written on CUDA devices only; the "
                                                     "others by the built-in trainer")
        return s

    def checkpoints(self, saves: dict[int, dict]) -> Section:
        s = Section("checkpoints", "Checkpoints")
        x, blocked = _series(self.steps, "checkpoint_blocked_s")
        stalls = [(st, b) for st, b in zip(x, blocked) if b > 0]
        uploads = {st: v["upload_s"] for st, v in saves.items() if "upload_s" in v}
        if not stalls and not saves:
            s.note = ("no checkpoint was saved: no step held the loop (checkpoint_blocked_s) and the log has no "
                      "`checkpoint step N ...` line (a job saves with checkpoint_s3_uri and checkpoint_every)"
                      if x else "no checkpoint_blocked_s in the metrics and no `checkpoint step N ...` line in the log")
            return s
        steps = sorted({st for st, _ in stalls} | set(saves))
        held = dict(stalls)
        for st, v in saves.items():
            held.setdefault(st, v.get("staged_s", 0.0))
        fig = self.go.Figure([
            self.go.Bar(x=[str(st) for st in steps], y=[held.get(st, 0.0) for st in steps], name="loop held (staging)"),
            self.go.Bar(x=[str(st) for st in steps], y=[uploads.get(st, 0.0) for st in steps],
                        name="upload in the background")])
        fig.update_layout(barmode="group", xaxis_title="checkpoint step", xaxis_type="category",
                          yaxis_title="seconds")
        s.fig = _layout(fig, 1)
        s.note = ("Loop held: checkpoint_blocked_s of the step's row (else the staging time the log names). "
                  "Upload: from the `staged` log line to the last `saved to` line of the step" +
                  ("" if uploads else "; the log has no `saved to` line after a `staged` one") + ".")
        return s

    def timeline(self, desc: dict) -> Section:
        s = Section("timeline", "Startup timeline per host")
        lanes = _lanes(desc)
        if not lanes:
            s.note = ("describe() has neither SecondaryStatusTransitions nor HostPhases with start times: "
                      "the job has not started, or was run by a Trainyard version that did not record them")
            return s
        t0 = min(start for _, _, start, _, _ in lanes)
        span = max(end for _, _, _, end, _ in lanes) - t0 or 1.0
        order = list(dict.fromkeys(lane for lane, *_ in lanes))
        # startup ends when every host saw its first step (else when the job's status became Training); when it
        # is under STARTUP_ZOOM of the span, a second panel shows it at a scale where its phases can be told apart
        first = [end - t0 for _, name, _, end, _ in lanes if name == FIRST_STEP]
        ready = max(first) if first else min((start - t0 for _, name, start, _, _ in lanes if name == "Training"),
                                             default=None)
        zoom = ready if ready and ready < STARTUP_ZOOM * span else None
        panels = [("whole job", span)] + ([("startup: until training ran", zoom)] if zoom else [])
        fig = self.make_subplots(rows=len(panels), cols=1, vertical_spacing=0.25 if zoom else 0.1,
                                 subplot_titles=[t for t, _ in panels] if zoom else None)
        colours: dict[str, str] = {}
        for row, (_, width_of) in enumerate(panels, 1):
            for lane, name, start, end, msg in lanes:
                first = name not in colours
                colours.setdefault(name, _COLOURS[len(colours) % len(_COLOURS)])
                fig.add_trace(self.go.Bar(
                    y=[lane], x=[max(end - start, width_of * 0.004)],  # an instant (a terminal status) stays visible
                    base=[start - t0], orientation="h", name=name, legendgroup=name, showlegend=first,
                    marker_color=colours[name], hoverinfo="text",
                    hovertext=[f"{lane} {name}: {start - t0:.1f} s to {end - t0:.1f} s{' - ' + msg if msg else ''}"]),
                    row=row, col=1)
            fig.update_yaxes(categoryorder="array", categoryarray=order[::-1], row=row, col=1)
            fig.update_xaxes(range=[0, width_of * 1.05], row=row, col=1)
        fig.update_xaxes(title_text=f"seconds since {local_time(_utc(t0))} (local time)", row=len(panels), col=1)
        fig.update_layout(barmode="overlay")
        fig.update_annotations(font_size=13)
        s.fig = _layout(fig, 1, height=len(panels) * max(150, 40 + 40 * len(order)) + 120)
        s.fig.update_layout(margin_t=70, legend_y=1.1 if zoom else 1.04)
        s.note = ("`job`: the job's status transitions (describe()'s SecondaryStatusTransitions); one lane per host: "
                  "its phases (HostPhases)" + ("" if desc.get("HostPhases") else
                                               "; describe() has no HostPhases, so no lane per host is drawn") + ".")
        return s


_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf"]
_SIDE_COLOURS = {"intra": "#1f77b4", "inter": "#d62728"}


def _layout(fig, rows: int, height: int | None = None):
    fig.update_layout(template="plotly_white", height=height or 80 + PLOT_HEIGHT * rows,
                      margin={"l": 70, "r": 50, "t": 40, "b": 50}, modebar_orientation="v",  # clear of the legend
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0})
    return fig


def _absent(keys: list[str], why: str) -> str:
    if not keys:
        return ""
    return f"Not in the metrics: {', '.join(keys)}" + (f" ({why})." if why else ".")


def _epoch(v) -> float | None:
    """Epoch seconds of a datetime, an ISO string or a number; None for anything else."""
    if isinstance(v, datetime):
        return (v if v.tzinfo else v.replace(tzinfo=timezone.utc)).timestamp()
    if isinstance(v, str):
        try:
            return _epoch(datetime.fromisoformat(v.replace("Z", "+00:00")))
        except ValueError:
            return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)


def _lanes(desc: dict) -> list[tuple[str, str, float, float, str]]:
    """(lane, phase, start, end, message) bars: the job's status transitions, then each host's phases. An
    open end is the next start in its lane, else the job's end (or last change, or the start itself)."""
    job_end = next((t for k in ("TrainingEndTime", "LastModifiedTime") if (t := _epoch(desc.get(k))) is not None), None)
    groups = [("job", [(t.get("Status", "?"), t.get("StartTime"), t.get("EndTime"), t.get("StatusMessage", ""))
                       for t in desc.get("SecondaryStatusTransitions") or []])]
    for host, phases in sorted((desc.get("HostPhases") or {}).items()):
        groups.append((host, [(p.get("Phase", "?"), p.get("StartTime"), p.get("EndTime"),
                              p.get("StatusMessage") or p.get("Message", ""))
                              for p in phases or []]))
    out = []
    for lane, items in groups:
        items = [(n, _epoch(a), _epoch(b), m) for n, a, b, m in items]
        items = [i for i in items if i[1] is not None]
        for i, (name, start, end, msg) in enumerate(items):
            if end is None:
                end = items[i + 1][1] if i + 1 < len(items) else (job_end if job_end and job_end >= start else start)
            out.append((lane, str(name), start, max(end, start), str(msg or "")))
    return out


def _checkpoint_log(job) -> dict[int, dict]:
    """{step: {"staged_s", "upload_s"}} from the trainer's lines `checkpoint step N: staged in X s, ...` and
    `checkpoint step N saved to URI` (every rank may print the latter; the last one is when all were done)."""
    log_text = getattr(job, "log_text", None)
    if log_text is None:
        return {}
    out: dict[int, dict] = {}
    staged_at: dict[int, float] = {}
    for line in log_text().splitlines():
        t, text = parse(line)
        if (m := _STAGED.search(text)) and int(m.group(1)) not in staged_at:
            step = int(m.group(1))
            out.setdefault(step, {})["staged_s"] = float(m.group(2))
            if t is not None:
                staged_at[step] = t
        elif m := _SAVED.search(text):
            step = int(m.group(1))
            entry = out.setdefault(step, {})
            if t is not None and step in staged_at:
                entry["upload_s"] = max(entry.get("upload_s", 0.0), t - staged_at[step])
    return out


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)
    return "none" if v is None else str(v)


def _health(desc: dict) -> Section:
    s = Section("health", "Health check: each host before the first step")
    check = desc.get("HealthCheck")
    if not isinstance(check, dict):
        s.note = "the job ran no pre-flight health check (Estimator(health_check=True) asks for one)"
        return s
    rows = []
    for host, h in sorted(check.get("Hosts", {}).items()):
        ratio = f" ({h['ratio']:.2f}x its peers)" if isinstance(h.get("ratio"), (int, float)) else ""
        links = ", ".join(f"{what} {h[key]:.3g} GB/s" for key, what in (("intra_gbps", "intra-host"),
                                                                         ("inter_gbps", "inter-host"))
                          if isinstance(h.get(key), (int, float)))
        rows.append((host, f"compute {h['compute_tflops']:.3g} TFLOP/s{ratio}" + (f"; all-reduce {links}" if links
                                                                                  else "")))
    s.table = rows
    unjudged = check.get("UnjudgedHosts") or []
    s.note = check.get("Reason") or ("no host far below its peers" if not unjudged else
                                     f"{', '.join(unjudged)}: no other host and no figure expected of the instance "
                                     "type to compare its compute with: not judged")
    return s


def _fingerprint(rows: list[dict]) -> Section:
    s = Section("fingerprint", "Fingerprint: what the figures were measured on")
    fp = next((r["fingerprint"] for r in rows if isinstance(r.get("fingerprint"), dict)), None)
    if fp is None:
        s.note = ("no metrics row has a fingerprint: the built-in trainer writes it in the first row of a run "
                  "(jobs of older Trainyard versions and scripts of your own do not)")
    else:
        s.table = [(k, _cell(v)) for k, v in fp.items()]
    return s


def _cost(desc: dict) -> Section:
    s = Section("cost", "Cost")
    cost = desc.get("EstimatedCost")
    if not isinstance(cost, dict) or not cost:
        s.note = "describe() has no EstimatedCost: the job ran before costs were estimated, or has no price to go by"
        return s
    order = ["Amount", "Currency", "InstanceHours", "PricePerHour", "Market", "Source"]
    s.table = [(k, _cell(cost[k])) for k in order if k in cost] + \
              [(k, _cell(v)) for k, v in cost.items() if k not in order]
    return s


def _profiler_traces(job) -> Section | None:
    """The job's profiler traces, listed from `<s3_output_path or output_path>/<job>/profiler-output/`; None when
    the job asked for no profiler."""
    spec = getattr(job, "spec", None)
    prof = getattr(spec, "profiler", None)
    if prof is None:
        return None
    s = Section("profiler", "Profiler traces")
    name = getattr(spec, "job_name", None) or job.name
    prefix = prof.uri(spec.output_path, name)
    try:
        files = storage.list_files(prefix, s3=_store_client(spec) if prefix.startswith("s3://") else None)
    except Exception as e:  # noqa: BLE001 - no credentials, no network, no bucket: said, the rest is drawn
        s.note = f"could not list {prefix}: {type(e).__name__}: {e}"
        return s
    steps = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in prof.runs())
    ranks = ", ".join(str(r) for r in prof.ranks)
    if not files:
        s.note = (f"nothing under {prefix}: the job did not reach step(s) {steps}, or has not uploaded the traces "
                  "yet (each host syncs them while it runs and when it ends)")
        return s
    s.table = [(rel, f"{human_size(size)}, {uri}") for uri, rel, size in files]
    s.note = (f"Steps {steps} of rank(s) {ranks}. Open a .pt.trace.json in Perfetto (ui.perfetto.dev) or "
              "chrome://tracing, a .memory.pickle (CUDA) at pytorch.org/memory_viz.")
    return s


def _store_client(spec):
    """The S3 client that reaches a job's objects: the embedded store's for a local job when no endpoint is
    configured (as the job had), else boto3's default (AWS_ENDPOINT_URL or real S3)."""
    if not catalog.lookup(spec.instance_type).is_local or os.environ.get("AWS_ENDPOINT_URL"):
        return None
    endpoint = ensure_store()
    if not endpoint.embedded:
        return None
    return endpoint.client()


MEASURED_MFU = ("MFU here is against a peak the engine measured at start-up on this machine (a CPU, or a GPU "
                "not in its datasheet table), while every rank computed: it moves with the machine's load, so "
                "compare runs by tokens/s.")


def _mfu_measured(steps: list[dict]) -> bool:
    """What the first row that says (the engine's first row of each run, its fingerprint) says."""
    return next((m for r in steps if (m := measured_peak(r)) is not None), False)


def _summary(steps: list[dict]) -> str:
    parts = []
    loss = _series(steps, "loss")[1]
    if loss:
        parts.append(f"final loss {loss[-1]:.4g}")
    tps = _series(steps, "tokens_per_s")[1]
    if tps:
        parts.append(f"median {statistics.median(tps):,.0f} tokens/s")
    mfu = _series(steps, "mfu")[1]
    if mfu:
        parts.append(f"median MFU {statistics.median(mfu):.2%}" + (" of a measured peak" if _mfu_measured(steps) else ""))
    if steps:
        parts.append(f"{len(steps)} step rows (steps {steps[0]['step']}..{steps[-1]['step']})")
    return ", ".join(parts) or "no step metrics"


def _header(job, desc: dict) -> list[tuple[str, str]]:
    spec = getattr(job, "spec", None)
    res = desc.get("ResourceConfig") or {}
    status, secondary = desc.get("TrainingJobStatus", "?"), desc.get("SecondaryStatus", "?")
    rows = [("status", status if secondary == status else f"{status} ({secondary})")]
    if desc.get("FailureReason"):
        rows.append(("failure", desc["FailureReason"]))
    for label, key in (("created", "CreationTime"), ("training started", "TrainingStartTime"),
                       ("ended", "TrainingEndTime")):
        if isinstance(desc.get(key), datetime):
            rows.append((label, local_time(desc[key])))
    start, end = _epoch(desc.get("CreationTime")), _epoch(desc.get("TrainingEndTime"))
    if start is not None and end is not None:
        rows.append(("duration", human_duration(end - start)))
    hosts = f"{res.get('InstanceCount', '?')} x {res.get('InstanceType', '?')}"
    if spec is not None:
        hosts += f", {spec.processes_per_host} process(es) per host"
    rows.append(("instances", hosts))
    if spec is not None:
        rows.append(("distribution", json.dumps(spec.distribution) if spec.distribution else "{} (defaults)"))
        rows.append(("entry point", spec.entry_point))
    if desc.get("HyperParameters"):
        rows.append(("hyperparameters", ", ".join(f"{k}={v}" for k, v in desc["HyperParameters"].items())))
    return rows


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _section_html(s: Section) -> str:
    parts = [f'<section id="{s.key}"><h2>{html.escape(s.title)}</h2>']
    if s.fig is not None:
        div = s.fig.to_html(full_html=False, include_plotlyjs=False, config=PLOT_CONFIG, div_id=f"plot-{s.key}",
                            default_height=f"{s.fig.layout.height}px")
        parts.append(f'<div class="plot" data-plot="{s.key}">{div}</div>')
    if s.table is not None:
        parts.append(_table(s.table))
    if s.note:
        kind = "missing" if s.fig is None and s.table is None else "note"
        parts.append(f'<p class="{kind}">{html.escape(s.note)}</p>')
    return "".join(parts) + "</section>"


_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; margin: 0;
       background: #fafafa; }
main { max-width: 1100px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 1.5em; margin: 8px 0 4px; word-break: break-all; }
h2 { font-size: 1.15em; margin: 0 0 8px; }
.summary { font-size: 1.05em; margin: 4px 0 12px; }
section { background: #fff; border: 1px solid #e3e3e3; border-radius: 6px; padding: 12px 16px; margin: 14px 0; }
table { border-collapse: collapse; width: 100%; table-layout: fixed; font-size: 0.92em; }
th, td { text-align: left; vertical-align: top; padding: 3px 8px; border-bottom: 1px solid #eee;
         overflow-wrap: anywhere; }
th { width: 13em; color: #555; font-weight: 600; }
p.missing { color: #8a5a00; background: #fff8e6; border-left: 3px solid #e0a800; padding: 8px 10px; margin: 0; }
p.note { color: #555; font-size: 0.9em; margin: 6px 0 0; }
"""


def _page(job, desc: dict, steps: list[dict], sections: list[Section], plotly_js: str) -> str:
    name = html.escape(str(desc.get("TrainingJobName", getattr(job, "name", "job"))))
    nav = " | ".join(f'<a href="#{s.key}">{html.escape(s.title.split(":")[0])}</a>' for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>Trainyard report: {name}</title><style>{_STYLE}</style>"
            f'<script type="text/javascript">{plotly_js}</script></head>\n'
            f'<body><main><h1>Trainyard job {name}</h1><p class="summary">{html.escape(_summary(steps))}</p>'
            f'<section id="job"><h2>Job</h2>{_table(_header(job, desc))}</section>'
            f'<p class="note">{nav}</p>\n' + "\n".join(_section_html(s) for s in sections) +
            f'<p class="note">Written by Trainyard at {local_time(datetime.now(timezone.utc))} (local time); '
            f"self-contained: it needs no network.</p></main></body></html>\n")
