"""Checks of a 3D layout against a model, without torch: what the SDK runs when an Estimator is built and
what the engine runs again before it builds anything. Every message names the numbers and the fix.

- Tensor parallelism splits query heads, key/value heads, the MLP hidden width and the vocabulary over
  `tp` ranks, and (sequence parallelism) the sequence between blocks: each must be a multiple of `tp`.
- Pipeline parallelism cuts the layers into `pp * v` stages (v virtual stages per rank with the
  interleaved schedule), evenly or by an explicit split; every stage holds at least one layer.
- Context parallelism cuts each sequence into 2 x cp zig-zag chunks (rank r holds chunks r and 2 cp - 1 - r):
  the sequence length must be a multiple of 2 x cp, and under sequence parallelism a rank's cp-th of it a
  multiple of `tp`.
- Micro-batches: every schedule needs at least as many as the pipeline has ranks to fill it (fewer
  leave ranks idle for the whole step); interleaved 1F1B also needs a multiple of the rank count
  (the rule of Narayanan et al. 2021 under which its bubble is (p-1)/(v m)).
"""
from __future__ import annotations

import math

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def check_tp(*, tp: int, n_heads: int, n_kv_heads: int, ffn_hidden: int | None, vocab_size: int,
             seq_len: int | None = None, ffn_name: str = "ffn_hidden") -> None:
    """ValueError unless every dimension tensor parallelism splits is a multiple of `tp` (`ffn_hidden`: the MLP
    width it splits, None where none is, named `ffn_name`: `ModelShape.check_tp` gives both)."""
    if tp == 1:
        return
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), (ffn_name, ffn_hidden),
                        ("vocab_size", vocab_size), ("seq_len", seq_len)):
        if value is not None and value % tp:
            what = {"n_kv_heads": "key/value heads (grouped-query attention)",
                    "seq_len": "sequence length (sequence parallelism splits it between blocks)"}.get(name, name)
            raise ValueError(f"tensor_parallel_degree {tp} must divide the model's {what}: {name} = {value}; "
                             f"choose a degree that divides {value}")


def check_cp(*, cp: int, seq_len: int, tp: int = 1) -> None:
    """ValueError unless a sequence of `seq_len` tokens splits into 2 x cp zig-zag chunks (and a rank's
    seq_len / cp tokens over `tp` sequence-parallel ranks)."""
    if cp == 1:
        return
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} must be divisible by 2 x context_parallel_degree = {2 * cp} (each rank "
                         f"holds two of {2 * cp} zig-zag chunks); choose a multiple of {2 * cp}")
    if (seq_len // cp) % tp:
        raise ValueError(f"seq_len {seq_len} / context_parallel_degree {cp} = {seq_len // cp} tokens per rank must be "
                         f"divisible by tensor_parallel_degree {tp} (sequence parallelism splits them); choose seq_len "
                         f"a multiple of {2 * cp * tp // math.gcd(2, tp)}")


def check_cp_pp(*, cp: int, pp: int, stages_take_cp: bool, model: str = "the model") -> None:
    """ValueError unless `model`'s pipeline stages can run on a rank's chunks of the sequence, where both context
    and pipeline parallelism are on (`ModelShape.pipeline_with_cp`, the engine's `StageSplit.context_parallel`)."""
    if cp > 1 and pp > 1 and not stages_take_cp:
        raise ValueError(f"context_parallel_degree {cp} with pipeline_parallel_degree {pp}: {model}'s pipeline stages "
                         "cannot run on a rank's chunks of the sequence (its positions are set by its own forward, "
                         "which no stage runs; the built-in model's stages can); set one of them to 1")


def check_experts(*, ep: int, tp: int, pp: int, n_experts: int, model: str = "the model",
                  experts_with_tp: bool = True) -> None:
    """ValueError naming the field unless a mixture of experts (`n_experts`, 0: dense) fits the layout: expert
    parallelism needs experts and a degree dividing their number; tensor parallelism takes the built-in mixture of
    experts (`experts_with_tp`, `ModelShape.experts_with_tp`), not a Hugging Face one."""
    if ep > 1 and not n_experts:
        raise ValueError(f"expert_parallel_degree {ep}: {model} is dense (no experts to spread); choose a "
                         "mixture-of-experts model (e.g. the moe-tiny or mixtral-8x7b preset) or set "
                         "expert_parallel_degree to 1")
    if n_experts and n_experts % ep:
        raise ValueError(f"expert_parallel_degree {ep} must divide the number of experts {n_experts} of {model}; "
                         f"choose a divisor of {n_experts}")
    if n_experts and tp > 1 and not experts_with_tp:
        raise ValueError(TP_WITH_HF_EXPERTS.format(tp=tp, model=model, n=n_experts))


# a Hugging Face mixture of experts under tensor parallelism (the engine's HF MoE and the planner refuse it alike)
TP_WITH_HF_EXPERTS = ("tensor_parallel_degree {tp} with {model}'s {n} experts: a Hugging Face mixture of experts has "
                      "no tensor-parallel plan here (its attention's plan leaves every rank the whole sequence, so the "
                      "experts would see each token tp times); set tensor_parallel_degree to 1 and spread the experts "
                      "with expert_parallel_degree (the built-in mixture of experts takes both)")


def stage_layers(n_layers: int, stages: int, split: list[int] | None = None) -> list[list[int]]:
    """The layer indices of each of `stages` pipeline stages: `split` gives the count per stage, else
    the layers are cut evenly (which needs n_layers divisible by stages)."""
    if split is None:
        if n_layers % stages:
            raise ValueError(f"{n_layers} layers do not split evenly into {stages} pipeline stages; choose "
                             f"a degree (x virtual_stages) that divides {n_layers}, or give pipeline_split")
        split = [n_layers // stages] * stages
    if len(split) != stages:
        raise ValueError(f"pipeline_split has {len(split)} entries, one per stage is needed: {stages}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split):
        raise ValueError(f"pipeline_split {split}: every stage needs an integer number of layers >= 1")
    if sum(split) != n_layers:
        raise ValueError(f"pipeline_split {split} sums to {sum(split)}, the model has {n_layers} layers")
    bounds = [sum(split[:i]) for i in range(stages + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(stages)]


def check_pipeline(*, pp: int, schedule: str, virtual_stages: int, microbatches: int | None,
                   n_layers: int | None = None, split: list[int] | None = None) -> None:
    """ValueError for a pipeline that cannot run: unknown schedule, virtual stages without the
    interleaved schedule, too few micro-batches, layers that do not split."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {list(PIPELINE_SCHEDULES)}, got {schedule!r}")
    if schedule == "interleaved_1f1b":
        if virtual_stages < 2:
            raise ValueError(f"interleaved_1f1b needs virtual_stages >= 2 (got {virtual_stages}); with one stage "
                             "per rank use pipeline_schedule '1f1b'")
    elif virtual_stages != 1:
        raise ValueError(f"virtual_stages {virtual_stages} needs pipeline_schedule 'interleaved_1f1b' "
                         f"(got {schedule!r})")
    if pp == 1 and virtual_stages > 1:
        raise ValueError(f"virtual_stages {virtual_stages} needs a pipeline: set pipeline_parallel_degree > 1 or "
                         "drop virtual_stages")
    if pp > 1 and microbatches is not None:
        if microbatches < pp:
            raise ValueError(f"{microbatches} micro-batch(es) per step (microbatches, or global batch / (micro-batch "
                             f"size x data-parallel ranks)) is below the pipeline_parallel_degree ({pp}): fewer "
                             f"micro-batches than stages leave stages idle for the whole step")
        if schedule == "interleaved_1f1b" and microbatches % pp:
            raise ValueError(f"interleaved_1f1b needs the micro-batches per step ({microbatches}) to be a multiple "
                             f"of pipeline_parallel_degree ({pp})")
    if n_layers is not None:
        stage_layers(n_layers, pp * virtual_stages, split)
