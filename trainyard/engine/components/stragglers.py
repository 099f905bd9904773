"""Stragglers: the rank whose steps are slower than its peers', named with its host.

A slow GPU, a throttled host or a noisy neighbour slows one rank; every other rank then waits for it in the step's
collectives, so their wall time grows with it and wall time cannot tell them apart. A rank's compute can: the step's
wall time minus the communication it waited for (the comm meter's time inside collectives). The slow rank's compute
grows; its peers' stays, and their waiting grows instead.

`StragglerWatch.record(step, compute_s)` keeps this rank's compute per step. Every `every` steps the ranks
all-gather their last `every` figures (one small collective, the same steps on every rank), and `Detector` compares
each rank's compute, step by step, with the median of the other ranks of its pipeline stage (stages do different
work): a rank whose ratio to that median is `ratio` or more over `steps` consecutive steps (the median of its
ratios over them: a persistent slowdown, not a few unlucky steps) is a straggler, named once per such stretch as

    rank 5 (algo-2) 1.42x the median step for 20 steps

It is named again only after a whole window back among its peers. The first `warmup` steps of a run (compilation, first
allocations) are left out. The built-in trainer logs it as a WARNING line, writes it into the step's metrics row (`warnings`, which
`describe()["Warnings"]` lists) with every rank's compute of the gathered steps (`rank_compute_s`, which the
report plots), and names the flagged ranks in its progress line while they stay slow.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist


# a rank must be at least this much slower than its peers' median in a step for the step to count as slow:
# shorter differences are a host's scheduling (the rank that prints, a shared core), not a slow device
MIN_EXCESS_S = 0.02


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    ratio: float
    """The median over the slow steps of its compute over the median of its peers'."""
    steps: int

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.host}) {self.ratio:.2f}x the median step for {self.steps} steps"


class StragglerRemoval(RuntimeError):
    """straggler_remove: ranks still slow at a committed checkpoint end the attempt, on every rank, so that an elastic
    job goes on from that checkpoint without their hosts (container/attempts.py reads the hosts from the message)."""


def removal(detector: "Detector", step: int) -> StragglerRemoval | None:
    """The end of the attempt at `step`'s committed checkpoint when ranks are named and still slow, else None: the
    same on every rank (every rank runs the detector on the same gathered figures)."""
    slow = detector.slow()
    if not slow:
        return None
    hosts = sorted({detector.hosts[r] for r in slow})
    ranks = ", ".join(f"rank {r} ({detector.hosts[r]})" for r in slow)
    return StragglerRemoval(f"straggler: {ranks} still slow at step {step}'s committed checkpoint: the job goes on "
                            f"without {', '.join(hosts)} (straggler_remove)")


class Detector:
    """The comparison, without collectives: `observe(times)` with every rank's compute of one step (index: rank)
    returns the ranks named at this step.

    Each step gives each rank a ratio: its compute over the median of its stage's other ranks'. A rank is slow
    when the median of its ratios over the last `steps` steps is at least `ratio`: a persistent slowdown, not a
    few unlucky steps (a host whose cores are shared sees a rank descheduled now and then, on a different rank
    each time). A step counts as slow only if the rank is also `min_excess_s` (20 ms) slower than that median:
    with steps of a few tens of ms, the rank that prints the progress, or shares a core with the job's supervisor,
    is that much slower without being a straggler. A rank is named once, when its slowness starts, and again only
    after a whole window back within half the margin (below 1.15x for a ratio of 1.3): a throttled rank's steps
    swing, and the median with them."""

    def __init__(self, *, stages: list[int], hosts: list[str], ratio: float = 1.3, steps: int = 20,
                 min_excess_s: float = MIN_EXCESS_S) -> None:
        if not ratio > 1:
            raise ValueError(f"straggler_ratio must be > 1, got {ratio}")
        if steps < 1:
            raise ValueError(f"straggler_steps must be >= 1, got {steps}")
        self.stages, self.hosts, self.ratio, self.steps, self.min_excess_s = stages, hosts, ratio, steps, min_excess_s
        self.window: list[deque] = [deque(maxlen=steps) for _ in stages]  # each rank's last ratios
        self.named = [False] * len(stages)  # named, and slow since
        self.back = [0] * len(stages)  # a named rank's steps in a row back among its peers

    def observe(self, times: list[float]) -> list[Straggler]:
        found = []
        for rank, t in enumerate(times):
            peers = [times[r] for r, s in enumerate(self.stages) if s == self.stages[rank] and r != rank]
            median = statistics.median(peers) if peers else 0.0
            ratio = t / median if median > 0 else 0.0
            if t - median < self.min_excess_s:  # a few ms more than its peers: scheduling, not a straggler
                ratio = min(ratio, 1.0)
            self.window[rank].append(ratio)
            if len(self.window[rank]) < self.steps:
                continue
            typical = statistics.median(self.window[rank])
            # back among its peers (well under the ratio, for a whole window: a throttled rank's steps swing, and
            # the median of 20 with them) before it can be named again
            self.back[rank] = self.back[rank] + 1 if typical < 1 + (self.ratio - 1) / 2 else 0
            if self.back[rank] >= self.steps:
                self.named[rank] = False
            if typical >= self.ratio and not self.named[rank]:
                self.named[rank] = True
                found.append(Straggler(rank, self.hosts[rank], typical, self.steps))
        return found

    def slow(self) -> list[int]:
        """The ranks named and still slow."""
        return [r for r, named in enumerate(self.named) if named]


class StragglerWatch:
    """This rank's side: record each step's compute; every `every` steps, gather everyone's and detect (rank 0's
    verdict is everyone's: all ranks run the same detector on the same figures)."""

    def __init__(self, detector: Detector, *, every: int = 10, warmup: int = 2, device: torch.device | None = None,
                 group=None) -> None:
        if every < 1:
            raise ValueError(f"straggler_check_every must be >= 1, got {every}")
        self.detector, self.every, self.warmup = detector, every, warmup
        self.device, self.group = device or torch.device("cpu"), group
        self._steps: list[int] = []
        self._times: list[float] = []
        self._seen = 0

    def record(self, step: int, compute_s: float) -> tuple[dict[int, list[float]], list[Straggler]]:
        """This rank's compute of `step` (a collective every `every` steps). Returns every rank's compute of the
        steps gathered now ({} between gathers) and the stragglers named in them."""
        self._seen += 1
        if self._seen <= self.warmup:
            return {}, []
        self._steps.append(step)
        self._times.append(float(compute_s))
        if len(self._times) < self.every:
            return {}, []
        mine = torch.tensor(self._times, dtype=torch.float64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        table = torch.stack(everyone).cpu()  # (rank, step)
        gathered, found = {}, []
        for i, s in enumerate(self._steps):
            column = table[:, i].tolist()
            gathered[s] = [round(v, 6) for v in column]
            found += self.detector.observe(column)
        self._steps, self._times = [], []
        return gathered, found
