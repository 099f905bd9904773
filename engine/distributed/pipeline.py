"""Pipeline parallelism on `torch.distributed.pipelining`: stages cut from the decoder, and the schedules
GPipe (all forwards, then all backwards), 1F1B and interleaved 1F1B.

The layers are cut into S = pp * v stages (`layout.stage_layers`: evenly, or by an explicit split). Stage
s holds its blocks under their original names (`layers.7...`), the embedding when s = 0 and the final
norm, head and loss when s = S - 1, so weight init and checkpoints see the same names as the whole model.
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

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from trainyard.engine.distributed.layout import check_pipeline, stage_layers
from trainyard.engine.models.llama.model import ModelConfig, Transformer, build_model

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


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


def build_stage_model(cfg: ModelConfig, stage: int, num_stages: int, split: list[int] | None = None) -> Transformer:
    """Stage `stage` of `num_stages`, on the meta device: its blocks, plus the embedding on the first stage
    and the final norm and head on the last."""
    keep = set(stage_layers(cfg.n_layers, num_stages, split)[stage])
    model = build_model(cfg)
    for name in list(model.layers):
        if int(name) not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != num_stages - 1:
        model.norm = None
        model.output = None
    return model


def build_schedule(parts: list[nn.Module], stages: list[int], num_stages: int, *, pp_group, device: torch.device,
                   config: PipelineConfig, loss_fn):
    """The schedule that runs this rank's `parts` (one module per stage index in `stages`)."""
    pp = pp_group.size()
    check_pipeline(pp=pp, schedule=config.schedule, virtual_stages=config.virtual_stages,
                   microbatches=config.microbatches)
    pipeline_stages = [PipelineStage(part, index, num_stages, device, group=pp_group)
                       for part, index in zip(parts, stages)]
    cls = _SCHEDULES[config.schedule]
    if config.schedule == "interleaved_1f1b":
        return cls(pipeline_stages, n_microbatches=config.microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(pipeline_stages[0], n_microbatches=config.microbatches, loss_fn=loss_fn, scale_grads=True)
