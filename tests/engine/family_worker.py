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
from torch.distributed.tensor import DTensor

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
    # fused where it can: one DTensor op a step, where foreach propagates the sharding of ~12 and the CPU default
    # loops over every op of every shard (the matrix's run: 128 -> 91 s of CPU); not over a mix of DTensors and
    # plain tensors, as TP alone leaves the parameters outside the family's plan
    params = list(params)
    fused = len({isinstance(p, DTensor) for p in params}) == 1
    return torch.optim.AdamW(params, lr=LR, eps=1e-5, weight_decay=0.1, fused=fused or None)


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


def train_oracle(case: dict, rows: int) -> tuple[dict[str, torch.Tensor], list[float], dict[str, float]]:
    """The unsharded run: its final weights by name (tied ones once, as `named_parameters` gives them), its
    losses, and each parameter's largest share of the total gradient norm."""
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
    return {n: p.detach() for n, p in model.named_parameters()}, losses, share


def oracle_key(case: dict, rows: int) -> tuple:
    """What the oracle of a case depends on: cases of one family, build, tying and batch share it."""
    return case["family"], case["build"], case["tie"], rows


def train_part(case: dict) -> dict:
    """The engine's run of a case (every rank): its refusal, or its batch rows and, on rank 0, its losses, full
    weights and (with `export`) the logits of the exported model."""
    try:
        model, rows, losses = train_sharded(case)
    except ValueError as e:  # a refusal: every rank raises it before anything is trained
        return {"refused": str(e)}
    state = te.full_state_dict(model)
    exported = None
    if case.get("export"):
        te.save_model(model, case["export"])
        exported = model(probe()).logits.detach()
    if dist.get_rank() != 0:
        return {"rows": rows}
    return {"rows": rows, "losses": losses, "state": state, "exported": exported}


def compare(case: dict, part: dict, oracle) -> dict:
    """Rank 0: the worst relative errors of the engine's run of `case` against its oracle."""
    expected, want, share = oracle
    result: dict = {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(part["losses"], want))}
    result["excluded"] = sorted(n for n in expected if share.get(n, 0.0) <= ZERO_GRAD)
    state = part["state"]
    errors = {n: ((state[n].float() - p).norm() / p.norm().clamp_min(1e-30)).item()
              for n, p in expected.items() if n not in result["excluded"]}
    result["worst"], result["weight_err"] = max(errors.items(), key=lambda kv: kv[1])
    result["compared"] = len(errors)
    if part["exported"] is not None:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(case["export"])
        result["export_err"] = (loaded(probe()).logits - part["exported"]).abs().max().item()
    return result


_ORACLES: dict[tuple, tuple] = {}


def run_case(case: dict) -> dict:
    """One case, engine and oracle, in this process (one process, as the test calls it); the oracles of
    cases that share one are trained once."""
    part = train_part(case)
    if "refused" in part:
        return part
    key = oracle_key(case, part["rows"])
    if key not in _ORACLES:
        _ORACLES[key] = train_oracle(case, part["rows"])
    return compare(case, part, _ORACLES[key])


def main() -> None:
    """Every case's engine run on all ranks, then the distinct oracles their results need, spread over the ranks
    (each a single process, where rank 0 alone once trained them while the others waited), gathered on rank 0."""
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    te.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = {case["name"]: train_part(case) for case in cases}
    keys = sorted({oracle_key(c, parts[c["name"]]["rows"]) for c in cases if "refused" not in parts[c["name"]]})
    mine = {key: train_oracle(dict(zip(("family", "build", "tie"), key)), key[3])
            for i, key in enumerate(keys) if i % world == rank}
    gathered: list = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        oracles = {k: v for part in gathered for k, v in part.items()}
        results = {c["name"]: parts[c["name"]] if "refused" in parts[c["name"]]
                   else compare(c, parts[c["name"]], oracles[oracle_key(c, parts[c["name"]]["rows"])])
                   for c in cases}
        with open(out, "w") as fh:
            json.dump(results, fh)
    te.finish()


if __name__ == "__main__":
    main()
    exit_now(0)  # without the interpreter's teardown of torch (~1 s of CPU per rank; engine/components/process_exit.py)
