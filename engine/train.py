"""The built-in trainer: `[torchrun ...] python -m trainyard.engine.train --steps 20 --model tiny ...`.

Order of work: process group and mesh -> this rank's part of the model, parallelised (`parallelize`:
pipeline stages, tensor/sequence parallelism, activation checkpointing, MiCS, layout-independent
weights) -> AdamW + schedule -> resume from the newest committed checkpoint -> loop (micro-batches
through the pipeline schedule or with 2-hop gradient sync, clip over every dimension, step, checkpoint,
metrics) -> full weights to $SM_MODEL_DIR.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainyard.engine.components import checkpoint as ckpt
from trainyard.engine.config import (TrainConfig, checkpoint_uri_from_contract, model_dir, output_data_dir,
                                     parse_hyperparameters, reconcile_distribution)
from trainyard.engine.components.data import build_source, rank_rows
from trainyard.engine.distributed.process import Dist, destroy_distributed, init_distributed
from trainyard.engine.components.meter import CommMeter, model_state_bytes
from trainyard.engine.distributed.mics import MiCSConfig, uses_hierarchy
from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model, count_parameters
from trainyard.engine.components.optim import build_optimizer, build_scheduler
from trainyard.engine.distributed.dims import dims_from_distribution
from trainyard.engine.distributed.parallelize import Parallelized, clip_grad_norm, forward_backward, loss_value, parallelize
from trainyard.engine.distributed.pipeline import PipelineConfig
from trainyard.engine.components.termination import Termination

METRICS_FILE = "metrics.jsonl"


def _log(d: Dist, message: str) -> None:
    if d.is_main:
        print(message, flush=True)


def _compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def train_step(par: Parallelized, rows: torch.Tensor, accum: int, optimizer, scheduler, cfg: TrainConfig,
               memory: dict) -> tuple[float, float, float]:
    """One optimizer step on this rank's `rows` in `accum` micro-batches; returns (global-batch mean loss,
    lr used, pre-clip gradient norm) and fills `memory` with this rank's model-state bytes."""
    total = forward_backward(par, rows, accum)
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
    norm = clip_grad_norm(par, max_norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    memory.update(model_state_bytes(par.model, optimizer))  # with the gradients still held: the peak
    optimizer.zero_grad(set_to_none=True)
    return loss_value(total, par.dims), float(lr), norm


def export_model(par: Parallelized, cfg: TrainConfig, step: int, d: Dist) -> None:
    """Full CPU weights to $SM_MODEL_DIR/model.pt and the configuration to config.json (a collective)."""
    if par.dims.pp == 1:
        state = get_model_state_dict(par.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        # each stage gathers its own weights; the first rank of every stage sends them to rank 0
        state = get_model_state_dict(par.model, options=StateDictOptions(full_state_dict=True))
        state = {k: v.cpu() for k, v in state.items()}
        coords = par.dims.coords(d.rank)
        leader = all(coords[k] == 0 for k in ("dp", "tp"))
        parts: list = [None] * d.world_size
        dist.all_gather_object(parts, state if leader else None)
        state = {k: v for part in parts if part for k, v in part.items()}
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
    # fail on a batch or layout that does not fit before joining the group
    reconcile_distribution(cfg, _distribution(), int(os.environ.get("WORLD_SIZE") or 1))
    d = init_distributed()
    try:
        _train(cfg, d)
    finally:
        destroy_distributed()


def _distribution() -> dict:
    return json.loads(os.environ.get("TRAINYARD_DISTRIBUTION") or "{}")


def _train(cfg: TrainConfig, d: Dist) -> None:
    torch.manual_seed(cfg.seed)
    distribution = _distribution()
    accum = reconcile_distribution(cfg, distribution, d.world_size)
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
    pipeline = None
    if dims.pp > 1:
        pipeline = PipelineConfig(schedule=distribution.get("pipeline_schedule") or "1f1b",
                                  virtual_stages=distribution.get("virtual_stages") or 1, microbatches=accum,
                                  split=distribution.get("pipeline_split"))
    par = parallelize(mcfg, dims, seed=cfg.seed, device=d.device, ac=ac, mics=mics_config, pipeline=pipeline,
                      seq_len=cfg.seq_len, two_hop=mics.get("two_hop_sync", True))
    model = par.model
    optimizer = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = build_scheduler(optimizer, warmup_steps=cfg.warmup_steps, total_steps=cfg.schedule_steps,
                                min_lr_ratio=cfg.min_lr_ratio)
    layout = (f"tp {dims.tp} x pp {dims.pp}" + (f" ({pipeline.schedule}, {pipeline.virtual_stages} stage(s) per rank)"
                                                 if pipeline else "") + " x ") if dims.tp * dims.pp > 1 else ""
    _log(d, f"model {cfg.model} ({count_parameters(build_model(mcfg)) / 1e6:.2f}M parameters), world "
            f"{d.world_size} on {d.device.type}/{d.backend}, dtype {str(dtype).removeprefix('torch.')}, "
            f"{accum} micro-batch(es) of {cfg.micro_batch_size} per rank, data {cfg.dataset}; {layout}partition "
            f"groups of {dims.dp_shard} x {dims.dp_replicate} replica(s), activation checkpointing {ac}"
            f"{', hierarchical over ' + str(dims.shard_hosts) + ' hosts' if uses_hierarchy(dims, mics_config) else ''}")

    uri = cfg.checkpoint_uri or checkpoint_uri_from_contract()
    start = 0
    if uri:
        ckpt.validate_uri(uri)  # on every rank: a bad location fails everywhere, nobody waits
        resumed = ckpt.resume(uri, model, optimizer, scheduler, warn=lambda m: _log(d, m))
        if resumed is not None:
            start = resumed
            _log(d, f"resumed from step {start} at {uri}")
            if start >= cfg.steps:
                _log(d, f"checkpoint step {start} >= steps {cfg.steps}: nothing to train")

    metrics_path = os.path.join(output_data_dir(), METRICS_FILE)
    metrics = None
    if d.is_main:
        os.makedirs(output_data_dir(), exist_ok=True)
        metrics = open(metrics_path, "a")
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    meter = CommMeter(dims.processes_per_host, dims)
    dp_rank = dims.coords(d.rank)["dp"]
    # the async saver makes a process group of its own: only when it is used
    saver = ckpt.AsyncSaver(uri, keep_last=cfg.keep_last, say=lambda m: _log(d, m)) \
        if uri and cfg.checkpoint_async else None
    termination = Termination(cfg.termination_deadline_s)
    saved_step, stopped = start, False
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            rows = rank_rows(source.global_batch(step), dp_rank, dims.dp).to(d.device, non_blocking=True)
            meter.reset()
            memory: dict = {}
            with meter.active():
                loss, lr, grad_norm = train_step(par, rows, accum, optimizer, scheduler, cfg, memory)
            tokens_per_s = tokens_per_step / (time.perf_counter() - t0)
            if metrics is not None:
                comm = meter.totals()
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                          "inter_node_bytes": comm["inter_bytes"], "intra_node_bytes": comm["intra_bytes"],
                          "comm": comm["by_kind"], "comm_by_dim": comm["by_dim"], **memory}
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if step % cfg.log_every == 0 or step == cfg.steps:
                _log(d, f"step {step}/{cfg.steps} loss {loss:.4f} lr {lr:.1e} grad_norm {grad_norm:.3f} "
                        f"tok/s {tokens_per_s:.0f}")
            if uri and (step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
                if cfg.checkpoint_async:  # the loop waits for staging to host memory only
                    blocked = saver.save(step, model, optimizer, scheduler)
                    _log(d, f"checkpoint step {step}: staged in {blocked:.3f} s, uploading in the background")
                else:
                    target = ckpt.save_checkpoint(uri, step, model, optimizer, scheduler, keep_last=cfg.keep_last)
                    _log(d, f"checkpoint step {step} saved to {target}")
                saved_step = step
            if termination.requested(d.device):
                stopped = True
                _stop(d, uri, step, saved_step, saver, termination, model, optimizer, scheduler, cfg)
                break
    finally:
        if saver is not None:
            saver.wait()  # whatever happened, the save in flight completes (or reports) before exit
        termination.restore()
        if metrics is not None:
            metrics.close()
    if cfg.save_model and not stopped:
        export_model(par, cfg, max(start, cfg.steps), d)


def _stop(d: Dist, uri: str, step: int, saved_step: int, saver, termination: Termination, model, optimizer,
          scheduler, cfg: TrainConfig) -> None:
    """SIGTERM reached a rank: finish the save in flight, then checkpoint the step just completed if it is
    not saved and the deadline allows (a save cut short is never committed: nothing half-written loads)."""
    _log(d, f"SIGTERM: stopping after step {step}")
    committed = saver.wait() if saver is not None else True
    if not uri or (saved_step == step and committed):
        _log(d, f"SIGTERM: {'no checkpoint location' if not uri else f'step {step} is already checkpointed'}")
        return
    left = termination.time_left()
    if left <= 0:
        _log(d, f"SIGTERM: no emergency checkpoint, the {cfg.termination_deadline_s:g} s deadline has passed")
        return
    t0 = time.perf_counter()
    target = ckpt.save_checkpoint(uri, step, model, optimizer, scheduler, keep_last=cfg.keep_last)
    _log(d, f"SIGTERM: emergency checkpoint step {step} saved to {target} in {time.perf_counter() - t0:.1f} s")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_hyperparameters(sys.argv[1:] if argv is None else argv)
        reconcile_distribution(cfg, _distribution(), int(os.environ.get("WORLD_SIZE") or 1))
    except ValueError as e:
        print(f"trainyard.engine.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
