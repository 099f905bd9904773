"""Worker for the fp16 loss-scaling test of two ranks (test_scaler.py), under torchrun.

argv[1] is a JSON list of cases {"distribution", "poison_rank"}, argv[2] the output JSON. Each case trains the
built-in model (4 layers, built on the meta device) in fp16 on `distribution` for 3 steps through the public API
(`te.forward_backward`, `te.clip_grad_norm_`, `te.optimizer_step`); at step 2 the rank `poison_rank` writes an inf
into the local shard of one of its gradients. Every rank records whether each step was applied and the loss scale
it ran at; rank 0 compares the weights' movement from their initial values with an unsharded fp32 oracle that
took steps 1 and 3 only ("update_rel_err"), and with one that took all three ("update_rel_err_if_applied").
"""
import json
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import trainyard.engine as te
from trainyard.engine.models.llama.model import ModelConfig, build_model, init_weights
from trainyard.engine.components.process_exit import exit_now

SEED, LR, CLIP, SEQ, VOCAB, STEPS, POISONED = 5, 1e-3, 1.0, 16, 128, 3, 2
SHAPE = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)


def loss_fn(output, targets):
    return F.cross_entropy(output.float().flatten(0, 1), targets.flatten())


def batch(step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)


def optimizer(params):
    # fused: one DTensor op a step (foreach propagates the sharding of ~12; the CPU default, every op of every shard)
    return torch.optim.AdamW(params, lr=LR, eps=1e-5, weight_decay=0.1, fused=True)


def oracle(rows: int, steps: list[int]) -> tuple[dict, dict]:
    """The unsharded fp32 model's initial weights and its weights after `steps`."""
    model = build_model(SHAPE)
    init_weights(model, SEED, device="cpu")
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = optimizer(model.parameters())
    for step in steps:
        data = batch(step, rows)
        loss_fn(model(data[:, :-1]), data[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return start, {k: v.detach() for k, v in model.state_dict().items()}


def poison(model) -> None:
    """An inf in this rank's local shard of its first gradient that has one."""
    for p in model.parameters():
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if local is not None and local.numel():
            local.view(-1)[0] = math.inf
            return
    raise AssertionError("this rank holds no gradient to poison")


def run(case: dict, ctx) -> dict:
    model = te.transform(build_model(SHAPE), distribution=case["distribution"], seed=SEED, mixed_precision="fp16")
    layout = getattr(model, "_trainyard_layout")
    m = 2  # micro-batches: at least the pipeline's degree
    rows = layout.dims.dp * m
    opt = optimizer(model.parameters())
    scaler = te.scaler(model)
    stepped, scales = [], []
    for step in range(1, STEPS + 1):
        mine = te.rows(model, batch(step, rows))
        scales.append(scaler.get_scale())
        te.forward_backward(model, mine[:, :-1], mine[:, 1:], loss_fn, microbatches=m)
        if step == POISONED and ctx.rank == case["poison_rank"]:
            poison(model)
        te.clip_grad_norm_(model, CLIP)
        stepped.append(te.optimizer_step(model, opt))
        opt.zero_grad()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (stepped, scales))
    got = te.full_state_dict(model)
    out = {"stepped": [s for s, _ in everyone], "scales": [c for _, c in everyone]}
    if ctx.rank == 0:
        start, want = oracle(rows, [s for s in range(1, STEPS + 1) if s != POISONED])
        _, applied = oracle(rows, list(range(1, STEPS + 1)))

        def rel(ref):  # the weights' movement against the reference's, over all of them
            num = sum((got[k].float() - ref[k]).norm() ** 2 for k in ref) ** 0.5
            den = sum((ref[k] - start[k]).norm() ** 2 for k in ref) ** 0.5
            return float(num / den)

        out.update(update_rel_err=rel(want), update_rel_err_if_applied=rel(applied))
    return out


def main() -> None:
    cases, out_path = json.loads(sys.argv[1]), sys.argv[2]
    ctx = te.init({})
    results = [run(case, ctx) for case in cases]
    if ctx.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    te.finish()


if __name__ == "__main__":
    main()
    exit_now(0)  # without the interpreter's teardown of torch (~1 s of CPU per rank; engine/components/process_exit.py)
