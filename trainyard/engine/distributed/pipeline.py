"""Pipeline parallelism on `torch.distributed.pipelining`: stages cut from any model its spec describes
(`models.spec.StageSplit`), and the schedules GPipe (all forwards, then all backwards), 1F1B and
interleaved 1F1B.

The blocks are cut into S = pp * v stages (`layout.stage_layers`: evenly, or by an explicit split). Stage
s holds its blocks under their original names (`layers.7...`), the modules before the blocks when s = 0 and
those after them (final norm, head) and the loss when s = S - 1, so weight init and checkpoints see the
same names as the whole model.
Rank r of the pipeline holds stages r, r + pp, ..., r + (v-1) pp (the looped placement interleaved 1F1B
needs; v = 1 for the other schedules).

Each schedule step splits the rank's batch into `microbatches` chunks along the batch dimension. The loss
of a micro-batch is the mean over its tokens, and the schedule divides the gradients by the micro-batch
count (`scale_grads`): together the gradient of the rank's mean loss, which the data-parallel reduction
then averages over ranks, as without a pipeline.

Bubble, for p ranks, m micro-batches and v virtual stages with equal stage times (Narayanan et al.
2021): idle time is (p-1)/m of the ideal compute time for GPipe and 1F1B, (p-1)/(v m) for interleaved
1F1B. 1F1B keeps at most p micro-batches of activations in flight instead of m.
"""
from __future__ import annotations

import copy
import types
from dataclasses import dataclass

import torch
from torch import nn
from trainyard.parallel.layout import check_pipeline, stage_layers
from trainyard.engine.protocols import StageSplit

_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    schedule: str = "1f1b"
    """`gpipe`, `1f1b` or `interleaved_1f1b`."""
    virtual_stages: int = 1
    """Stages per rank (interleaved 1F1B only)."""
    microbatches: int
    """Micro-batches per schedule step; at least the pipeline degree."""
    split: list[int] | None = None
    """Layers of each stage (pp * virtual_stages entries); None cuts them evenly."""


def rank_stages(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds (looped placement)."""
    return [pp_rank + i * pp for i in range(virtual_stages)]


class StageInput:
    """What a stage received (hidden states), for the `OtherStage` placeholders before its blocks."""

    value: torch.Tensor | None = None


class OtherStage(nn.Module):
    """The place of a block another pipeline stage holds (`StageSplit.placeholders`). Before the stage's own
    blocks it returns what the stage received (`source`): whatever the model's forward does to its input before
    the blocks (an embedding scale) was done by the stage that ran the embedding; after them it passes its input
    on. No parameters: names, checkpoints and the optimizer see only the stage's own blocks."""

    def __init__(self, source: StageInput | None) -> None:
        super().__init__()
        self.source = source

    def forward(self, hidden_states, *args, **kwargs):
        return self.source.value if self.source is not None else hidden_states


def cut_stage(model: nn.Module, split: StageSplit, stage: int, num_stages: int,
              counts: list[int] | None = None) -> nn.Module:
    """Stage `stage` of `num_stages` of `model` (a copy; cheap on the meta device): its blocks under their
    original names, the `first` modules on stage 0 only, the `last` ones on the final stage only. With
    placeholders, the copy's `trainyard_stage_input` (a `StageInput`) is what the stage forward fills."""
    part = copy.deepcopy(model)
    parent_path, _, attr = split.blocks.rpartition(".")
    parent = part.get_submodule(parent_path) if parent_path else part
    container = getattr(parent, attr)
    items = list(container.items()) if isinstance(container, nn.ModuleDict) else \
        [(str(i), b) for i, b in enumerate(container)]
    keep = set(stage_layers(len(items), num_stages, counts)[stage])
    if split.placeholders and isinstance(container, nn.ModuleList):
        source = StageInput()
        part.trainyard_stage_input = source
        setattr(parent, attr, nn.ModuleList(b if i in keep else OtherStage(source if i < min(keep) else None)
                                            for i, (_, b) in enumerate(items)))
    else:
        setattr(parent, attr, nn.ModuleDict({k: b for i, (k, b) in enumerate(items) if i in keep}))
    dropped = (split.first if stage != 0 else ()) + (split.last if stage != num_stages - 1 else ())
    for path in dropped:
        owner_path, _, name = path.rpartition(".")
        setattr(part.get_submodule(owner_path) if owner_path else part, name,
                nn.Identity() if path in split.identity else None)
    if split.forward is not None:
        # an instance attribute: module hooks (FSDP's) still run around it when the stage is called
        part.forward = types.MethodType(split.forward, part)
    return part


def build_schedule(parts: list[nn.Module], stages: list[int], num_stages: int, *, pp_group, device: torch.device,
                   config: PipelineConfig, loss_fn):
    """The schedule that runs this rank's `parts` (one module per stage index in `stages`)."""
    pp = pp_group.size()
    check_pipeline(pp=pp, schedule=config.schedule, virtual_stages=config.virtual_stages,
                   microbatches=config.microbatches)
    # imported here, not at the top: torch.distributed.pipelining imports torch._dynamo (0.9 s of CPU), which a
    # training process without a pipeline never needs (components/lazy_dynamo.py)
    from torch.distributed import pipelining

    pipeline_stages = [pipelining.PipelineStage(part, index, num_stages, device, group=pp_group)
                       for part, index in zip(parts, stages)]
    cls = getattr(pipelining, _SCHEDULES[config.schedule])
    if config.schedule == "interleaved_1f1b":
        return cls(pipeline_stages, n_microbatches=config.microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(pipeline_stages[0], n_microbatches=config.microbatches, loss_fn=loss_fn, scale_grads=True)
