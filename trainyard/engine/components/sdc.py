"""Silent data corruption, caught from the replicas of the model's shards.

A bit flipped in a GPU's memory or arithmetic does not crash anything: training goes on, and every later step
builds on the damaged weights. MiCS keeps R replicas of every shard (the partition groups, `dp_replicate`), and
after each step's exact synchronisation they hold bit-identical parameters: the same shard, the same reduced
gradient, the same optimizer step. So a copy that differs from the others is damaged.

`SdcCheck.check(model, step)`: each rank reduces every parameter shard it holds to one integer (the sum of its
32-bit words, or of its bytes, as int64: any single flipped bit changes it), the ranks that hold the same shard
all-gather those (one small collective in each replica group), and every rank learns the verdicts of all groups
(one more). A copy that differs from its group's majority is damaged; with 2 replicas there is no majority, and
both ranks are named. A mismatch raises `DataCorruption` on every rank, naming the rank, its host, the step and the
first parameter that differs; the attempt ends with its own retry class (`data corruption`, container/failure.py),
and a retry resumes from the last checkpoint, which was checked before it was saved.

The built-in trainer checks every `sdc_check_every` steps and before every checkpoint save (so no damaged state is
ever committed). A layout with one replica of each shard (MiCS over every data-parallel rank: ZeRO-3) has nothing
to compare with, and the trainer says so once instead. The cost is one read of the rank's parameter shards
(bench/health.py measures it against the step).

`TRAINYARD_SDC_INJECT=RANK:STEP:MARKER` (a test hook) flips one bit of rank RANK's first parameter shard after step
STEP, once: only while the file MARKER does not exist, which it then creates (a retry does not flip again).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from trainyard.engine.distributed.experts import expert_params

INJECT_ENV = "TRAINYARD_SDC_INJECT"


class DataCorruption(RuntimeError):
    """A rank's copy of a shard differs from its replicas'."""


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def replicated(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters MiCS replicates, by name: not the experts that expert parallelism places (their copies follow
    the expert layout, not the partition groups)."""
    placed = {id(p) for p in expert_params(model)}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in placed]


def digests(params: list[torch.Tensor]) -> torch.Tensor:
    """One int64 per parameter: the sum of the 32-bit words of this rank's shard (of its bytes when its size is not
    a multiple of 4); flipping any one bit changes it."""
    out = []
    for p in params:
        raw = _local(p).detach().contiguous().reshape(-1).view(torch.uint8)
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
        out.append(words.sum(dtype=torch.int64) if raw.numel() else torch.zeros((), dtype=torch.int64,
                                                                                  device=raw.device))
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


def odd_ones(values: list[list[int]]) -> list[int]:
    """The indices of the copies that differ from the majority of `values` (each copy's digests); with no majority
    (2 copies, or no value held by more than half), every copy that differs from any other."""
    counts: dict[tuple, int] = {}
    for v in values:
        counts[tuple(v)] = counts.get(tuple(v), 0) + 1
    if len(counts) == 1:
        return []
    common, n = max(counts.items(), key=lambda kv: kv[1])
    if n * 2 > len(values):
        return [i for i, v in enumerate(values) if tuple(v) != common]
    return list(range(len(values)))


class SdcCheck:
    """This rank's part (built by every rank alike: it creates the replica groups, a collective)."""

    def __init__(self, groups: list[list[int]], hosts: list[str], device: torch.device) -> None:
        self.hosts, self.device = hosts, device
        self.replicas = len(groups[0])
        self.members: list[int] = []
        self.group = None
        if self.replicas > 1:
            self.group, _ = dist.new_subgroups_by_enumeration(groups)
            self.members = next(g for g in groups if dist.get_rank() in g)

    @property
    def can_check(self) -> bool:
        return self.replicas > 1

    def check(self, model: nn.Module, step: int) -> None:
        """Compare this rank's shards with their replicas; DataCorruption on every rank when a copy differs."""
        if not self.can_check:
            return
        named = replicated(model)
        mine = digests([p for _, p in named]).to(self.device)
        copies = [torch.empty_like(mine) for _ in self.members]
        dist.all_gather(copies, mine, group=self.group)
        values = [c.cpu().tolist() for c in copies]
        bad = [(self.members[i], next(k for k, (a, b) in enumerate(zip(values[i], _reference(values, i)))
                                       if a != b)) for i in odd_ones(values)]
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, bad if dist.get_rank() == self.members[0] else [])
        damaged = sorted({pair for ranks in found for pair in ranks or ()})
        if damaged:
            raise DataCorruption(self.message(damaged, step, [n for n, _ in named]))

    def message(self, damaged: list[tuple[int, int]], step: int, names: list[str]) -> str:
        who = ", ".join(f"rank {r} ({self.hosts[r]})" for r, _ in damaged)
        first = names[damaged[0][1]]
        if self.replicas == 2:
            return (f"data corruption: at step {step} the 2 replicas of a shard differ ({who}; {first} first): with 2 "
                    "replicas no majority says which copy is damaged; a GPU or host memory of one of them may be "
                    "faulty")
        return (f"data corruption: at step {step} the parameters of {who} differ from the other replicas of their "
                f"shard ({self.replicas} copies; {first} first); its GPU or host memory may be faulty")


def _reference(values: list[list[int]], i: int) -> list[int]:
    """A copy other than `i` to say which parameter of copy `i` differs (the majority's, where there is one)."""
    others = [v for j, v in enumerate(values) if j != i]
    return max(others, key=others.count)


def inject_from_env(model: nn.Module, rank: int, step: int, env=None) -> bool:
    """The test hook (module docstring): flip bit 20 of the first element of this rank's first non-empty parameter
    shard when `TRAINYARD_SDC_INJECT` names this rank and step and its marker file is absent. True if it flipped."""
    spec = (env if env is not None else os.environ).get(INJECT_ENV, "")
    if not spec:
        return False
    target, at, marker = spec.split(":", 2)
    if int(target) != rank or int(at) != step or os.path.exists(marker):
        return False
    with open(marker, "w") as fh:
        fh.write(f"flipped on rank {rank} after step {step}\n")
    for _, p in replicated(model):
        local = _local(p).detach()
        if local.numel():
            with torch.no_grad():
                word = local.reshape(-1)[:1].view(torch.int32) if local.element_size() == 4 else \
                    local.reshape(-1)[:1].view(torch.int16)
                word ^= 1 << (20 if local.element_size() == 4 else 10)
            return True
    return False
