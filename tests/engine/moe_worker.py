"""Worker for the mixture-of-experts oracle tests (torchrun agents emulating hosts, gloo, fp32).

For every case in argv[1] (JSON list: name, distribution, microbatches; optional "capacity_factor",
"save"/"resume": a checkpoint location, "dense": the dense "tiny" preset instead, "hf": a small Hugging Face
mixture of experts of that model type instead, with its own load-balancing loss (`output_router_logits`) added
to the loss as its `labels=` loss adds it) it trains the built-in model's
"moe-tiny" preset (4 experts, top 2, a shared expert, the load-balancing loss) through the public API
(`te.transform`, `te.forward_backward`) for STEPS steps, and an unsharded single-process oracle on the same global
micro-batches: micro-batch i of the step is row i of every data-parallel rank's rows (what the load-balancing loss
counts over together). It records the worst relative error over the steps' losses and gradient norms and over the
final weights, and the router statistics of the run. "save" checkpoints step SAVE_AT, "resume" starts from that
step (its steps are compared with the oracle's last ones); "meter" measures one step's all-to-all instead.
Rank 0 writes {case name: {...}} to argv[2]; a case with "refused" writes the ValueError's
text instead.
"""
import dataclasses
import json
import sys

import torch
import torch.distributed as dist

import trainyard.engine as te
from trainyard.engine.components.data import SyntheticSource
from trainyard.engine.components.process_exit import exit_now
from trainyard.engine.distributed.experts import aux_weight
from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model, init_weights
from trainyard.engine.models.llama.moe import router_stats
from trainyard.engine.trainer import token_loss

STEPS, SEED, LR, CLIP, SEQ, SAVE_AT = 3, 5, 1e-3, 0.05, 32, 2


# small Hugging Face mixtures of experts built from a config (transformers 5's packed experts)
HF = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16),
      "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}
HF_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                 output_router_logits=True, router_aux_loss_coef=0.05)


def loss_of(case: dict):
    """The case's loss: the built-in model's load-balancing loss joins the gradient by itself; an HF model's is its
    output's `aux_loss`, added as its own `labels=` loss adds it."""
    if not case.get("hf"):
        return token_loss
    return lambda out, targets: token_loss(out, targets) + HF_COMMON["router_aux_loss_coef"] * out.aux_loss


def build(case: dict):
    """The case's model with the oracle's weights: the built-in one initialised by the seed (transform's init), an
    HF one built with the seed set (transform broadcasts rank 0's weights)."""
    if case.get("hf"):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(SEED)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(case["hf"], **HF_COMMON, **HF[case["hf"]]))
    return build_model(config(case))


def config(case: dict):
    cfg = MODEL_CONFIGS["tiny" if case.get("dense") else "moe-tiny"]
    return dataclasses.replace(cfg, capacity_factor=case["capacity_factor"]) if "capacity_factor" in case else cfg


def optimizer(params):
    # fused: one DTensor op a step (foreach propagates the sharding of ~12; the CPU default, every op of every shard)
    return torch.optim.AdamW(params, lr=LR, eps=1e-5, weight_decay=0.1, fused=True)


def data(rows: int) -> SyntheticSource:
    return SyntheticSource(seed=SEED, global_batch_size=rows, seq_len=SEQ,
                           vocab_size=MODEL_CONFIGS["moe-tiny"].vocab_size)


def oracle(case: dict, dp: int, m: int) -> dict:
    model = build(case)
    if not case.get("hf"):
        init_weights(model, SEED, device="cpu")
    opt = optimizer(model.parameters())
    source, losses, norms = data(dp * m), [], []
    for step in range(1, STEPS + 1):
        batch = source.global_batch(step)
        total = 0.0
        for i in range(m):
            rows = batch[[r * m + i for r in range(dp)]]  # micro-batch i of every data-parallel rank
            with aux_weight(1 / m):
                loss = loss_of(case)(model(rows[:, :-1]), rows[:, 1:]) / m
            loss.backward()
            total += loss.item()
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "weights": model.state_dict()}


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def run(case: dict) -> dict:
    model = te.transform(build(case), distribution=case["distribution"], seed=SEED)
    layout = te.api._layout(model)
    m, dp = case["microbatches"], layout.dims.dp
    opt = optimizer(model.parameters())
    source, losses, norms = data(dp * m), [], []
    start = te.load_checkpoint(model, opt, uri=case["resume"]) if case.get("resume") else 0
    assert start == (SAVE_AT if case.get("resume") else 0), start
    for step in range(start + 1, STEPS + 1):
        batch = te.rows(model, source.global_batch(step))
        losses.append(te.forward_backward(model, batch[:, :-1], batch[:, 1:], loss_of(case), microbatches=m))
        norms.append(te.clip_grad_norm_(model, CLIP))
        opt.step()
        opt.zero_grad()
        if case.get("save") and step == SAVE_AT:
            te.save_checkpoint(model, opt, step, uri=case["save"])
    te.wait_for_checkpoints()
    stats = router_stats(model)
    state = te.full_state_dict(model)
    want = oracle(case, dp, m)
    worst = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        expected = {k: v for k, v in want["weights"].items() if not k.endswith("expert_bias")}
        assert set(state) >= set(expected), sorted(set(state) ^ set(expected))
        worst[0] = max(((state[k] - v).norm() / v.norm()).item() for k, v in expected.items())
    dist.broadcast(worst, 0)
    return {"loss": max(rel(a, b) for a, b in zip(losses, want["losses"][start:])),
            "grad_norm": max(rel(a, b) for a, b in zip(norms, want["norms"][start:])),
            "weights": worst.item(), "stats": stats}


def measure(case: dict) -> list[dict]:
    """One step under the comm meter with the routing pinned (every token's top 2 are experts 0 and 1, on the first
    rank of each ep group: a bias for the choice only): every rank's all-to-all bytes and what the meter puts on
    the `ep` dimension."""
    from trainyard.engine.components.meter import CommMeter
    from trainyard.engine.models.llama.moe import moe_layers

    model = te.transform(build_model(config(case)), distribution=case["distribution"], seed=SEED)
    layout = te.api._layout(model)
    for layer in moe_layers(model):
        layer.bias_update_rate = 1.0  # the bias steers the choice
        layer.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    m = case["microbatches"]
    batch = te.rows(model, data(layout.dims.dp * m).global_batch(1))
    meter = CommMeter(layout.dims.processes_per_host, layout.dims)
    with meter.active():
        te.forward_backward(model, batch[:, :-1], batch[:, 1:], token_loss, microbatches=m)
    totals = meter.totals()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"all_to_all": totals["by_kind"].get("all_to_all", {}),
                                   "ep": totals["by_dim"].get("ep", {})})
    return every


def refused(case: dict) -> str:
    try:
        run(case)
    except ValueError as e:
        return str(e)
    return ""


def main() -> None:
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    te.init({})
    results = {case["name"]: refused(case) if case.get("refused") else measure(case) if case.get("meter")
               else run(case) for case in cases}
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    te.finish()


if __name__ == "__main__":
    main()
    exit_now(0)  # without the interpreter's teardown of torch (engine/components/process_exit.py)
