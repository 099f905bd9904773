"""Bring your own model: a training script on trainyard.engine's public API only.

It runs as it is under `torchrun`, as one plain process, or as an Estimator entry point:

    Estimator(entry_point="train.py", source_dir="examples/byom", instance_count=2, processes_per_host=2,
              distribution={"mics": {"partition_group_size": 2}}, checkpoint_s3_uri="s3://bucket/ckpt",
              hyperparameters={"steps": 20}).fit()

The layout (MiCS, tensor, pipeline, context or expert parallelism) comes from the job's `distribution`; the
script does not change with it. `--model moe` trains Trainyard's built-in mixture of experts (the "moe-tiny"
preset), whose experts `expert_parallel_degree` spreads over ranks. Checkpoints go to the job's checkpoint_s3_uri (or --checkpoint_uri) every step, and a
restarted job resumes from the newest one.
"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import trainyard.engine as te

parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=["hf", "mlp", "moe"], default="hf")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--global_batch", type=int, default=8)   # sequences per step, over all ranks
parser.add_argument("--microbatches", type=int, default=2)   # per rank and step
parser.add_argument("--seq_len", type=int, default=32)
parser.add_argument("--checkpoint_uri", default=None)         # None: the job's checkpoint_s3_uri
parser.add_argument("--check", nargs="?", const="true", default="false")  # `--check` or `--check true`
args = parser.parse_args()
VOCAB = 256
MLP_TP_PLAN = {"stack.*.1": "colwise", "stack.*.3": "rowwise"}  # tensor parallelism for a plain module


class ResidualMLP(nn.Module):
    """Any nn.Module: its blocks are the children of its largest ModuleList (here `stack`)."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.stack = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                 nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.stack:
            h = h + block(h)
        return self.head(h)


def build() -> nn.Module:
    if args.model == "mlp":
        return ResidualMLP()
    if args.model == "moe":  # Trainyard's built-in mixture of experts (4 experts, top 2): expert parallelism
        return te.build_model("moe-tiny")
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def loss_fn(output, targets):
    logits = output.logits if hasattr(output, "logits") else output  # HF output or plain logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def global_batch(step: int) -> torch.Tensor:
    """The whole job's batch of `step`, a pure function of the step (a resumed run continues the stream):
    rows `start + i * stride (mod 64)`, a pattern the model learns in a few steps."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 64, (args.global_batch, 1), generator=g)
    stride = torch.randint(1, 8, (args.global_batch, 1), generator=g)
    return (start + stride * torch.arange(args.seq_len + 1)) % 64


ctx = te.init()  # process group and mesh, from the job's distribution
n = args.microbatches
tp_plan = MLP_TP_PLAN if args.model == "mlp" else None  # HF models bring their own
if args.check.lower() == "true":  # one step sharded vs. unsharded, before training
    batch = global_batch(0)
    report = te.check_equivalence(build, batch[:, :-1], batch[:, 1:], loss_fn, microbatches=n, tp_plan=tp_plan)
    if not report.ok:
        raise SystemExit(f"the sharded model does not match the unsharded one:\n{report}")

with torch.device("meta"):  # no memory until sharded; transform initialises the weights
    model = build()
model = te.transform(model, tp_plan=tp_plan)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
start = te.load_checkpoint(model, opt, uri=args.checkpoint_uri)  # 0 when there is none
if start and ctx.is_main:
    print(f"resumed from step {start}", flush=True)

for step in range(start + 1, args.steps + 1):
    rows = ctx.rows(global_batch(step)).to(ctx.device)  # this rank's slice of the global batch
    inputs, targets = rows[:, :-1], rows[:, 1:]
    if ctx.dims.pp > 1:  # pipeline parallelism: the schedule runs the micro-batches (global-batch loss)
        loss = te.forward_backward(model, inputs, targets, loss_fn, microbatches=n)
    else:  # your own loop (loss: this rank's rows; under context parallelism, its chunks of each sequence)
        inputs, targets = te.sequence_shard(model, inputs, targets)
        loss = 0.0
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            with te.accumulate(model, i, n):  # gradients reduced once, on the last micro-batch
                part = loss_fn(model(x), y) / n
                part.backward()
            loss += part.item()
    te.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
    te.save_checkpoint(model, opt, step, uri=args.checkpoint_uri)  # async: uploads while the next step runs
    router = te.router_stats(model)  # a mixture of experts' routing in the step (None for a dense model)
    if ctx.is_main:
        experts = f" experts {router['expert_imbalance']:.2f}x" if router else ""
        print(f"step {step} loss {loss:.4f}{experts}", flush=True)

te.save_model(model, os.environ.get("SM_MODEL_DIR", "model"))  # HF: config.json + model.safetensors
te.finish()
