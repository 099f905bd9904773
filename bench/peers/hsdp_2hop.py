"""HSDP with 2-hop gradient sync on plain torch: bench/mics.py's strongest peer, written as a torchtitan user would.

A SageMaker-style entry point (hyperparameters arrive as `--key value`) that runs under torchrun on several
hosts (`distribution={"torch_distributed": {"enabled": True}}`). Everything parallel is torch's own:

- a gloo process group and the 2-D mesh `(dp_replicate, dp_shard)` = (hosts, ranks per host) from
  `init_device_mesh`; ranks are numbered host by host, so every shard group lies inside one host and the
  replicate groups cross hosts;
- FSDP2 as torchtitan's `apply_fsdp` applies it: `fully_shard` on every transformer block (all but the last
  resharded after forward), then on the root; fp32, no mixed precision;
- gradient accumulation with the 2-hop sync: every micro-batch reduce-scatters inside the shard group, and
  only the last one all-reduces across replicas (`set_requires_all_reduce`);
- gradient clipping at 1.0 and AdamW.

The one import from trainyard is the model definition (`MODEL_CONFIGS`, `build_model`, `init_weights`): both
sides of the comparison then train the identical network (same shapes, same parameter order and sizes,
same initial values), so the step times compare the parallelism, not two models. The data is random tokens.

Rank 0 prints one line per step, e.g. `step=3 step_time_s=1.234 loss=5.67 model_state_bytes=123456`: the
step's wall time, the mean loss over all ranks, and the bytes this rank holds for its parameter shards,
gradient shards and optimizer states.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model, init_weights

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="10m")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--global_batch_size", type=int, default=16)
parser.add_argument("--micro_batch_size", type=int, default=1)
parser.add_argument("--seq_len", type=int, default=128)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Storage bytes of this rank's parameter shards, gradient shards and optimizer states (each storage once)."""
    seen: set[int] = set()

    def size(t: torch.Tensor | None) -> int:
        if t is None or t.dim() == 0:  # AdamW's step counters are scalars
            return 0
        storage = local(t).untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(size(p) for p in params) + sum(size(p.grad) for p in params) + sum(size(v) for v in states)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    mesh = init_device_mesh("cpu", (world // per_host, per_host), mesh_dim_names=("dp_replicate", "dp_shard"))

    cfg = MODEL_CONFIGS[args.model]
    model = build_model(cfg)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # the last block is used again at once by backward: keep it gathered (torchtitan's apply_fsdp)
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh)
    init_weights(model, args.seed, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    rows_per_rank = args.global_batch_size // world
    micro = rows_per_rank // args.micro_batch_size
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(args.seed + step)
        batch = torch.randint(0, cfg.vocab_size, (args.global_batch_size, args.seq_len + 1), generator=gen)
        mine = batch[rank * rows_per_rank:(rank + 1) * rows_per_rank]
        loss_sum = torch.zeros(())
        for i, rows in enumerate(mine.split(args.micro_batch_size)):
            model.set_requires_all_reduce(i == micro - 1)  # 2-hop: cross-replica all-reduce on the last only
            logits = model(rows[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1)) / micro
            loss.backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        held = state_bytes(model, optimizer)  # with the gradients still held: the peak
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        elapsed = time.perf_counter() - t0
        if rank == 0:
            print(f"step={step} step_time_s={elapsed:.4f} loss={loss_sum.item() / world:.4f} "
                  f"model_state_bytes={held}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
