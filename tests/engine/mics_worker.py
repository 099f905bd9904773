"""Worker for the MiCS equivalence tests, run on 2 emulated hosts x 2 processes (two torchrun agents).

For every configuration in argv[1] (JSON list), it trains the model with MiCS for STEPS optimizer steps
and compares every parameter, gathered, with an unsharded single-process oracle that trained on the same
global batches. Rank 0 writes {config name: worst relative error} to argv[2], plus whether the hierarchical collectives
are bit-identical to the flat ones.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainyard.engine.distributed.ac import apply_ac
from trainyard.engine.components.data import SyntheticSource, micro_batches, rank_rows
from trainyard.engine.distributed.mics import (HierarchicalAllGather, HierarchicalReduceScatter, MiCSConfig, apply_mics,
                                               replica_sync, sync_microbatch)
from trainyard.engine.components.meter import CommMeter, model_state_bytes
from trainyard.engine.models.llama.model import ModelConfig, build_model, init_weights
from trainyard.parallel.dims import ParallelDims
from trainyard.engine.components.process_exit import exit_now

STEPS = 3
CFG = ModelConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
SEQ, SEED, LR, CLIP = 16, 5, 1e-3, 0.05  # CLIP well below the gradient norm: clipping is active


def optimizer(model):
    # eps large enough that near-zero gradients do not turn summation-order noise into whole updates
    # fused: one DTensor op a step (foreach propagates the sharding of ~12; the CPU default, every op of every shard)
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-5, weight_decay=0.1, fused=True)


def oracle(global_batch: int) -> dict[str, torch.Tensor]:
    model = build_model(CFG)
    init_weights(model, SEED, device="cpu")
    opt = optimizer(model)
    data = SyntheticSource(seed=SEED, global_batch_size=global_batch, seq_len=SEQ, vocab_size=CFG.vocab_size)
    for step in range(1, STEPS + 1):
        rows = data.global_batch(step)
        logits = model(rows[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def config(case: dict) -> MiCSConfig:
    native = case.get("replica_sync") == "native" or not case.get("two_hop", True)
    return MiCSConfig(hierarchical=case["hierarchical"], cpu_offload=case.get("cpu_offload", False),
                      reshard_after_forward=case.get("reshard_after_forward", True),
                      replica_sync="native" if native else "bucketed", replica_bucket_mb=case.get("bucket_mb", 0.01),
                      replica_compression=case.get("compression"), hierarchical_chunks=case.get("chunks", 3))


def build(case: dict, pph: int):
    """The case's model sharded (and its replica sync, if any) on a fresh mesh."""
    dims = ParallelDims(dp_replicate=case["dp_replicate"], dp_shard=case["dp_shard"], world_size=dist.get_world_size(),
                        processes_per_host=pph)
    dims.build_mesh("cpu")
    model = build_model(CFG)
    blocks = list(model.layers.values())
    apply_ac(blocks, case.get("ac", "none"))
    apply_mics(model, blocks, dims, config(case))
    init_weights(model, SEED, device="cpu")
    return model, replica_sync(model, blocks, dims, config(case))


def run(case: dict, pph: int, steps: int = STEPS, losses: list | None = None) -> dict[str, torch.Tensor]:
    """Train `steps` steps. A "plain" case is a user's own loop: no sync_microbatch, no finish() (the replica
    sync completes in autograd's final callback)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, sync = build(case, pph)
    opt = optimizer(model)
    accum = case["accum"]
    data = SyntheticSource(seed=SEED, global_batch_size=world * accum, seq_len=SEQ, vocab_size=CFG.vocab_size)
    for step in range(1, steps + 1):
        micro = micro_batches(rank_rows(data.global_batch(step), rank, world), 1)
        total = torch.zeros(())
        for i, rows in enumerate(micro):
            if not case.get("plain"):
                sync_microbatch(model, i, accum, two_hop=case.get("two_hop", True), sync=sync)
            logits = model(rows[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()) / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        if losses is not None:
            dist.all_reduce(total)
            losses.append(total.item() / world)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def compare_syncs(pph: int) -> dict:
    """Bucketed (many buckets, overlapped) against FSDP2's native HSDP sync: bit-identical parameters after
    STEPS steps of 2 replicas x 2 with accumulation 3. And the loss curves of 50 steps, exact and compressed."""
    case = dict(dp_replicate=2, dp_shard=2, hierarchical=None, accum=3)
    native = run({**case, "replica_sync": "native"}, pph)
    bucketed = run(case, pph)
    out = {"bucketed_identical_to_native": all(torch.equal(native[k], bucketed[k]) for k in native)}
    curves = {}
    for name, compression in (("exact", None), ("bf16", "bf16"), ("int8", "int8")):
        curves[name] = []
        run({**case, "accum": 1, "compression": compression}, pph, steps=50, losses=curves[name])
    out["loss_curves"] = curves
    return out


def check_collectives(pph: int) -> dict[str, bool]:
    """Hierarchical all-gather and reduce-scatter against the flat ones over a group spanning both hosts:
    bit-identical (the reduce-scatter on integer-valued data, whose sums are exact in any order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(dp_replicate=1, dp_shard=world, world_size=world, processes_per_host=pph)
    mesh = dims.build_mesh("cpu")
    group = mesh.get_group("dp_shard")
    args = (mesh.get_group("dp_shard_intra"), mesh.get_group("dp_shard_inter"), dims.shard_hosts, dims.shard_per_host)
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn(1000, generator=g)
    flat, hier, piped = torch.empty(world * 1000), torch.empty(world * 1000), torch.empty(world * 1000)
    dist.all_gather_single(flat, shard, group=group)
    HierarchicalAllGather(*args)(hier, shard, group)
    HierarchicalAllGather(*args, 3)(piped, shard, group)  # 3 pieces of 334, 334, 332
    full = torch.randint(-1000, 1000, (world * 1000,), generator=g).float()
    out_flat, out_hier = torch.empty(1000), torch.empty(1000)
    dist.reduce_scatter_single(out_flat, full, group=group)
    HierarchicalReduceScatter(*args)(out_hier, full, group, dist.ReduceOp.SUM)
    return {"all_gather_identical": torch.equal(flat, hier) and torch.equal(flat, piped),
            "reduce_scatter_identical": torch.equal(out_flat, out_hier)}


def check_host_norm(pph: int) -> bool:
    """parallelize.sharded_squared_norm (the gradient norm from the local shards, summed over the mesh dimensions
    that shard them; CPU-offloaded ones too) equals the norm of the full tensors: on a 2-D (replicate, shard) mesh,
    a 1-D one, and a 2-D one sharding one dim twice (TP x MiCS's `_StridedShard`, which is no `Shard` in torch
    2.13: counted as replicated, the norm once missed the other shards)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from trainyard.engine.distributed.parallelize import sharded_squared_norm
    world = dist.get_world_size()
    dims = ParallelDims(dp_replicate=2, dp_shard=world // 2, world_size=world, processes_per_host=pph)
    dims.build_mesh("cpu")
    g = torch.Generator().manual_seed(7)  # every rank the same full tensors
    full = [torch.randn(12, 5, generator=g), torch.randn(9, generator=g)]  # 9: uneven shards
    even = [full[0], torch.randn(8, generator=g)]  # distribute_tensor takes only even strided shards
    ok = True
    for mesh, placements, tensors in ((dims.dp_mesh(), [Replicate(), Shard(0)], full),
                                      (dims.mesh["dp_shard"], [Shard(0)], full),
                                      (dims.dp_mesh(), [_StridedShard(0, split_factor=2), Shard(0)], even)):
        want = sum(t.pow(2).sum() for t in tensors)
        got = sharded_squared_norm([distribute_tensor(t, mesh, placements) for t in tensors])
        ok = ok and abs(got.item() - want.item()) <= 1e-5 * want.item()
    return ok


def measure(case: dict, pph: int) -> dict:
    """One optimizer step of `case` under the comm meter; the totals, model-state bytes and model sizes."""
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = build_model(CFG)
    blocks_bytes = sum(p.numel() * 4 for p in reference.layers.parameters())
    total_bytes = sum(p.numel() * 4 for p in reference.parameters())
    model, sync = build(case, pph)
    opt = optimizer(model)
    accum = case["accum"]
    data = SyntheticSource(seed=SEED, global_batch_size=world * accum, seq_len=SEQ, vocab_size=CFG.vocab_size)
    meter = CommMeter(pph)
    with meter.active():
        for i, rows in enumerate(micro_batches(rank_rows(data.global_batch(1), rank, world), 1)):
            sync_microbatch(model, i, accum, two_hop=True, sync=sync)
            (F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten()) / accum).backward()
    opt.step()
    return {**meter.totals(), **model_state_bytes(model, opt), "blocks_bytes": blocks_bytes,
            "total_bytes": total_bytes}


def main() -> None:
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    pph = int(os.environ["LOCAL_WORLD_SIZE"])
    errors: dict = check_collectives(pph)
    errors["host_norm_equal"] = check_host_norm(pph)
    oracles: dict[int, dict] = {}
    for case in cases:
        if case.get("compare_syncs"):
            result = compare_syncs(pph)
            if dist.get_rank() == 0:
                errors.update(result)
            continue
        if case.get("meter"):
            result = measure(case, pph)
            if dist.get_rank() == 0:
                errors[case["name"]] = result
            continue
        got = run(case, pph)
        if dist.get_rank() == 0:
            gb = dist.get_world_size() * case["accum"]
            want = oracles.setdefault(gb, oracle(gb))
            errors[case["name"]] = max(((got[k] - w).norm() / w.norm()).item() for k, w in want.items())
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(errors, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # without the interpreter's teardown of torch (~1 s of CPU per rank; engine/components/process_exit.py)
