"""The training runs the planner's speed constants (`hardware.EFFICIENCY`, `COMPILED_SPEEDUP`,
`STEP_BYTES_PER_PARAM`) are fitted to, and the plan's prediction for each (tests/job/test_plan_calibration.py
holds every one within 15%; docs/plan.md lists them with their sources): published runs of other stacks
(`PUBLISHED`), and the built-in trainer's own on one H100 (`MEASURED`, from docs/benchmarks.md).

Each run is given as its authors state it: model shape, sequence length, batch, GPUs, the layout and whether it
ran under torch.compile; the throughput in tokens/s per GPU (for the MiCS run, stated in TFLOP/s per GPU, and the
built-in trainer's, stated as MFU, converted with this planner's own FLOPs per token, 6 N + 12 L H Q T, so that
the comparison is of the same quantity).
"""
from __future__ import annotations

from dataclasses import dataclass

from trainyard.job.plan.hardware import hardware
from trainyard.job.plan.layout import Layout
from trainyard.job.plan.planner import evaluate
from trainyard.parallel.shapes import ModelShape, from_preset

# MPT (llm-foundry): GPT-style blocks with a plain 4x GELU MLP, tied embeddings, padded vocabulary 50,368 (6.66B
# and 64.9B parameters; the table's NumParams: 6,658,859,008 and 64,862,437,376)
MPT_7B = ModelShape(name="mpt-7b", vocab_size=50368, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                    ffn_hidden=16384, gated_mlp=False, tied_embeddings=True)
MPT_70B = ModelShape(name="mpt-70b", vocab_size=50368, dim=8192, n_layers=80, n_heads=64, n_kv_heads=64,
                     ffn_hidden=32768, gated_mlp=False, tied_embeddings=True)
# The 30B GPT-2-style model of SageMaker's sharded data parallelism post: its exact widths are not published;
# 48 layers of width 7168 (56 heads of 128) with a 4x MLP is a standard 30B shape (29.9B parameters).
GPT_30B = ModelShape(name="gpt2-30b", vocab_size=50304, dim=7168, n_layers=48, n_heads=56, n_kv_heads=56,
                     ffn_hidden=28672, gated_mlp=False, tied_embeddings=True)


TORCHTITAN = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 SXM 96 GB HBM2e at the 500 W limit, "
              "400 Gb/s per GPU between hosts, seq 8192)")
# torchtitan's measured speed-up of Float8 over bf16, both compiled (Table 1: 8,532 / 6,667 tokens/s/GPU): the
# planner models bf16, so a run published with Float8 is compared at its bf16 equivalent
FLOAT8 = 8532 / 6667


@dataclass(frozen=True, kw_only=True, slots=True)
class Published:
    name: str
    source: str
    model: ModelShape
    instance_type: str
    instance_count: int
    seq_len: int
    layout: Layout
    tokens_per_s_per_gpu: float
    compiled: bool = False
    note: str = ""

    @property
    def global_batch_size(self) -> int:
        return self.layout.dp * self.layout.micro_batch_size * self.layout.microbatches

    def predicted_tokens_per_s_per_gpu(self) -> float:
        hw = hardware(self.instance_type, self.instance_count)
        return evaluate(self.model, self.layout, seq_len=self.seq_len, global_batch_size=self.global_batch_size,
                        hw=hw, instance_count=self.instance_count, compiled=self.compiled).tokens_per_s_per_gpu

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return self.predicted_tokens_per_s_per_gpu() / self.tokens_per_s_per_gpu - 1


def _layout(*, dp: int, p: int, tp: int = 1, mbs: int = 1, micro: int = 1, ac: str, offload: bool = False) -> Layout:
    return Layout(dp=dp, partition_group_size=p, tp=tp, pp=1, pipeline_schedule="none", virtual_stages=1,
                  micro_batch_size=mbs, microbatches=micro, activation_checkpointing=ac, precision="bf16",
                  cpu_offload=offload)


def _torchtitan_8b(gpus: int, table: int, tokens: int, *, compiled: bool) -> Published:
    """Tables 1 (8 GPUs) and 3 (128): Llama 3.1 8B, FSDP, local batch 2, selective AC, bf16, with or without
    torch.compile."""
    how = "FSDP + torch.compile" if compiled else "FSDP, no compile"
    return Published(name=f"torchtitan Llama 3.1 8B, {gpus} H100, FSDP{', compiled' if compiled else ''}",
                     instance_type="p5.48xlarge", instance_count=gpus // 8,
                     source=f"{TORCHTITAN}, Table {table}: Llama 3.1 8B, {gpus} GPUs, {how}, local batch 2, selective "
                            f"AC, bf16: {tokens:,} tokens/s/GPU",
                     model=from_preset("llama3-8b"), seq_len=8192,
                     layout=_layout(dp=gpus, p=gpus, mbs=2, ac="selective"), tokens_per_s_per_gpu=tokens,
                     compiled=compiled)


PUBLISHED = [
    _torchtitan_8b(8, 1, 5762, compiled=False),
    _torchtitan_8b(128, 3, 5605, compiled=False),
    _torchtitan_8b(8, 1, 6667, compiled=True),
    _torchtitan_8b(128, 3, 6514, compiled=True),
    Published(name="torchtitan Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, compiled", instance_type="p5.48xlarge",
              instance_count=32,
              source=f"{TORCHTITAN}, Table 4: Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, "
                     "compile + Float8: 829 tokens/s/GPU",
              model=from_preset("llama3-70b"), seq_len=8192, layout=_layout(dp=32, p=32, tp=8, mbs=16, ac="full"),
              tokens_per_s_per_gpu=829 / FLOAT8, compiled=True,
              note="compared in bf16: 829 / 1.280, torchtitan's own Table 1 speed-up of Float8 over bf16, both "
                   "compiled, on 8B (8,532 / 6,667)"),
    Published(name="llm-foundry MPT-7B, 8 H100, FSDP", instance_type="p5.48xlarge", instance_count=1,
              source="llm-foundry scripts/train/benchmarking/README.md (H100 80GB BF16 table: 7b, seq 2048, 8 GPUs, "
                     "FULL_SHARD, micro-batch 6, no activation checkpointing: 46.44% MFU, 10,643 tokens/s/GPU)",
              model=MPT_7B, seq_len=2048, layout=_layout(dp=8, p=8, mbs=6, ac="none"), tokens_per_s_per_gpu=10643),
    Published(name="llm-foundry MPT-70B, 64 H100, FSDP", instance_type="p5.48xlarge", instance_count=8,
              source="llm-foundry scripts/train/benchmarking/README.md (H100 80GB BF16 table: 70b, seq 2048, 64 GPUs, "
                     "FULL_SHARD, micro-batch 8 x 4 accumulated, activation checkpointing: 42.57% MFU, 1,039 "
                     "tokens/s/GPU)",
              model=MPT_70B, seq_len=2048, layout=_layout(dp=64, p=64, mbs=8, micro=4, ac="full"),
              tokens_per_s_per_gpu=1039),
    Published(name="SageMaker MiCS 30B, 256 A100", instance_type="p4d.24xlarge", instance_count=32,
              source="AWS ML blog on SageMaker sharded data parallelism (MiCS), 2022: 30B GPT-2-style model, seq "
                     "2048, 256 A100 (p4d.24xlarge), 141 TFLOP/s per GPU",
              model=GPT_30B, seq_len=2048, layout=_layout(dp=256, p=32, mbs=4, ac="full"),
              tokens_per_s_per_gpu=141e12 / GPT_30B.flops_per_token(2048)),
]

# The built-in trainer (`torchrun --nproc_per_node 1 -m trainyard.engine.train`: FSDP2 with bf16 compute, fp32
# master weights and reduction, fused AdamW) on `llama3.2-1b`, sequences of 2,048, one H100 80GB HBM3 (p5.4xlarge's
# GPU), 2026-11-24 and -27, docs/benchmarks.md ("MFU on one GPU": medians of steps 4-12; "The planner against the
# trainer on one GPU": bench/plan_check.py, the last of 4 steps, and --offload, the last of 3).
LLAMA_1B = from_preset("llama3.2-1b")
_ONE_H100 = "one H100 80GB HBM3, 2026-11-24"


def _measured(name: str, source: str, *, mbs: int, ac: str = "none", tokens: float | None = None,
              mfu: float | None = None, step_s: float | None = None, compiled: bool = False,
              offload: bool = False) -> Published:
    """A run given by its tokens/s, else its MFU (bench/plan_check.py prints only that), else its step time."""
    if tokens is None:
        tokens = mfu * 989.4e12 / LLAMA_1B.flops_per_token(2048) if mfu else mbs * 2048 / step_s
    return Published(name=name, source=source, model=LLAMA_1B, instance_type="p5.4xlarge", instance_count=1,
                     seq_len=2048, layout=_layout(dp=1, p=1, mbs=mbs, ac=ac, offload=offload),
                     tokens_per_s_per_gpu=tokens, compiled=compiled)


MEASURED = [
    _measured("built-in trainer 1B, 1 H100, 2 x 2048, eager", f"bench/plan_check.py, {_ONE_H100}: 23.0% MFU", mbs=2,
              mfu=0.230),
    _measured("built-in trainer 1B, 1 H100, 4 x 2048, eager", f"bench/mfu.py, {_ONE_H100}: 36,635 tokens/s",
              mbs=4, tokens=36635),
    _measured("built-in trainer 1B, 1 H100, 4 x 2048, selective AC, eager",
              f"bench/plan_check.py, {_ONE_H100}: 27.1% MFU", mbs=4, ac="selective", mfu=0.271),
    _measured("built-in trainer 1B, 1 H100, 8 x 2048, full AC, eager", f"bench/plan_check.py, {_ONE_H100}: 28.7% MFU",
              mbs=8, ac="full", mfu=0.287),
    _measured("built-in trainer 1B, 1 H100, 4 x 2048, compiled", f"bench/mfu.py, {_ONE_H100}: 47,523 tokens/s",
              mbs=4, tokens=47523, compiled=True),
    _measured("built-in trainer 1B, 1 H100, 8 x 2048, compiled",
              "bench/mfu.py, one H100 80GB HBM3, 2026-11-24 and -27: 55,389 and 55,865 tokens/s", mbs=8,
              tokens=(55389 + 55865) / 2, compiled=True),
    _measured("built-in trainer 1B, 1 H100, 4 x 2048, CPU offload, eager",
              f"bench/plan_check.py --offload, {_ONE_H100}: 1.74 s a step", mbs=4, step_s=1.74, offload=True),
    _measured("built-in trainer 1B, 1 H100, 8 x 2048, full AC, CPU offload, eager",
              f"bench/plan_check.py --offload, {_ONE_H100}: 1.95 s a step", mbs=8, ac="full", step_s=1.95,
              offload=True),
]
RUNS = PUBLISHED + MEASURED
