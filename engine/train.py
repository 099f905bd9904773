"""The built-in trainer: `[torchrun ...] python -m trainyard.engine.train --steps 20 --model tiny ...`.

Order of work: process group and mesh -> model on the meta device -> FSDP2 -> weights initialised
(layout-independent) -> AdamW + schedule -> resume from the newest committed checkpoint -> loop
(micro-batches with gradient sync on the last one, clip, step, checkpoint, metrics) -> full weights
to $SM_MODEL_DIR.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from trainyard.engine import checkpoint as ckpt
from trainyard.engine.ac import apply_ac
from trainyard.engine.config import (TrainConfig, checkpoint_uri_from_contract, model_dir, output_data_dir,
                                     parse_hyperparameters, reconcile_distribution)
from trainyard.engine.data import build_source, micro_batches, rank_rows
from trainyard.engine.distributed import Dist, destroy_distributed, init_distributed
from trainyard.engine.meter import CommMeter, model_state_bytes
from trainyard.engine.mics import MiCSConfig, apply_mics, sync_microbatch, uses_hierarchy
from trainyard.engine.model import MODEL_CONFIGS, Transformer, build_model, count_parameters, init_weights
from trainyard.engine.optim import build_optimizer, build_scheduler
from trainyard.engine.parallel import dims_from_distribution

METRICS_FILE = "metrics.jsonl"


def _log(d: Dist, message: str) -> None:
    if d.is_main:
        print(message, flush=True)


def _compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def _broadcast_int(value: int | None, d: Dist) -> int | None:
    """Rank 0's value on every rank (-1 encodes None), so all ranks agree on what to resume."""
    t = torch.tensor([-1 if value is None else value], dtype=torch.int64, device=d.device)
    dist.broadcast(t, src=0)
    return None if t.item() < 0 else int(t.item())


def train_step(model: Transformer, micro: list[torch.Tensor], optimizer, scheduler, cfg: TrainConfig,
               d: Dist, memory: dict, two_hop: bool = True) -> tuple[float, float, float]:
    """One optimizer step; returns (global-batch mean loss, lr used, pre-clip gradient norm) and fills
    `memory` with this rank's model-state bytes."""
    accum = len(micro)
    local_loss = torch.zeros((), device=d.device)
    for i, rows in enumerate(micro):
        # 2-hop: reduce-scatter inside the partition group every micro-batch, all-reduce across the
        # replicas on the last one only (flat HSDP, two_hop False: both every micro-batch).
        sync_microbatch(model, i, accum, two_hop=two_hop)
        rows = rows.to(d.device, non_blocking=True)
        logits = model(rows[:, :-1])
        # Mean over this micro-batch's tokens / accum: summed over micro-batches and averaged over
        # ranks by FSDP's reduction, the gradient is that of the global-batch mean loss.
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten()) / accum
        loss.backward()
        local_loss += loss.detach()
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    memory.update(model_state_bytes(model, optimizer))  # with the gradients still held: the peak
    optimizer.zero_grad(set_to_none=True)
    # SUM then divide: never rely on a backend's AVG (gloo once summed silently, pytorch#162338).
    dist.all_reduce(local_loss, op=dist.ReduceOp.SUM)
    return local_loss.item() / d.world_size, float(lr), float(norm.item())


def export_model(model: Transformer, cfg: TrainConfig, step: int, d: Dist) -> None:
    """Full CPU weights to $SM_MODEL_DIR/model.pt and the configuration to config.json (a collective)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not d.is_main:
        return
    out = model_dir()
    os.makedirs(out, exist_ok=True)
    torch.save(state, os.path.join(out, "model.pt"))
    info = {"model": cfg.model, "model_config": MODEL_CONFIGS[cfg.model].to_dict(), "hyperparameters": cfg.to_dict(),
            "step": step, "world_size": d.world_size}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(f"model written to {out}", flush=True)


def run(cfg: TrainConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE") or 1)
    cfg.accumulation(world)  # fail on a batch that does not split before joining the group
    d = init_distributed()
    try:
        _train(cfg, d)
    finally:
        destroy_distributed()


def _train(cfg: TrainConfig, d: Dist) -> None:
    torch.manual_seed(cfg.seed)
    distribution = json.loads(os.environ.get("TRAINYARD_DISTRIBUTION") or "{}")
    reconcile_distribution(cfg, distribution, d.world_size)
    accum = cfg.accumulation(d.world_size)
    mcfg = MODEL_CONFIGS[cfg.model]
    dtype = _compute_dtype(cfg, d.device)
    source = build_source(cfg.dataset, seed=cfg.seed, global_batch_size=cfg.global_batch_size, seq_len=cfg.seq_len,
                          vocab_size=mcfg.vocab_size, token_dtype=cfg.token_dtype)

    ac = distribution.get("activation_checkpointing") or "none"
    dims = dims_from_distribution(distribution, world_size=d.world_size, processes_per_host=d.processes_per_host)
    dims.build_mesh(d.device.type)
    mics = distribution.get("mics") or {}
    mics_config = MiCSConfig(
        param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32,
        hierarchical=mics.get("hierarchical_allgather"), reshard_after_forward=mics.get("reshard_after_forward", True))
    model = build_model(mcfg)
    apply_ac(model, ac)
    apply_mics(model, dims, mics_config)
    init_weights(model, cfg.seed, device=d.device)
    optimizer = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = build_scheduler(optimizer, warmup_steps=cfg.warmup_steps, total_steps=cfg.schedule_steps,
                                min_lr_ratio=cfg.min_lr_ratio)
    _log(d, f"model {cfg.model} ({count_parameters(model) / 1e6:.2f}M parameters), world {d.world_size} on "
            f"{d.device.type}/{d.backend}, dtype {str(dtype).removeprefix('torch.')}, "
            f"{accum} micro-batch(es) of {cfg.micro_batch_size} per rank, data {cfg.dataset}; partition groups "
            f"of {dims.dp_shard} x {dims.dp_replicate} replica(s), activation checkpointing {ac}"
            f"{', hierarchical over ' + str(dims.shard_hosts) + ' hosts' if uses_hierarchy(dims, mics_config) else ''}")

    uri = cfg.checkpoint_uri or checkpoint_uri_from_contract()
    start = 0
    if uri:
        ckpt.validate_uri(uri)  # on every rank: a bad location fails everywhere, nobody waits
        latest = _broadcast_int(ckpt.latest_committed_step(uri) if d.is_main else None, d)
        if latest is not None:
            start = ckpt.load_checkpoint(uri, latest, model, optimizer, scheduler)
            _log(d, f"resumed from step {start} at {uri}")
            if start >= cfg.steps:
                _log(d, f"checkpoint step {start} >= steps {cfg.steps}: nothing to train")

    metrics_path = os.path.join(output_data_dir(), METRICS_FILE)
    metrics = None
    if d.is_main:
        os.makedirs(output_data_dir(), exist_ok=True)
        metrics = open(metrics_path, "a")
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    meter = CommMeter(dims.processes_per_host)
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            rows = rank_rows(source.global_batch(step), d.rank, d.world_size)
            meter.reset()
            memory: dict = {}
            with meter.active():
                loss, lr, grad_norm = train_step(model, micro_batches(rows, cfg.micro_batch_size), optimizer,
                                                 scheduler, cfg, d, memory, mics.get("two_hop_sync", True))
            tokens_per_s = tokens_per_step / (time.perf_counter() - t0)
            if metrics is not None:
                comm = meter.totals()
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                          "inter_node_bytes": comm["inter_bytes"], "intra_node_bytes": comm["intra_bytes"],
                          "comm": comm["by_kind"], **memory}
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if step % cfg.log_every == 0 or step == cfg.steps:
                _log(d, f"step {step}/{cfg.steps} loss {loss:.4f} lr {lr:.1e} grad_norm {grad_norm:.3f} "
                        f"tok/s {tokens_per_s:.0f}")
            if uri and (step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
                target = ckpt.save_checkpoint(uri, step, model, optimizer, scheduler, keep_last=cfg.keep_last)
                _log(d, f"checkpoint step {step} saved to {target}")
    finally:
        if metrics is not None:
            metrics.close()
    if cfg.save_model:
        export_model(model, cfg, max(start, cfg.steps), d)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_hyperparameters(sys.argv[1:] if argv is None else argv)
        cfg.accumulation(int(os.environ.get("WORLD_SIZE") or 1))
    except ValueError as e:
        print(f"trainyard.engine.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
