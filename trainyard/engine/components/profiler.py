"""torch.profiler over the steps a job names, on the ranks it names (the Estimator's `profiler`, or SageMaker's
`profiler_config`; the contract's `profilerconfig.json`).

Each run of consecutive profiled steps is one recording on each profiled rank: CPU activities and, on CUDA, CUDA
activities, with input shapes and memory (`record_shapes`, `profile_memory`). It starts when the step loop says its
first step begins (`te.mark_step(first)`) and stops when the last one is done (`te.log_metrics(last, ...)`, or the
next `mark_step` of a step outside the run, or the end of the job). Then it writes, into the contract's folder
(default /opt/ml/output/profiler, synced to `<s3_output_path or output_path>/<job>/profiler-output/`):

- `rank<R>-steps<a>-<b>.pt.trace.json`: the Chrome trace (`export_chrome_trace`), for chrome://tracing, Perfetto
  or TensorBoard's profiler plugin;
- on CUDA, `rank<R>-steps<a>-<b>.memory.pickle`: the allocator's history over the run
  (`torch.cuda.memory._record_memory_history` / `_dump_snapshot`), for https://pytorch.org/memory_viz.

Files appear whole: each is written beside its name and renamed, so the folder's sync never uploads half a trace.
"""
from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile

# CUDA allocator events kept for the memory snapshot: the last this many allocations and frees (torch's own
# example value; about 100 MB of host memory at most), plenty for a few steps
MEMORY_HISTORY_ENTRIES = 100_000


def runs(steps: list[int]) -> list[tuple[int, int]]:
    """(first, last) of each run of consecutive steps."""
    out: list[tuple[int, int]] = []
    for s in sorted(set(steps)):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


class StepProfiler:
    """The profiled runs of steps of one rank. `at_step(step)` at the top of every step, `after_step(step)` when it
    is done, `close()` at the end of the job."""

    def __init__(self, *, steps: list[int], rank: int, out_dir: str, device: torch.device,
                 say=lambda m: print(m, flush=True)) -> None:
        if not out_dir:
            raise ValueError("the profiler has no folder to write to (profilerconfig.json has no LocalPath)")
        self.runs, self.rank, self.out_dir, self.device, self.say = runs(steps), rank, out_dir, device, say
        self.cuda = device.type == "cuda"
        self.written: list[str] = []
        self._active: tuple[int, int] | None = None
        self._done: set[tuple[int, int]] = set()
        self._prof: profile | None = None

    @classmethod
    def from_contract(cls, config: dict | None, rank: int, device: torch.device) -> "StepProfiler | None":
        """This rank's profiler from the contract's `{"steps", "ranks", "dir"}`, or None when it profiles nothing."""
        if config is None or rank not in config["ranks"] or not config["steps"]:
            return None
        return cls(steps=config["steps"], rank=rank, out_dir=config["dir"], device=device)

    def at_step(self, step: int) -> None:
        """Step `step` begins: end a run it is not part of, begin the run it is in (from this step on: a job resumed
        in the middle of a run records the rest of it), once per run."""
        if self._active is not None and not self._active[0] <= step <= self._active[1]:
            self._stop()
        if self._active is None:
            run = next((r for r in self.runs if r[0] <= step <= r[1] and r not in self._done), None)
            if run is not None:
                self._done.add(run)
                self._start((step, run[1]))

    def after_step(self, step: int) -> None:
        """Step `step` is done: end the run whose last step it is."""
        if self._active is not None and step >= self._active[1]:
            self._stop()

    def close(self) -> None:
        """The job ends: write what a run still open recorded."""
        if self._active is not None:
            self._stop()

    def _start(self, run: tuple[int, int]) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._prof.start()
        self._active = run

    def _stop(self) -> None:
        (first, last), prof = self._active, self._prof
        self._active, self._prof = None, None
        if self.cuda:
            torch.cuda.synchronize(self.device)
        prof.stop()
        os.makedirs(self.out_dir, exist_ok=True)
        name = f"rank{self.rank}-steps{first}-{last}"
        trace = os.path.join(self.out_dir, f"{name}.pt.trace.json")
        _whole(trace, prof.export_chrome_trace)
        written = [trace]
        if self.cuda:
            snapshot = os.path.join(self.out_dir, f"{name}.memory.pickle")
            _whole(snapshot, torch.cuda.memory._dump_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot)
        self.written += written
        what = f"step {first}" if first == last else f"steps {first}-{last}"
        self.say(f"profiler: {what} of rank {self.rank} written to "
                 + ", ".join(f"{os.path.basename(p)} ({os.path.getsize(p) / 1e6:.1f} MB)" for p in written))


def _whole(path: str, write) -> None:
    """`write(tmp)` then rename to `path`: the file appears whole."""
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.partial"
    write(tmp)
    os.replace(tmp, path)
