"""`trainyard plan`: every layout of a model on a cluster, best first (trainyard/job/plan; docs/plan.md)."""
from __future__ import annotations

import argparse
import json
import math
import shutil
import textwrap

from trainyard.job import catalog
from trainyard.job.plan import Plan, PlannedLayout, plan
from trainyard.sdk.jobs.format import human_duration, human_size, print_table

EXAMPLES = ("trainyard plan --model llama3-8b --seq-len 8192 --global-batch-size 16 --instance-type ml.p5.48xlarge "
            "--instance-count 1\n"
            "trainyard plan --model ./my-model/config.json --seq-len 4096 --global-batch-size 512 --instance-type "
            "p4d.24xlarge --instance-count 8 --train-tokens 1e11\n"
            "trainyard plan --model llama3-70b --seq-len 8192 --global-batch-size 256 --instance-type p5.48xlarge "
            "--instance-count 8 --json | jq '.layouts[0]'")
LEGEND = ("dp: data-parallel ranks; p: MiCS partition group (ranks sharing one copy of the model state); tp, cp, ep, "
          "pp: tensor-, context-, expert- and pipeline-parallel degrees (and schedule); micro-batch: sequences x micro-batches per step and "
          "rank; AC: activation checkpointing; offload: optimizer state in host memory. memory/GPU, tokens/s/GPU and "
          "MFU are predicted (formulas and calibration: docs/plan.md); $/M tokens at the On-Demand list price. "
          "--json lists every layout.")
LOCAL_NOTE = ("local: no datasheet for this machine's CPU, so the speed columns (tokens/s/GPU, MFU) come from a "
              "nominal CPU peak: they rank the layouts against each other, they do not predict what a run here "
              "measures. The memory columns hold.")
HEADERS = ["#", "fits", "dp", "p", "tp", "cp", "ep", "pp", "micro-batch", "AC", "offload", "memory/GPU",
           "tokens/s/GPU", "MFU", "$/M tokens"]


def add_parser(sub, command) -> None:
    """Register `trainyard plan` with the CLI's `_command` helper."""
    pl = command(sub, "plan", "memory, speed and cost of every layout of a model, best first",
                 EXAMPLES,
                 "Enumerates every layout the engine accepts (data-parallel ranks, MiCS partition size p, tensor-,\n"
                 "context-, expert- and pipeline-parallel degrees and schedule, micro-batch, activation\n"
                 "checkpointing, CPU offload)\n"
                 "and predicts memory per GPU (and host memory, offloaded), tokens/s, MFU and $ per million\n"
                 "tokens (On-Demand list price). Layouts that fit come first, fastest first; those that do not\n"
                 "say by how much they are over. docs/plan.md has the formulas and the published runs the speed\n"
                 "is calibrated on.")
    pl.add_argument("--model", required=True, metavar="PRESET|CONFIG.json|DIR",
                    help="a built-in preset (llama3.2-1b, llama3-8b, llama3-70b, ...), a Hugging Face config.json or "
                         "a folder holding one")
    pl.add_argument("--seq-len", type=_positive(int), required=True, metavar="N", help="tokens per sequence")
    pl.add_argument("--global-batch-size", type=_positive(int), required=True, metavar="N", help="sequences per step")
    pl.add_argument("--instance-type", required=True, metavar="TYPE", help="ml.p5.48xlarge, p4d.24xlarge, ...")
    pl.add_argument("--instance-count", type=_counts, default=(1,), metavar="N",
                    help="hosts (default 1), or several to compare: 4,8,16 or a range 2-8")
    pl.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="compute dtype (default bf16)")
    pl.add_argument("--compile", action="store_true",
                    help="the job runs under torch.compile (the built-in trainer's compile=true); default eager")
    pl.add_argument("--train-tokens", type=_positive(float), default=None, metavar="N",
                    help="also the hours and dollars to train this many tokens")
    pl.add_argument("--top", type=_positive(int), default=20, metavar="N", help="rows of the table (default 20; --json: all)")
    pl.add_argument("--json", action="store_true", help='print {"layouts": [...]} (every layout, best first)')


def _positive(kind: type):
    """An argparse type: a finite number > 0 of `kind` (argparse names the flag in its error)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a {'whole ' if kind is int else ''}number > 0")
        return value
    parse.__name__ = kind.__name__  # argparse says "invalid int value" when it is not ours
    return parse


def _counts(text: str) -> tuple[int, ...]:
    """`8`, `4,8,16` or `2-8` (every count from 2 to 8)."""
    try:
        if "-" in text:
            low, high = (int(x) for x in text.split("-", 1))
            counts = tuple(range(low, high + 1))
        else:
            counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count >= 1 (8), a list (4,8,16) or a range (2-8)")
    return counts


def _fits(p: PlannedLayout) -> str:
    if p.fits:
        return "yes"
    over = [f"+{human_size(p.over_bytes)}"] if p.over_bytes else []
    return "no, " + ", ".join(over + ([f"host +{human_size(p.host_over_bytes)}"] if p.host_over_bytes else []))


def _row(i: int, p: PlannedLayout, several: bool) -> list[str]:
    lay = p.layout
    pipe = str(lay.pp) if lay.pp == 1 else f"{lay.pp} {lay.pipeline_schedule}"
    cost = f"{p.usd_per_million_tokens:.3f}" if p.usd_per_million_tokens is not None else "no price"
    row = [str(i), *([str(p.instance_count)] if several else []), _fits(p), str(lay.dp),
           str(lay.partition_group_size), str(lay.tp), str(lay.cp), str(lay.ep), pipe,
           f"{lay.micro_batch_size} x {lay.microbatches}", lay.activation_checkpointing,
           f"host {human_size(p.memory.host)}" if lay.cpu_offload else "-", human_size(p.memory.total),
           f"{p.tokens_per_s_per_gpu:,.0f}", f"{p.mfu:.1%}", cost]
    if p.hours_to_train is not None:
        row.append(human_duration(p.hours_to_train * 3600))
        row.append(f"{p.usd_to_train:,.0f}" if p.usd_to_train is not None else "no price")
    return row


def show_plan(a) -> int:
    result: Plan = plan(a.model, seq_len=a.seq_len, global_batch_size=a.global_batch_size,
                        instance_type=a.instance_type, instance_count=a.instance_count, precision=a.precision,
                        train_tokens=a.train_tokens, compile=a.compile)
    if a.json:
        print(json.dumps(result.to_dict()))
        return 0
    hw, shape = result.hardware, result.model
    fitting = sum(p.fits for p in result.layouts)
    counts = result.instance_counts
    several = len(counts) > 1
    size = f"{shape.total_params / 1e9:.2f}B" if shape.total_params >= 1e9 else f"{shape.total_params / 1e6:.2f}M"
    print(f"{shape.name}: {size} parameters, seq {result.seq_len}, global batch "
                    f"{result.global_batch_size}; {'/'.join(map(str, counts))} x {hw.instance_type} "
                    f"({hw.gpus_per_host} x "
                    f"{hw.accelerator}, {human_size(hw.gpu_memory_bytes)} each, {human_size(hw.usable_memory_bytes)} "
                    f"usable); {'compiled' if result.compiled else 'eager'}; {len(result.layouts)} layouts, "
                    f"{fitting} fit", flush=True)
    headers = HEADERS[:1] + (["hosts"] if several else []) + HEADERS[1:] + \
        (["time to train", "$ to train"] if a.train_tokens else [])
    rows = [_row(i, p, several) for i, p in enumerate(result.layouts[:a.top], 1)]
    print_table(headers, rows, right=("#", "hosts", "dp", "p", "tp", "memory/GPU", "tokens/s/GPU", "MFU",
                                      "$/M tokens", "$ to train"))
    width = min(shutil.get_terminal_size((100, 24)).columns, 120)
    for text in (LEGEND, *([LOCAL_NOTE] if hw.instance_type == catalog.LOCAL else [])):
        print(textwrap.fill(text, width, break_on_hyphens=False))
    return 0
