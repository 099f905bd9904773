"""Run a few optimizer steps of the built-in model under each layout given, and print, per layout, what this rank
holds (model-state bytes after the step, gradients still held) and the peak bytes torch allocated during a step
(the states held before the second step + the least `cpu_peak_bytes` of the next 3 steps, of the
next step alone in one process). Launched as one plain process, or as the processes of one emulated host
(tests/engine/launch.py, argv[2] the file for its rows); rank 0 prints one JSON line per layout (the maximum over
the ranks)."""
from __future__ import annotations

import gc
import json
import sys

import torch
import torch.distributed as dist

import trainyard.engine as te
from trainyard.engine.components.meter import cpu_peak_bytes, model_state_bytes
from trainyard.engine.components.optim import build_optimizer
from trainyard.engine.models.llama.model import ModelConfig, build_model

SHAPE = dict(vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=768, max_seq_len=128)


def run(distribution: dict, micro_batch_size: int, seq_len: int) -> dict:
    ctx = te.current()
    precision = distribution.get("mixed_precision") or "fp32"
    model = te.transform(build_model(ModelConfig(**SHAPE)), distribution=distribution, mixed_precision=precision)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0)
    dims = te.api._layout(model).dims  # this model's layout (the context's mesh is the plain one of init())
    micro = distribution.get("gradient_accumulation_steps") or 1
    rows = torch.randint(0, SHAPE["vocab_size"], (micro_batch_size * micro * dims.dp, seq_len + 1),
                         generator=torch.Generator().manual_seed(0))
    mine = rows.chunk(dims.dp)[dims.coords(ctx.rank)["dp"]]

    def step():
        te.forward_backward(model, mine[:, :-1], mine[:, 1:], te.lm_loss, microbatches=micro)
        opt.step()

    step()  # the optimizer's states exist from here on
    opt.zero_grad(set_to_none=True)
    gc.collect()  # the previous layout's model and optimizer go now, not inside the measured step
    held = model_state_bytes(model, opt)["model_state_bytes"]  # parameters and optimizer states, no gradients
    # the least of 3 steps under several processes: where the collectives run on threads of their own, a loaded
    # machine's timing can keep a gathered layer alive past its free (a full run once measured MiCS + full AC's peak
    # 10% above a quiet one's); one process has no such thread, and one step is its peak
    peaks = []
    for _ in range(3 if ctx.world_size > 1 else 1):
        opt.zero_grad(set_to_none=True)  # each step as the first: its gradients allocated within it
        peaks.append(cpu_peak_bytes(step))
    peak = held + min(peaks)
    states = model_state_bytes(model, opt)
    out = torch.tensor([states["param_bytes"], states["grad_bytes"], states["optim_bytes"],
                        states["model_state_bytes"], peak], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    keys = ("param_bytes", "grad_bytes", "optim_bytes", "model_state_bytes", "peak_bytes")
    return dict(zip(keys, (int(v) for v in out.tolist())))


def main() -> None:
    cases = json.loads(sys.argv[1])
    te.init({"tensor_parallel_degree": 1})
    results = {}
    for case in cases:
        result = run(case["distribution"], case["micro_batch_size"], case["seq_len"])
        if te.current().rank == 0:
            results[case["name"]] = {"name": case["name"], **result}
            print("RESULT " + json.dumps(results[case["name"]]), flush=True)
    if len(sys.argv) > 2 and te.current().rank == 0:  # launched by tests/engine/launch.py: the rows to its file
        with open(sys.argv[2], "w") as fh:
            json.dump(results, fh)
    te.finish()


if __name__ == "__main__":
    main()
