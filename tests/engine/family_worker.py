"""The family matrix's worker: a small model of a Hugging Face family trained through the engine's public API
on one layout, against one unsharded process (tests/engine/test_families.py).

Run under torchrun (argv[1] a JSON list of cases, argv[2] the output JSON) for the 2 hosts x 2 processes
layouts, or called in the test process (`run_case`) for "1 process". A case: family, layout (a key of
families.LAYOUTS, or "1 process"), build ("meta": built on the meta device, weights initialised by the engine;
"real": built with weights, rank 0's kept), tie (tie_word_embeddings), kernels (None or "eager"), export (a
folder: save_model there, then from_pretrained). Result: the refusal's text, or the worst relative error of the
step losses and of the final weights, the parameters left out of the weight comparison (their true gradient
is zero: a softmax does not depend on a key bias, so only float noise moves them, and AdamW turns that noise
into whole steps), and for an export the worst logit difference of `from_pretrained`.

The oracle starts from the weights the engine must start from: the same seed for a real build; for a meta
build, the model materialised on the CPU, tied by transformers' own `tie_weights()` and filled module by
module by `init_by_module` with the model's `_init_weights` (the layout-independent init the engine promises).
"""
import copy
import json
import sys

import torch
import torch.distributed as dist

import trainyard.engine as te
from trainyard.engine.components.process_exit import exit_now
from trainyard.engine.distributed.materialize import init_by_module

sys.path.insert(0, __file__.rpartition("/")[0])
import families  # noqa: E402  (this folder is not a package on torchrun's path)

STEPS, SEED, LR, CLIP, MICRO = 2, 5, 1e-3, 0.05, 2
# a parameter whose gradient never exceeds this fraction of the total gradient norm has a true gradient of zero
ZERO_GRAD = 1e-6


def build(case: dict):
    from transformers import AutoModelForCausalLM

    cfg = families.config(case["family"], tie=case["tie"])
    torch.manual_seed(SEED)
    if case["build"] == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    return AutoModelForCausalLM.from_config(cfg)


def oracle_start(case: dict):
    model = build(case)
    if case["build"] == "meta":
        template = model
        model = copy.deepcopy(template).to_empty(device="cpu")
        model.tie_weights()
        init_by_module(model, template, SEED, template._init_weights)
    return model


def batch(step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, families.VOCAB, (rows, families.SEQ + 1), generator=g)


def probe() -> torch.Tensor:
    return batch(99, 2)[:, :-1]


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=1e-5, weight_decay=0.1)


def train_sharded(case: dict):
    distribution = families.LAYOUTS.get(case["layout"], {})
    model = te.transform(build(case), distribution=distribution, seed=SEED, kernels=case.get("kernels"))
    layout = getattr(model, "_trainyard_layout")
    rows = layout.dims.dp * MICRO
    opt = optimizer(model.parameters())
    losses = []
    for step in range(1, STEPS + 1):
        mine = te.rows(model, batch(step, rows))
        x, y = mine[:, :-1], mine[:, 1:]
        if layout.dims.pp > 1:
            loss = te.forward_backward(model, x, y, te.lm_loss, microbatches=MICRO)
        else:  # a user's own loop; under context parallelism it takes its zig-zag chunks first
            x, y = te.sequence_shard(model, x, y)
            total = torch.zeros(())
            for i, (xi, yi) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
                with te.accumulate(model, i, MICRO):
                    part = te.lm_loss(model(xi), yi) / MICRO
                    part.backward()
                total += part.detach()
            loss = te.global_loss(model, total)
        te.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return model, rows, losses


def train_oracle(case: dict, rows: int):
    model = oracle_start(case)
    opt = optimizer(model.parameters())
    losses, share = [], {}
    for step in range(1, STEPS + 1):
        data = batch(step, rows)
        loss = te.lm_loss(model(data[:, :-1]), data[:, 1:])
        loss.backward()
        grads = {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}
        total = max(sum(g * g for g in grads.values()) ** 0.5, 1e-30)
        for n, g in grads.items():
            share[n] = max(share.get(n, 0.0), g / total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, share


def run_case(case: dict) -> dict:
    try:
        model, rows, losses = train_sharded(case)
    except ValueError as e:  # a refusal: every rank raises it before anything is trained
        return {"refused": str(e)}
    state = te.full_state_dict(model)
    exported = None
    if case.get("export"):
        te.save_model(model, case["export"])
        exported = model(probe()).logits.detach()
    result: dict = {}
    if dist.get_rank() == 0:
        oracle, want, share = train_oracle(case, rows)
        result["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        expected = dict(oracle.named_parameters())
        result["excluded"] = sorted(n for n in expected if share.get(n, 0.0) <= ZERO_GRAD)
        errors = {n: ((state[n].float() - p.detach()).norm() / p.detach().norm().clamp_min(1e-30)).item()
                  for n, p in expected.items() if n not in result["excluded"]}
        result["worst"], result["weight_err"] = max(errors.items(), key=lambda kv: kv[1])
        result["compared"] = len(errors)
        if exported is not None:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(case["export"])
            result["export_err"] = (loaded(probe()).logits - exported).abs().max().item()
    if dist.is_initialized() and dist.get_world_size() > 1:
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
    exit_now(0)  # without the interpreter's teardown of torch (~1 s of CPU per rank; engine/components/process_exit.py)
