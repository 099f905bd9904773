"""Worker for the public-API tests (`trainyard.engine`), under torchrun on emulated hosts.

argv[1] is a JSON list of cases, argv[2] the output JSON. Kinds of case:
- "oracle": train `model` ("hf" LlamaForCausalLM, "mlp" a residual MLP whose blocks sit in a ModuleList named
  `stack`, "shared" that MLP with one weight in two of its blocks, "llama" the built-in Transformer) for STEPS steps through the API only, on `distribution`, and
  compare the gathered weights with an unsharded single-process oracle trained on the same global batches:
  {"worst_rel_err": ...}. With "kernels", the sharded side runs with trainyard.kernels swapped in.
- "curve": train steps `start+1..steps` (resuming with load_checkpoint from `uri` when it holds a step),
  saving at `save_at`; returns the loss of every step it ran.
- "evaluate": te.evaluate and te.predict of an untrained model on `distribution` against the unsharded model:
  {"loss_err", "predict_err" (worst logit difference on the ranks that hold the output), "ranks_with_output"}.
- "refused": one step of `model` with SHARED_TP_PLAN on `distribution`: {"refused": the ValueError's text or ""}.
- "export": train 1 step on `distribution`, save_model to `dir`; rank 0 also writes the logits of the trained
  model on a probe batch to `dir/probe.pt`. "reload": load_pretrained `dir` into a fresh model on
  `distribution` and return the worst difference of its logits from `dir/probe.pt`.
- "busy": an asynchronous save to `uri` whose upload is committed but held on rank 0 alone (its purge waits):
  te.checkpoint_busy() while held and after, as every rank answered: {"held": [...], "released": [...]}.
"""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import trainyard.engine as te
from trainyard.engine.components.process_exit import exit_now

STEPS, SEED, LR, CLIP, SEQ, VOCAB = 2, 5, 1e-3, 0.05, 16, 128


class ResidualMLP(nn.Module):
    """A plain module: blocks in a ModuleList that is not called `layers`."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.stack = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                                 nn.Linear(2 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for block in self.stack:
            h = h + block(h)
        return self.head(h)


class SharedMLP(ResidualMLP):
    """A weight two blocks use: blocks 0 and 2 hold one nn.Parameter in their first Linear (different modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack[2][1].weight = self.stack[0][1].weight


SHARED_TP_PLAN = {"stack.*.1": "colwise", "stack.*.3": "rowwise"}


class PReLUMLP(ResidualMLP):
    """A learnable activation between the column- and the row-parallel Linear of SHARED_TP_PLAN."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.stack:
            block[2] = nn.PReLU()


def build(kind: str) -> nn.Module:
    if kind == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return LlamaForCausalLM(cfg)
    if kind == "mlp":
        return ResidualMLP()
    if kind == "shared":
        return SharedMLP()
    if kind == "prelu":
        return PReLUMLP()
    from trainyard.engine.models.llama.model import ModelConfig, build_model

    return build_model(ModelConfig(vocab_size=VOCAB, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                                   max_seq_len=64))


def loss_fn(output, targets):
    if isinstance(output, te.LMHidden):  # transformed with kernels: the fused linear + cross-entropy
        return te.lm_loss(output, targets)
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def batch(step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)


def optimizer(params):
    # eps large enough that near-zero gradients do not turn summation-order noise into whole updates
    # fused: one DTensor op a step (foreach propagates the sharding of ~12; the CPU default, every op of every shard)
    return torch.optim.AdamW(params, lr=LR, eps=1e-5, weight_decay=0.1, fused=True)


def fresh(kind: str) -> nn.Module:
    torch.manual_seed(SEED)
    return build(kind)


def train_step(model, opt, ctx, step: int, rows: int, microbatches: int, pipelined: bool) -> float:
    data = ctx.rows(batch(step, rows))
    inputs, targets = data[:, :-1], data[:, 1:]
    if pipelined:
        loss = te.forward_backward(model, inputs, targets, loss_fn, microbatches=microbatches)
    else:  # the loop docs/engine.md shows
        loss = 0.0
        for i, (x, y) in enumerate(zip(inputs.chunk(microbatches), targets.chunk(microbatches))):
            with te.accumulate(model, i, microbatches):
                part = loss_fn(model(x), y) / microbatches
                part.backward()
            loss += part.item()
    te.clip_grad_norm_(model, CLIP)
    opt.step()
    opt.zero_grad()
    return loss


def oracle(kind: str, rows: int, steps: int) -> dict:
    model = fresh(kind)
    if kind == "llama":
        from trainyard.engine.models.llama.model import init_weights

        init_weights(model, SEED, device="cpu")
    opt = optimizer(model.parameters())
    for step in range(1, steps + 1):
        data = batch(step, rows)
        loss_fn(model(data[:, :-1]), data[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def run_oracle(case: dict, ctx) -> dict:
    d = case["distribution"]
    model = te.transform(fresh(case["model"]), distribution=d, seed=SEED, kernels=case.get("kernels"),
                         tp_plan=SHARED_TP_PLAN if case["model"] == "shared" else None)
    if case["model"] == "shared":  # the tie survives the layout: one parameter, whatever sharded it
        assert model.stack[2][1].weight is model.stack[0][1].weight
    layout = getattr(model, "_trainyard_layout")
    m, pipelined = case["microbatches"], layout.dims.pp > 1
    rows = layout.dims.dp * m * case.get("rows_per_microbatch", 1)
    opt = optimizer(model.parameters())
    for step in range(1, STEPS + 1):
        data = batch(step, rows)
        mine = te.rows(model, data)
        inputs, targets = mine[:, :-1], mine[:, 1:]
        if pipelined:
            te.forward_backward(model, inputs, targets, loss_fn, microbatches=m)
        else:
            for i, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m))):
                with te.accumulate(model, i, m):
                    (loss_fn(model(x), y) / m).backward()
        te.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()
    got = te.full_state_dict(model)
    worst = 0.0
    if ctx.rank == 0:
        want = oracle(case["model"], rows, STEPS)
        tied = {k for k in want if k not in got}
        assert tied <= {"lm_head.weight", "stack.2.1.weight"}, sorted(tied)
        worst = max(((got[k].float() - want[k]).norm() / want[k].norm()).item() for k in got)
    return {"worst_rel_err": worst}


def run_evaluate(case: dict, ctx) -> dict:
    """te.evaluate and te.predict on `distribution` against the unsharded model's loss and logits (no training)."""
    model = te.transform(fresh(case["model"]), distribution=case["distribution"], seed=SEED)
    data = batch(50, 4)
    mine = te.rows(model, data)
    loss = te.evaluate(model, mine[:, :-1], mine[:, 1:], loss_fn, microbatches=2)
    out = te.predict(model, mine[:, :-1], microbatches=2)
    reference = fresh(case["model"])
    with torch.no_grad():
        want_logits = te.rows(model, reference(data[:, :-1]).logits)
        want = loss_fn(reference(data[:, :-1]), data[:, 1:]).item()
    out = getattr(out, "logits", out)  # an HF output without a pipeline, the last stage's logits with one
    err = 0.0 if out is None else (out - want_logits).abs().max().item()
    errs: list = [None] * dist.get_world_size()
    dist.all_gather_object(errs, (err, out is not None))
    return {"loss_err": abs(loss - want) / want, "predict_err": max(e for e, _ in errs),
            "ranks_with_output": sum(has for _, has in errs)}


def run_refused(case: dict, ctx) -> dict:
    """One training step of `model` on `distribution`; the refusal's message (ValueError), or "" if none."""
    model = te.transform(fresh(case["model"]), distribution=case["distribution"], seed=SEED, tp_plan=SHARED_TP_PLAN)
    data = te.rows(model, batch(1, 4))
    try:
        with te.accumulate(model, 0, 1):
            loss_fn(model(data[:, :-1]), data[:, 1:]).backward()
        te.clip_grad_norm_(model, CLIP)
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": ""}


def run_curve(case: dict, ctx) -> dict:
    model = te.transform(fresh(case["model"]), seed=SEED)
    opt = optimizer(model.parameters())
    start = te.load_checkpoint(model, opt, uri=case["uri"])
    losses = {}
    for step in range(start + 1, case["steps"] + 1):
        # forward_backward returns the global-batch loss (accumulate() leaves the loss to the caller)
        losses[step] = train_step(model, opt, ctx, step, 4, 2 if ctx.dp_size <= 2 else 1, True)
        if step == case.get("save_at"):
            te.save_checkpoint(model, opt, step, uri=case["uri"])
    return {"start": start, "losses": losses}


def probe() -> torch.Tensor:
    return batch(99, 2)[:, :-1]


def run_export(case: dict, ctx) -> dict:
    model = te.transform(fresh("hf"), distribution=case["distribution"], seed=SEED)
    opt = optimizer(model.parameters())
    train_step(model, opt, ctx, 1, 4, 1, False)
    te.save_model(model, case["dir"])
    logits = model(probe()).logits.detach()
    if ctx.rank == 0:
        torch.save(logits, f"{case['dir']}/probe.pt")
    dist.barrier()
    return {}


def run_reload(case: dict, ctx) -> dict:
    torch.manual_seed(SEED + 1)  # other initial weights: only the files can make the logits right
    model = te.transform(build("hf"), distribution=case["distribution"])
    te.load_pretrained(model, case["dir"])  # strict: under a pipeline the other stages' names are expected
    if case.get("export_to"):  # written again from this layout
        te.save_model(model, case["export_to"])
    out = te.predict(model, probe())  # the last stage's logits under a pipeline, None on the other ranks
    want = torch.load(f"{case['dir']}/probe.pt")
    diff = 0.0 if out is None else (getattr(out, "logits", out) - want).abs().max().item()
    diffs: list = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, (diff, out is not None))
    return {"worst_abs_diff": max(d for d, _ in diffs), "ranks_with_output": sum(o for _, o in diffs)}


def run_busy(case: dict, ctx) -> dict:
    import threading

    from trainyard.engine.components.checkpoint import manager

    entered, release = threading.Event(), threading.Event()
    purge = manager.purge

    def held_purge(*args, **kwargs):  # rank 0's background thread, after the step is committed
        entered.set()
        release.wait(60)
        return purge(*args, **kwargs)

    model = te.transform(fresh("mlp"), seed=SEED)
    opt = optimizer(model.parameters())
    assert not te.checkpoint_busy(case["uri"])  # nothing saved to it yet
    manager.purge = held_purge
    te.save_checkpoint(model, opt, 1, uri=case["uri"])
    if ctx.rank == 0:
        assert entered.wait(60)
    dist.barrier()
    answers = {"held": te.checkpoint_busy(case["uri"])}
    release.set()
    assert te.wait_for_checkpoints()
    manager.purge = purge
    answers["released"] = te.checkpoint_busy(case["uri"])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, answers)
    return {key: [g[key] for g in gathered] for key in answers}


def main() -> None:
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    ctx = te.init()
    results = {}
    for case in cases:
        fn = {"oracle": run_oracle, "curve": run_curve, "export": run_export, "reload": run_reload,
              "evaluate": run_evaluate, "refused": run_refused, "busy": run_busy}[case["kind"]]
        results[case["name"]] = fn(case, ctx)
    if ctx.rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    te.finish()


if __name__ == "__main__":
    main()
    exit_now(0)  # without the interpreter's teardown of torch (~1 s of CPU per rank; engine/components/process_exit.py)
