"""Worker for the tensor/sequence/pipeline-parallel equivalence tests (2 emulated hosts, torchrun agents).

For every layout in argv[1] (JSON list) it trains with `parallelize` for STEPS optimizer steps and compares
every parameter this rank holds, gathered to full size, with an unsharded single-process oracle trained on
the same global batches. Rank 0 writes {layout name: worst relative error over all ranks} to argv[2];
layouts with "meter" write every rank's communication and memory figures instead.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainyard.engine.components.data import SyntheticSource, rank_rows
from trainyard.engine.components.meter import CommMeter, model_state_bytes
from trainyard.engine.distributed.mics import MiCSConfig
from trainyard.engine.models.llama.model import ModelConfig, build_model, init_weights
from trainyard.parallel.dims import ParallelDims
from trainyard.engine.distributed.parallelize import clip_grad_norm, forward_backward, parallelize
from trainyard.engine.distributed.pipeline import PipelineConfig
from trainyard.engine.models.llama.spec import spec_for
from trainyard.engine.trainer import token_loss
from trainyard.engine.components.process_exit import exit_now

STEPS = 2
CFG = ModelConfig(vocab_size=128, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=128, max_seq_len=64)
SEQ, SEED, LR, CLIP = 16, 5, 1e-3, 0.05  # CLIP well below the gradient norm: clipping is active


def optimizer(params):
    # eps large enough that near-zero gradients do not turn summation-order noise into whole updates
    # fused: one DTensor op a step (foreach propagates the sharding of ~12; the CPU default, every op of every shard)
    return torch.optim.AdamW(params, lr=LR, eps=1e-5, weight_decay=0.1, fused=True)


def oracle(global_batch: int) -> dict[str, torch.Tensor]:
    model = build_model(CFG)
    init_weights(model, SEED, device="cpu")
    opt = optimizer(model.parameters())
    data = SyntheticSource(seed=SEED, global_batch_size=global_batch, seq_len=SEQ, vocab_size=CFG.vocab_size)
    for step in range(1, STEPS + 1):
        rows = data.global_batch(step)
        token_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def build(case: dict, pph: int):
    world = dist.get_world_size()
    tp, pp = case.get("tp", 1), case.get("pp", 1)
    dp = world // (tp * pp)
    p = case.get("dp_shard", dp)
    dims = ParallelDims(dp_replicate=dp // p, dp_shard=p, tp=tp, pp=pp, world_size=world, processes_per_host=pph)
    dims.build_mesh("cpu")
    m = case["microbatches"]
    pipeline = PipelineConfig(schedule=case.get("schedule", "1f1b"), virtual_stages=case.get("v", 1),
                              microbatches=m) if pp > 1 else None
    model = build_model(CFG)
    par = parallelize(model, spec_for(model), dims, seed=SEED, device=torch.device("cpu"), ac=case.get("ac", "none"),
                      mics=MiCSConfig(), pipeline=pipeline)
    data = SyntheticSource(seed=SEED, global_batch_size=dp * m, seq_len=SEQ, vocab_size=CFG.vocab_size)
    return dims, par, data


def step_rows(par, rows, microbatches: int):
    return forward_backward(par, rows[:, :-1], rows[:, 1:], microbatches, token_loss)


def run(case: dict, pph: int) -> float:
    dims, par, data = build(case, pph)
    opt = optimizer(par.model.parameters())
    dp_rank = dims.coords(dist.get_rank())["dp"]
    for step in range(1, STEPS + 1):
        step_rows(par, rank_rows(data.global_batch(step), dp_rank, dims.dp), case["microbatches"])
        clip_grad_norm(par.model, par.dims, CLIP)
        opt.step()
        opt.zero_grad()
    got = get_model_state_dict(par.model, options=StateDictOptions(full_state_dict=True))
    want = oracle(dims.dp * case["microbatches"])
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in got)
    return worst


def measure(case: dict, pph: int) -> dict:
    """The second step of `case` under the comm meter (the first infers the pipeline's shapes): this rank's
    totals, and over all ranks the summed model-state bytes and the model's sizes."""
    dims, par, data = build(case, pph)
    opt = optimizer(par.model.parameters())
    dp_rank = dims.coords(dist.get_rank())["dp"]
    meter = CommMeter(pph, dims)
    for step in (1, 2):
        meter.reset()
        with meter.active():
            step_rows(par, rank_rows(data.global_batch(step), dp_rank, dims.dp), case["microbatches"])
        opt.step()
    state = torch.tensor([model_state_bytes(par.model, opt)["model_state_bytes"]], dtype=torch.float64)
    dist.all_reduce(state)
    full = build_model(CFG)
    norms = sum(p.numel() for n, p in full.named_parameters() if n.endswith("norm.weight"))
    return {**meter.totals(), "rank": dist.get_rank(), "coords": dims.coords(dist.get_rank()),
            "model_state_bytes_all_ranks": state.item(), "params": sum(p.numel() for p in full.parameters()),
            "norm_params": norms}


def _full_state(par, opt) -> dict[str, torch.Tensor]:
    """Every tensor of this rank's model and optimizer state at full size, by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    state = {f"model.{k}": v for k, v in get_model_state_dict(par.model, options=options).items()}
    optim = get_optimizer_state_dict(par.model, opt, options=options)
    state.update({f"optim.{k}": v for k, v in optim.items() if isinstance(v, torch.Tensor)})
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def reshard(case: dict, pph: int) -> dict:
    """Train layout `source` for STEPS, checkpoint it, then load it into every layout of `targets`:
    the worst absolute difference of any model or optimizer tensor from the source's, per target."""
    from trainyard.engine.components import checkpoint as ckpt

    def setup(layout):
        dims, par, data = build(layout, pph)
        opt = optimizer(par.model.parameters())
        return dims, par, data, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)

    dims, par, data, opt, sched = setup(case["source"])
    dp_rank = dims.coords(dist.get_rank())["dp"]
    for step in range(1, STEPS + 1):
        step_rows(par, rank_rows(data.global_batch(step), dp_rank, dims.dp), case["source"]["microbatches"])
        clip_grad_norm(par.model, par.dims, CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
    ckpt.save_checkpoint(case["dir"], STEPS, par.model, opt, sched)
    reference = _full_state(par, opt)
    if dist.get_rank() == 0:
        torch.save(reference, f"{case['dir']}/reference.pt")
    out = {}
    for target in case["targets"]:
        _, par, _, opt, sched = setup(target)
        ckpt.load_checkpoint(case["dir"], STEPS, par.model, opt, sched)
        got = _full_state(par, opt)
        missing = [k for k in got if k not in reference]
        worst = max((got[k] - reference[k]).abs().max().item() for k in got if k in reference)
        result = torch.tensor([worst if not missing else float("inf"), len(got)], dtype=torch.float64)
        dist.all_reduce(result[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(result[1:], op=dist.ReduceOp.SUM)
        out[target["name"]] = {"worst_abs_diff": result[0].item(), "tensors_checked": int(result[1].item())}
    return out


def main() -> None:
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    pph = int(os.environ["LOCAL_WORLD_SIZE"])
    results: dict = {}
    for case in cases:
        if case.get("targets"):
            results[case["name"]] = reshard(case, pph)
            continue
        if case.get("meter"):
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, measure(case, pph))
            results[case["name"]] = every
            continue
        worst = torch.tensor([run(case, pph)], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results[case["name"]] = worst.item()
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # without the interpreter's teardown of torch (~1 s of CPU per rank; engine/components/process_exit.py)
