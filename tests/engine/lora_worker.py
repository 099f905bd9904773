"""The LoRA worker (tests/engine/test_lora.py): a PEFT LoRA model over a small Hugging Face model, trained through the
engine's public API on a layout and compared with one unsharded process, under torchrun (argv[1] a JSON list of
cases, argv[2] the output JSON; rank 0 writes it).

A case: name, family (tests/engine/families.py), tie, layout (a key of families.LAYOUTS), steps; optional:
"export" (a folder: save_model writes the adapter there, and rank 0 compares `PeftModel.from_pretrained`'s logits
with the trained model's), "merged" (a folder: the same for the merged export and `from_pretrained`), "uri" + "save_at" (a checkpoint of the trainable parameters only at that step),
"base" (a folder: rank 0 writes the base model's weights there before training), "resume" (start from a model of
other weights, load the base from "base" with load_pretrained, then the checkpoint at "uri"), "refused" (only
transform on the layout: the ValueError's text, or ""), "dropout" (LoRA's dropout, default 0).

The adapters start random (init_lora_weights=False: B is not zero, so A and B both get gradients from step 1), the
optimizer is AdamW with weight decay over every parameter (a frozen weight that got a gradient would move), and
the oracle is the same model and optimizer in one process on the same global batches. Result: the losses by
step, the worst relative error of the losses and of the adapter weights, the frozen tensors that changed and the
adapter tensors that did not, the parameters holding optimizer state, and the export's logit difference.
"""
import json
import sys

import torch
import torch.distributed as dist

import trainyard.engine as te
from trainyard.engine.components.process_exit import exit_now

sys.path.insert(0, __file__.rpartition("/")[0])
import families  # noqa: E402  (this folder is not a package on torchrun's path)

# the global batch (ROWS sequences) is the same on every layout: a resume on fewer ranks continues the same curve
SEED, LR, CLIP, MICRO, ROWS = 5, 1e-3, 1.0, 2, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(case: dict, seed: int = SEED):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(families.config(case["family"], tie=case["tie"]))


def build(case: dict, seed: int = SEED):
    from peft import LoraConfig, get_peft_model

    base = base_model(case, seed)
    torch.manual_seed(seed + 1)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=case.get("dropout", 0.0),
                                           target_modules=TARGETS, init_lora_weights=False))


def batch(step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, families.VOCAB, (rows, families.SEQ + 1), generator=g)


def probe() -> torch.Tensor:
    return batch(99, 2)[:, :-1]


def optimizer(model):
    # fused: one DTensor op a step (foreach propagates the sharding of ~12; the CPU default, every op of every shard)
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-5, weight_decay=0.1, fused=True)


def train_sharded(case: dict):
    if case.get("base") and dist.get_rank() == 0 and not case.get("resume"):
        base_model(case).save_pretrained(case["base"])  # the weights the adapters are trained over
    model = build(case, SEED + 7 if case.get("resume") else SEED)
    model = te.transform(model, distribution=families.LAYOUTS[case["layout"]], seed=SEED)
    rows = ROWS
    opt = optimizer(model)
    start = 0
    if case.get("resume"):
        te.load_pretrained(model, case["base"])
        start = te.load_checkpoint(model, opt, uri=case["uri"])
    before = {n: t.clone() for n, t in te.full_state_dict(model).items()}  # plain tensors come back as they are
    losses = {}
    pipelined = getattr(model, "_trainyard_layout").dims.pp > 1
    for step in range(start + 1, case["steps"] + 1):
        mine = te.rows(model, batch(step, rows))
        x, y = mine[:, :-1], mine[:, 1:]
        if pipelined:
            losses[step] = te.forward_backward(model, x, y, te.lm_loss, microbatches=MICRO)
        else:
            total = torch.zeros(())
            for i, (xi, yi) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
                with te.accumulate(model, i, MICRO):
                    part = te.lm_loss(model(xi), yi) / MICRO
                    part.backward()
                total += part.detach()
            losses[step] = te.global_loss(model, total)
        te.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()
        if step == case.get("save_at"):
            te.save_checkpoint(model, opt, step, uri=case["uri"], trainable_only=True, blocking=True)
    names: list = [None] * dist.get_world_size()  # under a pipeline each rank holds its stage's
    dist.all_gather_object(names, [n for n, p in model.named_parameters() if p in opt.state])
    return model, rows, losses, before, sorted(set().union(*names)), pipelined


def train_oracle(case: dict, rows: int):
    model = build(case)
    opt = optimizer(model)
    losses = {}
    for step in range(1, case["steps"] + 1):
        data = batch(step, rows)
        loss = te.lm_loss(model(data[:, :-1]), data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
    return model, losses


def run_case(case: dict) -> dict:
    if case.get("refused"):  # a layout the engine refuses for a PEFT model: its message
        try:
            te.transform(build(case), distribution=families.LAYOUTS[case["layout"]], seed=SEED)
        except ValueError as e:
            return {"refused": str(e)}
        return {"refused": ""}
    model, rows, losses, before, stateful, pipelined = train_sharded(case)
    state = te.full_state_dict(model)
    if not pipelined:
        trained = model(probe()).logits.detach()
    elif dist.get_rank() == 0:  # no rank holds the whole model: the trained weights in one unsharded copy
        whole = build(case)
        whole.load_state_dict(state)
        trained = whole(probe()).logits.detach()
    if case.get("export"):
        te.save_model(model, case["export"])
    if case.get("merged"):
        te.save_model(model, case["merged"], merged=True)
    result: dict = {"losses": losses}
    if dist.get_rank() == 0:
        adapters = sorted(n for n in state if ".lora_" in n)
        result["frozen_changed"] = sorted(n for n in state if n not in adapters and not torch.equal(state[n], before[n]))
        result["adapters_unchanged"] = sorted(n for n in adapters if torch.equal(state[n], before[n]))
        result["adapters"] = len(adapters)
        result["stateful"] = stateful
        if not case.get("resume"):
            oracle, want = train_oracle(case, rows)
            result["loss_err"] = max(abs(losses[s] - want[s]) / abs(want[s]) for s in want)
            expected = dict(oracle.named_parameters())
            errors = {n: ((state[n].float() - expected[n].detach()).norm() / expected[n].detach().norm()).item()
                      for n in adapters}
            result["worst"], result["weight_err"] = max(errors.items(), key=lambda kv: kv[1])
        if case.get("export"):
            from peft import PeftModel

            loaded = PeftModel.from_pretrained(base_model(case), case["export"])
            result["export_err"] = (loaded(probe()).logits - trained).abs().max().item()
        if case.get("merged"):
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(case["merged"])
            result["merged_err"] = (loaded(probe()).logits - trained).abs().max().item()
    dist.barrier()
    return result


def main() -> None:
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    te.init()
    results = {case["name"]: run_case(case) for case in cases}
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    te.finish()


if __name__ == "__main__":
    main()
    exit_now(0)
