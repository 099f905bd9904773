"""Worker for the context-parallel oracle tests (torchrun agents emulating hosts, gloo, fp32).

For every case in argv[1] (JSON list: name, distribution, microbatches; optional "loop": "plain", "model": "hf",
"save"/"resume": a checkpoint location) it trains the built-in Transformer (or, with "model": "hf", a Hugging Face
Llama at sequence HF_SEQ) through the public API (`te.transform(model, distribution=...)`) for STEPS steps on the
same global batches as an unsharded single-process oracle, and records the worst relative error over the steps'
losses and gradient norms and over the final weights, and of `te.evaluate` after training. "save" checkpoints
step SAVE_AT; "resume" starts from that step, and its steps are compared with the oracle's last ones. A "plain"
loop is a user's own: `te.sequence_shard` of its inputs and targets, `te.accumulate` per micro-batch,
`te.global_loss`.
Rank 0 writes {case name: {"loss", "grad_norm", "weights", "evaluate"}} to argv[2]; a case with "refused" writes
the ValueError's text instead.
"""
import json
import sys

import torch
import torch.distributed as dist

import trainyard.engine as te
from trainyard.engine.components.data import SyntheticSource
from trainyard.engine.components.meter import CommMeter
from trainyard.engine.models.llama.model import ModelConfig, build_model, init_weights
from trainyard.engine.trainer import token_loss
from trainyard.engine.components.process_exit import exit_now

STEPS, SEED, LR, CLIP = 3, 5, 1e-3, 0.05  # CLIP below the gradient norm: clipping is active
SAVE_AT = 2  # a case with "save": URI checkpoints this step there; one with "resume": URI starts from it
SEQ = 32  # 4 zig-zag chunks of 8 under cp 2; 16 tokens per rank, 8 per rank under sequence parallelism 2
CFG = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128, max_seq_len=64)
HF_SEQ = 256  # 4 zig-zag chunks of 64 under cp 2


def hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                       tie_word_embeddings=False)


def build(case: dict):
    """The case's model with the oracle's weights: the built-in one is initialised by the seed (`te.transform`'s
    and `init_weights`' layout-independent init), the HF one is built with the seed set (transform broadcasts
    rank 0's weights)."""
    if case.get("model") == "hf":
        from transformers import LlamaForCausalLM

        torch.manual_seed(SEED)
        return LlamaForCausalLM(hf_config())
    return build_model(CFG)


def seq_len(case: dict) -> int:
    return HF_SEQ if case.get("model") == "hf" else SEQ


def optimizer(params):
    # fused: one DTensor op a step (foreach propagates the sharding of ~12; the CPU default, every op of every shard)
    return torch.optim.AdamW(params, lr=LR, eps=1e-5, weight_decay=0.1, fused=True)


def data(rows: int, seq: int = SEQ) -> SyntheticSource:
    return SyntheticSource(seed=SEED, global_batch_size=rows, seq_len=seq, vocab_size=CFG.vocab_size)


def oracle(case: dict, rows: int) -> dict:
    model = build(case)
    if case.get("model") != "hf":
        init_weights(model, SEED, device="cpu")
    opt = optimizer(model.parameters())
    source, losses, norms = data(rows, seq_len(case)), [], []
    for step in range(1, STEPS + 1):
        batch = source.global_batch(step)
        loss = token_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    batch = source.global_batch(STEPS + 1)
    with torch.no_grad():
        evaluation = token_loss(model(batch[:, :-1]), batch[:, 1:]).item()
    return {"losses": losses, "norms": norms, "weights": model.state_dict(), "evaluate": evaluation}


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def run(case: dict) -> dict:
    ctx = te.current()
    model = te.transform(build(case), distribution=case["distribution"], seed=SEED)
    layout = te.api._layout(model)
    m = case["microbatches"]
    rows = layout.dims.dp * m
    opt = optimizer(model.parameters())
    source, losses, norms = data(rows, seq_len(case)), [], []
    start = te.load_checkpoint(model, opt, uri=case["resume"]) if case.get("resume") else 0
    assert start == (SAVE_AT if case.get("resume") else 0), start
    for step in range(start + 1, STEPS + 1):
        batch = te.rows(model, source.global_batch(step))
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if case.get("loop") == "hf-labels":  # the model's own loss: refused under context parallelism
            x, y = te.sequence_shard(model, inputs, targets)
            model(x, labels=x)
        if case.get("loop") in ("plain", "unsharded"):
            if case["loop"] == "plain":  # "unsharded": a loop that forgot to take its chunks (refused)
                inputs, targets = te.sequence_shard(model, inputs, targets)
            total = 0.0
            for i, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m))):
                with te.accumulate(model, i, m):
                    part = token_loss(model(x), y) / m
                    part.backward()
                total += part.detach()
            losses.append(te.global_loss(model, total))
        else:
            losses.append(te.forward_backward(model, inputs, targets, token_loss, microbatches=m))
        norms.append(te.clip_grad_norm_(model, CLIP))
        opt.step()
        opt.zero_grad()
        if case.get("save") and step == SAVE_AT:
            te.save_checkpoint(model, opt, step, uri=case["save"])
    te.wait_for_checkpoints()
    batch = te.rows(model, source.global_batch(STEPS + 1))
    evaluation = te.evaluate(model, batch[:, :-1], batch[:, 1:], token_loss)
    state = te.full_state_dict(model)
    want = oracle(case, rows)
    worst = torch.zeros(1, dtype=torch.float64)
    if ctx.rank == 0:
        assert set(state) == set(want["weights"]), sorted(set(state) ^ set(want["weights"]))
        worst[0] = max(((state[k] - want["weights"][k]).norm() / want["weights"][k].norm()).item() for k in state)
    dist.broadcast(worst, 0)
    # a resumed run's steps are the uninterrupted oracle's last ones
    return {"loss": max(rel(a, b) for a, b in zip(losses, want["losses"][start:])),
            "grad_norm": max(rel(a, b) for a, b in zip(norms, want["norms"][start:])),
            "weights": worst.item(), "evaluate": rel(evaluation, want["evaluate"])}


def measure(case: dict) -> list[dict]:
    """One step of forward and backward under the comm meter: every rank's point-to-point bytes (the ring's
    sends) and what the meter puts on the `cp` mesh dimension."""
    model = te.transform(build_model(CFG), distribution=case["distribution"], seed=SEED)
    layout = te.api._layout(model)
    m = case["microbatches"]
    batch = te.rows(model, data(layout.dims.dp * m).global_batch(1))
    meter = CommMeter(layout.dims.processes_per_host, layout.dims)
    with meter.active():
        te.forward_backward(model, batch[:, :-1], batch[:, 1:], token_loss, microbatches=m)
    totals = meter.totals()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"p2p": totals["by_kind"].get("p2p", {}), "cp": totals["by_dim"].get("cp", {})})
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
    exit_now(0)  # without the interpreter's teardown of torch (~1 s of CPU per rank; engine/components/process_exit.py)
