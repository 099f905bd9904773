"""`plan()`: every layout the engine accepts for a model on a cluster, with its memory, step time, tokens/s, MFU,
cost, and time and cost to train a number of tokens; best first.

Enumerated: tensor-parallel degrees dividing the GPUs of a host, context-parallel degrees with cp x tp dividing
them, pipeline degrees dividing the layers and the world (each schedule: GPipe, 1F1B, interleaved 1F1B with 2
virtual stages), every MiCS partition size dividing the data-parallel degree, for a mixture of experts every
expert-parallel degree dividing both the data-parallel degree and the experts, every micro-batch size dividing
the per-rank batch, and the three activation checkpointing modes, each with and without CPU offload
(`mics.cpu_offload`; GPU instances only). Each is checked by the SDK's own checks (`job.distribution.typed`,
`check_tp`, `check_cp`, `check_cp_pp`, `check_experts`, `check_pipeline`), so the planner never proposes a layout `Estimator`
refuses. A layout fits when its GPU memory is under the usable part of the GPU's and, offloaded, its host memory
under its share of the host's. Ranking: layouts that fit, fastest first (speeds within 1% count as equal and the
one without context parallelism, then the one needing less memory, wins); then those that do not, least over
first.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainyard.parallel.layout import check_cp, check_cp_pp, check_experts, check_pipeline
from trainyard.job.distribution import typed
from trainyard.job.catalog import LOCAL
from trainyard.errors import ConfigError
from trainyard.job.plan import memory as memory_model
from trainyard.job.plan import steptime
from trainyard.job.plan.hardware import Hardware, hardware
from trainyard.job.plan.layout import Layout
from trainyard.parallel.shapes import ModelShape, resolve_model

AC_MODES = ("none", "selective", "full")
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1))


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedLayout:
    layout: Layout
    instance_count: int
    memory: memory_model.Memory
    time: steptime.StepTime
    fits: bool
    over_bytes: int
    """How far the memory is above the usable GPU memory (0 when it fits)."""
    host_over_bytes: int
    """How far the offloaded states are above the rank's share of host memory (0 when they fit)."""
    tokens_per_s_per_gpu: float
    mfu: float
    usd_per_million_tokens: float | None
    hours_to_train: float | None
    usd_to_train: float | None

    def to_dict(self) -> dict:
        return {"fits": self.fits, "mfu": self.mfu, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "memory_per_gpu_bytes": self.memory.total, "instance_count": self.instance_count,
                **self.layout.to_dict(),
                "memory_bytes": self.memory.to_dict(), "over_bytes": self.over_bytes,
                "host_memory_per_gpu_bytes": self.memory.host, "host_over_bytes": self.host_over_bytes,
                "step_time_s": self.time.step_s, "compute_s": self.time.compute_s, "bubble_s": self.time.bubble_s,
                "exposed_comm_s": self.time.exposed_comm_s, "offload_s": self.time.offload_s,
                "overhead_s": self.time.overhead_s,
                "comm_intra_bytes": self.time.comm_intra_bytes,
                "comm_inter_bytes": self.time.comm_inter_bytes,
                "usd_per_million_tokens": self.usd_per_million_tokens, "hours_to_train": self.hours_to_train,
                "usd_to_train": self.usd_to_train, "distribution": self.layout.distribution()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    model: ModelShape
    hardware: Hardware
    """The instance type's facts (for the last of `instance_counts`; only the count differs between them)."""
    instance_counts: tuple[int, ...]
    seq_len: int
    global_batch_size: int
    layouts: list[PlannedLayout]
    compiled: bool = False
    """Planned for blocks under torch.compile (the built-in trainer's `compile`)."""

    @property
    def best(self) -> PlannedLayout | None:
        """The best layout that fits, or None."""
        return next((p for p in self.layouts if p.fits), None)

    def to_dict(self) -> dict:
        return {"layouts": [p.to_dict() for p in self.layouts]}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid(shape: ModelShape, layout: Layout, seq_len: int, world: int, gpus_per_host: int) -> bool:
    """The SDK's checks (those Estimator and the engine run) accept the layout."""
    try:
        typed(layout.distribution(), world_size=world, processes_per_host=gpus_per_host)
        shape.check_tp(layout.tp, seq_len)
        check_cp(cp=layout.cp, seq_len=seq_len, tp=layout.tp)
        check_cp_pp(cp=layout.cp, pp=layout.pp, stages_take_cp=shape.pipeline_with_cp, model=shape.name)
        check_experts(ep=layout.ep, tp=layout.tp, pp=layout.pp, n_experts=shape.n_experts, model=shape.name,
                      experts_with_tp=shape.experts_with_tp)
        if (layout.cp > 1 and not shape.context_parallel) or (layout.ep > 1 and not shape.expert_parallel):
            return False  # what the engine refuses for this family (ModelShape's fields say why)
        if layout.pp > 1:
            check_pipeline(pp=layout.pp, schedule=layout.pipeline_schedule, virtual_stages=layout.virtual_stages,
                           microbatches=layout.microbatches, n_layers=shape.n_layers)
    except ValueError:
        return False
    return True


def layouts(shape: ModelShape, *, seq_len: int, global_batch_size: int, world: int, gpus_per_host: int,
            precision: str = "bf16", offload: Sequence[bool] = (False,)) -> list[Layout]:
    """Every layout of `world` GPUs the SDK accepts for this model and batch (with each of `offload`)."""
    out = []
    for tp in _divisors(gpus_per_host):
        for cp in _divisors(gpus_per_host // tp):  # the ranks splitting a sequence stay inside a host
            for pp in _divisors(world // (tp * cp)) if world % (tp * cp) == 0 else []:
                dp = world // (tp * cp * pp)
                if global_batch_size % dp:
                    continue
                per_rank = global_batch_size // dp
                schedules = SCHEDULES if pp > 1 else (("none", 1),)
                eps = [e for e in _divisors(dp) if shape.n_experts % e == 0] if shape.n_experts else [1]
                for ep, p, (schedule, v), mbs, ac, off in itertools.product(
                        eps, _divisors(dp), schedules, _divisors(per_rank), AC_MODES, offload):
                    layout = Layout(dp=dp, partition_group_size=p, tp=tp, pp=pp, cp=cp, ep=ep,
                                    pipeline_schedule=schedule, virtual_stages=v, micro_batch_size=mbs,
                                    microbatches=per_rank // mbs, activation_checkpointing=ac,
                                    precision=precision, cpu_offload=off)
                    if _valid(shape, layout, seq_len, world, gpus_per_host):
                        out.append(layout)
    return out


def evaluate(shape: ModelShape, layout: Layout, *, seq_len: int, global_batch_size: int, hw: Hardware,
             instance_count: int, train_tokens: float | None = None, compiled: bool = False) -> PlannedLayout:
    mem = memory_model.estimate(shape, layout, seq_len, fused_optimizer=hw.instance_type != LOCAL)
    t = steptime.estimate(shape, layout, seq_len, global_batch_size, hw, instance_count, compiled=compiled)
    tokens_per_s = global_batch_size * seq_len / t.step_s
    per_gpu = tokens_per_s / layout.world
    mfu = per_gpu * shape.flops_per_token(seq_len) / hw.peak_flops
    usd_per_m = hours = usd = None
    if train_tokens:
        hours = train_tokens / tokens_per_s / 3600
    if hw.price_per_hour is not None:
        usd_per_hour = hw.price_per_hour * instance_count
        usd_per_m = usd_per_hour / (tokens_per_s * 3600) * 1e6
        usd = hours * usd_per_hour if hours is not None else None
    over = max(0, mem.total - hw.usable_memory_bytes)
    host_over = max(0, mem.host - hw.usable_host_memory_per_gpu)  # mem.host is 0 unless offloaded
    return PlannedLayout(layout=layout, instance_count=instance_count, memory=mem, time=t,
                         fits=over == 0 and host_over == 0, over_bytes=over, host_over_bytes=host_over,
                         tokens_per_s_per_gpu=per_gpu, mfu=mfu, usd_per_million_tokens=usd_per_m,
                         hours_to_train=hours, usd_to_train=usd)


def _rank(p: PlannedLayout) -> tuple:
    """Fitting first; among them the fastest, where speeds within 1% count as equal and the one without context
    parallelism, then the one needing less memory, wins (the prediction is not finer than that; the ring's sends
    and the split attention cost more than the model counts, and headroom is worth more); then the least over."""
    speed_bucket = math.floor(math.log(p.tokens_per_s_per_gpu) / math.log(1.01))
    return (not p.fits, p.over_bytes + p.host_over_bytes, -speed_bucket, p.layout.cp, p.memory.total)


def _check_positive(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, f"expected an integer >= 1, got {value!r}")
    return value


def plan(model: object, *, seq_len: int, global_batch_size: int, instance_type: str,
         instance_count: int | Sequence[int] = 1, precision: str = "bf16", train_tokens: float | None = None,
         region: str = "us-east-1", processes_per_host: int | None = None,
         micro_batch_size: int | None = None, compile: bool = False) -> Plan:
    """Every valid layout of `model` on `instance_count` hosts of `instance_type` (or on each of several counts),
    best first (only those with `micro_batch_size` when given; `processes_per_host` for `local` hosts; `compile`:
    the job runs under torch.compile, as the built-in trainer's `compile` does). Across counts the ranking by
    tokens/s per GPU is the ranking by cost per token."""
    if not isinstance(compile, bool):
        raise ConfigError("compile", f"expected a bool (True or False), got the {type(compile).__name__} "
                                     f"{compile!r}")
    shape = resolve_model(model)
    _check_positive("seq_len", seq_len)
    _check_positive("global_batch_size", global_batch_size)
    counts = [instance_count] if isinstance(instance_count, int) else list(instance_count)
    if not counts:
        raise ConfigError("instance_count", "no instance count given; pass one, or several (e.g. 1, 2, 4)")
    for n in counts:
        _check_positive("instance_count", n)
    if precision not in memory_model.COMPUTE_BYTES:
        raise ConfigError("precision", f"expected one of {list(memory_model.COMPUTE_BYTES)}, got {precision!r}")
    if shape.max_seq_len and seq_len > shape.max_seq_len:
        raise ConfigError("seq_len", f"{seq_len} exceeds the model's max_seq_len {shape.max_seq_len}; choose "
                                     f"at most {shape.max_seq_len}")
    planned: list[PlannedLayout] = []
    for n in counts:
        hw = hardware(instance_type, n, region=region, processes_per_host=processes_per_host)
        candidates = layouts(shape, seq_len=seq_len, global_batch_size=global_batch_size, world=hw.gpus_per_host * n,
                             gpus_per_host=hw.gpus_per_host, precision=precision,
                             offload=(False, True) if hw.host_bytes_per_s else (False,))
        planned += [evaluate(shape, lay, seq_len=seq_len, global_batch_size=global_batch_size, hw=hw, instance_count=n,
                             train_tokens=train_tokens, compiled=compile)
                    for lay in candidates if micro_batch_size is None or lay.micro_batch_size == micro_batch_size]
    if not planned:
        worlds = sorted({hw.gpus_per_host * n for n in counts})
        mbs = f" in micro-batches of {micro_batch_size}" if micro_batch_size else ""
        raise ConfigError("global_batch_size", f"no layout of {' or '.join(map(str, worlds))} ranks splits a global "
                                               f"batch of {global_batch_size} sequences evenly{mbs}; choose a "
                                               f"multiple of {worlds[0]}{' x the micro-batch size' if mbs else ''}")
    planned.sort(key=_rank)
    return Plan(model=shape, hardware=hw, instance_counts=tuple(counts), seq_len=seq_len,
                global_batch_size=global_batch_size, layouts=planned, compiled=compile)
