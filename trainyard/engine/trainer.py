"""The built-in trainer, a client of the engine's public API (`api.py`) like any user script.

`Trainer(cfg, parallelism)` takes the configuration and the layout `train.load_config` read (hyperparameters
reconciled with the job's distribution) and builds: context and mesh (`init`) -> the model on the meta device (the
built-in Transformer of MODEL_CONFIGS, or the Hugging Face causal LM of a model channel) -> `transform` (pipeline
stages, TP, AC, MiCS, weights) -> pretrained weights if the channel has them -> AdamW + schedule -> the data source
(token files, text tokenized with the model's tokenizer, or synthetic) -> resume from the newest verified step.
`run()` loops (micro-batches through `forward_backward`, clip, step, metrics, checkpoints), stops cleanly on
SIGTERM (`stop()`), and exports the model at the end (`export()`). Each step's row goes through `log_metrics`
(metrics.jsonl, and TensorBoard when the job asked for it); `mark_step` and `log_metrics` bound the steps the
job's profiler records.
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import time

import torch
from torch import nn

from trainyard.engine import api
from trainyard.engine.components import checkpoint as ckpt
from trainyard.engine.components import flops, heartbeat
from trainyard.engine.components.contract import checkpoint_uri_from_contract, mark_first_step, model_dir
from trainyard.engine.components.data import build_source, channel_dir
from trainyard.engine.components.fingerprint import fingerprint
from trainyard.engine.components.meter import CommMeter, model_state_bytes
from trainyard.engine.components.optim import build_optimizer, build_scheduler
from trainyard.engine.components.sdc import SdcCheck, inject_from_env
from trainyard.engine.components.sft import IGNORE, SftSource, sft_loss
from trainyard.engine.components.stragglers import Detector, StragglerWatch, removal
from trainyard.engine.components.termination import Termination
from trainyard.engine.config import TrainConfig
from trainyard.engine.distributed.mics import MiCSConfig, uses_hierarchy
from trainyard.engine.models.llama.moe import balance, router_stats
from trainyard.engine.models import float8
from trainyard.engine.models.hf import adapters
from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model, count_parameters
from trainyard.parallel.parallelism import Parallelism


def token_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens, from logits, an HF output or the fused loss's hidden states
    (api.lm_loss); with vocab-sharded DTensor logits (under the built-in model's loss context) the full
    logits are never gathered."""
    return api.lm_loss(output, targets)


def build_hf(channel: str) -> tuple[nn.Module, str]:
    """The HF causal LM of a model channel, on the meta device, and the channel's folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = channel_dir(channel)
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise ValueError(f"model hf: channel {channel!r} ({folder}) has no config.json; pass a Hugging Face model "
                         "directory (config.json, optional *.safetensors, tokenizer.json) as that channel")
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), folder


def _number(x: float) -> str:
    """A loss scale (a power of two) in full when it is a whole number."""
    return f"{x:.0f}" if x >= 1 and float(x).is_integer() else f"{x:g}"


# float16: a loss scale below this means even unscaled gradients overflow: the run diverged, and the loop stops
# (as DeepSpeed's fp16 optimizer does at its minimum scale) rather than skip every step to a "Completed" job
MIN_LOSS_SCALE = 1.0
# what a Hugging Face model folder holds besides its weights and config.json that a user loads it with: the
# tokenizer (any of its forms), its chat template and the generation defaults; the export carries them along
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


def copy_tokenizer(src: str, dst: str) -> list[str]:
    """The model folder `src`'s tokenizer and generation files (TOKENIZER_FILES) into `dst`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied


def _has_weights(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


class Trainer:
    def __init__(self, cfg: TrainConfig, parallelism: Parallelism | None = None) -> None:
        """`parallelism`: the job's layout as `train.load_config` parsed it (None: `api.init` reads the job's)."""
        self.cfg = cfg
        self.ctx = api.init(parallelism)
        par = self.ctx.parallelism
        self.accum = cfg.accumulation(par.data_parallel_degree(self.ctx.world_size))
        torch.manual_seed(cfg.seed)
        if cfg.dtype == "float8":  # before any model work: an FP8-capable GPU and torchao
            float8.require_float8(self.ctx.device, "dtype")
        self.dtype = self._compute_dtype()
        hf_dir = self.hf_dir = None
        if cfg.model == "hf":
            model, hf_dir = build_hf(cfg.model_channel)
            self.hf_dir = hf_dir
            vocab = model.config.vocab_size
            if cfg.lora_r:  # the adapters over the frozen model (counted and shaped below as the whole model)
                model = adapters.wrap(model, r=cfg.lora_r, alpha=cfg.lora_alpha, targets=cfg.lora_targets,
                                      dropout=cfg.lora_dropout)
        else:
            model, vocab = build_model(MODEL_CONFIGS[cfg.model]), MODEL_CONFIGS[cfg.model].vocab_size
        self.params = count_parameters(model)
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        shape = flops.shape_of(model)  # before transform: the whole model's shapes
        self.flops_per_token = shape.flops_per_token(cfg.seq_len) if shape else flops.model_flops_per_token(
            matmul_params=self.params, layers=0, heads=0, head_dim=0, seq_len=cfg.seq_len)  # 6 N, no attention term
        precision = "float8" if cfg.dtype == "float8" else None if self.dtype == torch.float32 else self.dtype
        self.model = api.transform(model, mixed_precision=precision, seed=cfg.seed, kernels=cfg.kernels,
                                   compile=cfg.compile)
        self.layout = api._layout(self.model)
        self.scaler = api.scaler(self.model)  # float16: dynamic loss scaling; otherwise a pass-through
        if hf_dir and _has_weights(hf_dir):
            report = api.load_pretrained(self.model, hf_dir)
            self.log(f"weights from {hf_dir}: {report['tensors']} tensors")
        tokenizer = hf_dir if hf_dir and os.path.exists(os.path.join(hf_dir, "tokenizer.json")) else None
        if cfg.task == "sft":
            self.source = self._sft_source(hf_dir)
        else:
            self.source = build_source(cfg.dataset, seed=cfg.seed, global_batch_size=cfg.global_batch_size,
                                       seq_len=cfg.seq_len, vocab_size=vocab, token_dtype=cfg.token_dtype,
                                       tokenizer_path=tokenizer)
        self.optimizer = build_optimizer(self.model, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, warmup_steps=cfg.warmup_steps,
                                         total_steps=cfg.schedule_steps, min_lr_ratio=cfg.min_lr_ratio)
        self.uri = cfg.checkpoint_uri or checkpoint_uri_from_contract()
        self.step = 0
        self.saved_step = 0
        self.peak_tflops, peak_source = flops.peak(self.ctx.device, self.dtype)  # a collective where measured
        self.fingerprint = {**fingerprint(self.ctx.device, world_size=self.ctx.world_size,
                                          processes_per_host=self.ctx.processes_per_host),
                            "dtype": self.dtype_name, "peak_tflops_per_device": self.peak_tflops,
                            "peak_source": peak_source, "model_flops_per_token": self.flops_per_token,
                            "flops_formula": "6 N + 12 L H Q T" if shape else "6 N (layers and heads unknown)"}
        self.stragglers = self._straggler_watch()
        self.sdc = self._sdc_check()
        self.log(self.describe())
        self.log(f"peak {self.peak_tflops:.3g} TFLOP/s per device ({peak_source}); model {self.flops_per_token:.4g} "
                 "FLOPs per token")

    def _sft_source(self, hf_dir: str) -> SftSource:
        """The chat examples of the dataset channel, rendered with the model channel's tokenizer and chat template."""
        from transformers import AutoTokenizer

        cfg = self.cfg  # a pipeline or context parallelism was refused with the config (reconcile_distribution)
        if cfg.dataset == "synthetic":
            raise ValueError("task sft: dataset is synthetic; name the input channel of your .jsonl chat examples "
                             "(dataset=train)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        except (OSError, ValueError) as e:
            raise ValueError(f"task sft: the model channel {hf_dir} has no tokenizer the chat examples can be "
                             f"rendered with ({e}); add tokenizer.json and tokenizer_config.json") from None
        source = SftSource(channel_dir(cfg.dataset), tokenizer, seed=cfg.seed, global_batch_size=cfg.global_batch_size,
                           seq_len=cfg.seq_len, packing=cfg.packing)
        self.log(f"task sft: {source.describe()}, {'packed' if cfg.packing else 'one a row, padded'}")
        return source

    def _hosts(self) -> list[str]:
        """Each rank's host, from the job's `SM_HOSTS` (rank // processes per host)."""
        dims = self.layout.dims
        try:
            names = json.loads(os.environ.get("SM_HOSTS") or "[]")
        except ValueError:
            names = []
        return [names[r // dims.processes_per_host] if r // dims.processes_per_host < len(names)
                else f"host {r // dims.processes_per_host}" for r in range(dims.world_size)]

    def _straggler_watch(self) -> StragglerWatch | None:
        """Every rank's watch (None with one rank, or straggler_check_every 0); each rank's stage from the layout."""
        cfg, dims = self.cfg, self.layout.dims
        if not cfg.straggler_check_every or dims.world_size < 2:
            return None
        if dims.pp > 1:  # a stage waits for its neighbour in point-to-point calls the meter does not time
            self.log("straggler check: off under pipeline parallelism: a stage's waits for the next are not told "
                     "apart from its compute yet, so a healthy neighbour of a slow rank would be named")
            return None
        stages = [dims.coords(r)["pp"] for r in range(dims.world_size)]
        detector = Detector(stages=stages, hosts=self._hosts(), ratio=cfg.straggler_ratio, steps=cfg.straggler_steps)
        return StragglerWatch(detector, every=cfg.straggler_check_every, device=self.ctx.device)

    def _sdc_check(self) -> SdcCheck | None:
        """The replicas' comparison (None with one rank, or sdc_check_every 0); said once when the layout keeps a
        single copy of each shard."""
        cfg, dims = self.cfg, self.layout.dims
        if not cfg.sdc_check_every or dims.world_size < 2:
            return None
        check = SdcCheck(dims.replicate_groups(), self._hosts(), self.ctx.device)
        if not check.can_check:
            self.log("data corruption check: off, the layout keeps one copy of each shard (one MiCS partition group "
                     "over every data-parallel rank): no replica to compare with; a partition_group_size below the "
                     "data-parallel degree keeps replicas")
            return None
        return check

    def log(self, message: str) -> None:
        if self.ctx.is_main:
            print(message, flush=True)

    def _compute_dtype(self) -> torch.dtype:
        """The dtype of the computation outside FP8 matmuls (and of the peak MFU is measured against: float8's
        MFU is against the bf16 peak, as torchtitan reports it)."""
        if self.cfg.dtype == "auto":
            return torch.bfloat16 if self.ctx.device.type == "cuda" else torch.float32
        if self.cfg.dtype == "float8":
            return torch.bfloat16
        return getattr(torch, self.cfg.dtype)

    @property
    def dtype_name(self) -> str:
        return "float8" if self.cfg.dtype == "float8" else str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        cfg, dims, par = self.cfg, self.layout.dims, self.ctx.parallelism
        pipe = f" ({par.pipeline_schedule}, {par.virtual_stages} stage(s) per rank)" if dims.pp > 1 else ""
        layout = f"tp {dims.tp} x pp {dims.pp}{pipe} x " if dims.tp * dims.pp > 1 else ""
        layout += f"cp {dims.cp} (zig-zag ring attention) x " if dims.cp > 1 else ""
        moe = MODEL_CONFIGS.get(cfg.model)
        if moe is not None and moe.n_experts:  # a mixture of experts: how it routes, where its experts are
            routing = [f"top {moe.top_k}"] + ([f"{moe.n_shared_experts} shared"] if moe.n_shared_experts else []) \
                + ["dropless" if moe.capacity_factor is None else f"capacity {moe.capacity_factor}"]
            spread = f", spread over ep {dims.ep} ({moe.n_experts // dims.ep} per rank)" if dims.ep > 1 else ""
            layout += f"{moe.n_experts} experts ({', '.join(routing)}){spread}; "
        mics = MiCSConfig(hierarchical=par.hierarchical_allgather)
        hier = f", hierarchical over {dims.shard_hosts} hosts" if uses_hierarchy(dims, mics) else ""
        if cfg.lora_r:  # what trains: the adapters alone
            layout += (f"LoRA r {cfg.lora_r} (alpha {cfg.lora_alpha:g}) on {cfg.lora_targets}: "
                       f"{self.trainable / 1e6:.3f}M parameters train, the rest frozen"
                       f"{', exported merged' if cfg.lora_merge else ''}; ")
        return (f"model {cfg.model} ({self.params / 1e6:.2f}M parameters), world {self.ctx.world_size} on "
                f"{self.ctx.device.type}/{self.ctx.backend}, dtype {self.dtype_name}, "
                f"{self.accum} micro-batch(es) of {cfg.micro_batch_size} per rank, data {cfg.dataset}; {layout}"
                f"partition groups of {dims.dp_shard}{f' x cp {dims.cp}' if dims.cp > 1 else ''} x {dims.dp_replicate} replica(s), activation checkpointing "
                f"{par.activation_checkpointing}{hier}")

    def resume(self) -> int:
        if not self.uri:
            return 0
        ckpt.validate_uri(self.uri)  # on every rank: a bad location fails everywhere, nobody waits
        start = api.load_checkpoint(self.model, self.optimizer, uri=self.uri, scheduler=self.scheduler)
        if start:
            self.log(f"resumed from step {start} at {self.uri}")
            if start >= self.cfg.steps:
                self.log(f"checkpoint step {start} >= steps {self.cfg.steps}: nothing to train")
        self.step = self.saved_step = start
        return start

    def sft_step(self, step: int) -> tuple[float, float, int]:
        """Forward and backward of step `step`'s chat rows (task sft): every assistant token of the global batch
        weighs 1 / their count, whatever its row, micro-batch and rank. Returns (the global loss, the data wait, the
        global batch's tokens of examples)."""
        t0 = time.perf_counter()
        batch = self.source.global_batch(step)
        count = int((batch[:, 1] != IGNORE).sum())
        rows = self.ctx.rows(batch).to(self.ctx.device, non_blocking=True)
        data_wait = time.perf_counter() - t0
        # the gradients are averaged over the data-parallel ranks: times dp, the sum over all ranks / count
        scale = self.layout.dims.dp / max(count, 1)
        total = torch.zeros((), device=self.ctx.device)
        for i, part in enumerate(rows.chunk(self.accum)):
            with api.accumulate(self.model, i, self.accum):
                out = self.model(input_ids=part[:, 0], position_ids=part[:, 2], use_cache=False)
                loss = sft_loss(out.logits, part[:, 1], scale)
                self.scaler.scale(loss).backward()
            total += loss.detach()
        return api.global_loss(self.model, total), data_wait, self.source.tokens(step)

    def train_step(self, step: int) -> dict:
        """One optimizer step; returns its metrics (loss, lr, grad_norm, the wait for its data and this rank's
        model-state bytes; under float16 the step's loss_scale and whether it was skipped). A skipped step (inf/nan
        gradients on some rank) leaves weights, optimizer and LR schedule as they were: the schedule follows the
        updates applied, as Megatron-LM's does."""
        t0 = time.perf_counter()
        api.mark_step(step)
        heartbeat.set_phase("data")
        tokens = None
        if self.cfg.task == "sft":
            loss, data_wait, tokens = self.sft_step(step)
        else:
            rows = self.ctx.rows(self.source.global_batch(step)).to(self.ctx.device, non_blocking=True)
            data_wait = time.perf_counter() - t0
            loss = api.forward_backward(self.model, rows[:, :-1], rows[:, 1:], token_loss, microbatches=self.accum)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
        norm = api.clip_grad_norm_(self.model, max_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        scale = self.scaler.get_scale()
        stepped = api.optimizer_step(self.model, self.optimizer)  # fp16: skipped when a gradient is inf/nan
        if stepped:
            self.scheduler.step()
            balance(self.model)  # a mixture of experts' auxiliary-loss-free balancing (when its rate is set)
        router = router_stats(self.model) or {}  # a mixture of experts: its routing in the step
        memory = model_state_bytes(self.model, self.optimizer)  # with the gradients still held: the peak
        self.optimizer.zero_grad(set_to_none=True)
        scaling = {"loss_scale": scale, "skipped": not stepped} if self.scaler.enabled else {}
        sft = {"example_tokens": tokens} if tokens is not None else {}  # the tokens of examples, padding not counted
        return {"loss": loss, "lr": float(lr), "grad_norm": norm, "data_wait_s": data_wait, **scaling, **memory,
                **router, **sft}

    def checkpoint(self, step: int, *, blocking: bool) -> float:
        """Save step `step`; returns the seconds the loop was held."""
        t0 = time.perf_counter()
        adapters_only = bool(self.cfg.lora_r)  # the frozen model is the model channel's: not saved again
        if blocking:
            api.save_checkpoint(self.model, self.optimizer, step, uri=self.uri, scheduler=self.scheduler,
                                blocking=True, keep_last=self.cfg.keep_last, trainable_only=adapters_only)
            self.log(f"checkpoint step {step} saved to {ckpt.step_uri(self.uri, step)}")
        else:  # the loop waits for staging to host memory only
            blocked = api.save_checkpoint(self.model, self.optimizer, step, uri=self.uri, scheduler=self.scheduler,
                                          keep_last=self.cfg.keep_last, trainable_only=adapters_only)
            self.log(f"checkpoint step {step}: staged in {blocked:.3f} s, uploading in the background")
        self.saved_step = step
        return time.perf_counter() - t0

    def run(self) -> bool:
        """Train from the resumed step to cfg.steps; returns False when SIGTERM stopped it."""
        cfg = self.cfg
        start = self.resume()
        tokens_per_step = cfg.global_batch_size * cfg.seq_len
        meter = CommMeter(self.layout.dims.processes_per_host, self.layout.dims)
        termination = Termination(cfg.termination_deadline_s)
        cuda = self.ctx.device.type == "cuda"
        first = True
        try:
            for step in range(start + 1, cfg.steps + 1):
                if cuda:
                    torch.cuda.reset_peak_memory_stats(self.ctx.device)
                t0 = time.perf_counter()
                meter.reset()
                with meter.active():
                    record = self.train_step(step)
                self.step = step
                if step == start + 1:
                    mark_first_step()  # the driver times this host's first step by it
                elapsed = time.perf_counter() - t0
                comm = meter.totals()
                # the step's time: the communication it waited for, and the rest (compute, copies, Python)
                compute = elapsed - comm["intra_s"] - comm["inter_s"]
                ranks_compute, named = self.stragglers.record(step, compute) if self.stragglers else ({}, [])
                for s in named:
                    self.log(f"WARNING: straggler: {s}")
                tokens_per_s = record.get("example_tokens", tokens_per_step) / elapsed
                tflops = self.flops_per_token * tokens_per_s / self.ctx.world_size / 1e12
                diverged = None
                if record.get("skipped"):  # always said: the step changed nothing but the loss scale
                    lost = "" if math.isfinite(record["loss"]) else "; the loss itself is not finite"
                    self.log(f"step {step}/{cfg.steps} skipped: inf/nan gradients at loss scale "
                             f"{_number(record['loss_scale'])}, now {_number(self.scaler.get_scale())} (loss "
                             f"{record['loss']:.4f}{lost})")
                    if self.scaler.get_scale() < MIN_LOSS_SCALE:  # the same on every rank: raised after the row
                        diverged = RuntimeError(
                            f"dtype float16: the loss scale fell below {MIN_LOSS_SCALE:g} at step {step} "
                            f"({self.scaler.skipped_steps} step(s) skipped in all, loss {record['loss']:.4f}{lost}): "
                            "the gradients overflow unscaled, so the run diverged; lower lr (or raise warmup_steps), "
                            "or use dtype bfloat16 or float32")
                elif step % cfg.log_every == 0 or step == cfg.steps:
                    scale = f" scale {_number(record['loss_scale'])}" if "loss_scale" in record else ""
                    if "expert_imbalance" in record:  # the busiest expert's load over the mean
                        scale += f" experts {record['expert_imbalance']:.2f}x"
                    slow = self.stragglers.detector.slow() if self.stragglers else []
                    if slow:  # named and still slow
                        scale += " slow: " + ", ".join(f"rank {r} ({self.stragglers.detector.hosts[r]})" for r in slow)
                    self.log(f"step {step}/{cfg.steps} loss {record['loss']:.4f} lr {record['lr']:.1e} grad_norm "
                             f"{record['grad_norm']:.3f}{scale} tok/s {tokens_per_s:.0f} mfu {tflops / self.peak_tflops:.3f}")
                saving = self.uri and (step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0))
                inject_from_env(self.model, self.ctx.rank, step)  # a test hook: off unless its variable is set
                # before any save and the end's export: no damaged state is saved
                if self.sdc is not None and (saving or step == cfg.steps or step % cfg.sdc_check_every == 0):
                    t1 = time.perf_counter()
                    self.sdc.check(self.model, step)
                    record["sdc_check_s"] = time.perf_counter() - t1
                blocked, warnings = 0.0, [f"straggler: {s}" for s in named]
                # a save due while the last upload is still in flight on some rank is skipped on every rank: the loop
                # never waits on a slow or unreachable store (the last step's save waits, as the job ends with it)
                if saving and cfg.checkpoint_async and step != cfg.steps and api.checkpoint_busy(self.uri):
                    warnings.append(f"checkpoint step {step} skipped: step {self.saved_step}'s upload is still in "
                                    "flight (the store is slow or unreachable)")
                    self.log(f"WARNING: {warnings[-1]}")
                elif saving:  # the last step's save blocks: the job ends with it, and its figures are in its row
                    blocked = self.checkpoint(step, blocking=not cfg.checkpoint_async or step == cfg.steps)
                row = {**record, "tokens_per_s": tokens_per_s, "step_time_s": elapsed,
                       "tflops_per_device": tflops, "mfu": tflops / self.peak_tflops,
                       "compute_s": compute, "comm_intra_s": comm["intra_s"],
                       "comm_inter_s": comm["inter_s"],
                       # this step's save, and its optimizer step's wait for the last save's background copy
                       "checkpoint_blocked_s": blocked + api.checkpoint_held(),
                       "cpu_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                       "inter_node_bytes": comm["inter_bytes"], "intra_node_bytes": comm["intra_bytes"],
                       "comm": comm["by_kind"], "comm_by_dim": comm["by_dim"]}
                if ranks_compute:  # every rank's compute of the steps compared now (the report plots them)
                    row["rank_compute_s"] = {str(s): v for s, v in ranks_compute.items()}
                if warnings:
                    row["warnings"] = warnings
                io = api.checkpoint_io(self.uri) if self.uri else []
                if io:  # each save's and load's bytes and GB/s per rank, once finished on every rank
                    row["checkpoint_io"] = io
                if cuda:
                    row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
                if first:
                    row["fingerprint"] = self.fingerprint
                    if self.layout.kernels:  # each op's implementation (kernels=auto: measured under compile)
                        row["kernels"] = self.layout.kernels
                    first = False
                api.log_metrics(step, row)  # every rank: rank 0 writes it; a profiled run may end here
                if diverged is not None:
                    raise diverged
                if cfg.straggler_remove and saving and self.saved_step == step and self.stragglers:
                    self.remove_stragglers(step)
                if termination.requested(self.ctx.device):
                    self.stop(termination)
                    return False
        finally:
            api.wait_for_checkpoints()  # whatever happened, the save in flight completes (or reports) before exit
            termination.restore()
        return True

    def remove_stragglers(self, step: int) -> None:
        """straggler_remove: with ranks named and still slow, once `step`'s checkpoint is committed on every rank,
        end the attempt (StragglerRemoval on every rank): the job's attempt policy goes on without their hosts."""
        end = removal(self.stragglers.detector, step)
        if end is None:
            return
        committed = torch.tensor([1.0 if api.wait_for_checkpoints() else 0.0], device=self.ctx.device)
        torch.distributed.all_reduce(committed, op=torch.distributed.ReduceOp.MIN)  # every rank decides the same
        if not committed.item():
            self.log(f"WARNING: {end}; not now: step {step}'s checkpoint did not commit")
            return
        self.log(f"WARNING: {end}")
        raise end

    def stop(self, termination: Termination) -> None:
        """SIGTERM reached a rank: finish the save in flight, then checkpoint the step just completed if it is
        not saved and the deadline allows (a save cut short is never committed: nothing half-written loads)."""
        step = self.step
        self.log(f"SIGTERM: stopping after step {step}")
        committed = api.wait_for_checkpoints()
        if not self.uri or (self.saved_step == step and committed):
            self.log(f"SIGTERM: {'no checkpoint location' if not self.uri else f'step {step} is already checkpointed'}")
            return
        if termination.time_left() <= 0:
            self.log(f"SIGTERM: no emergency checkpoint, the {self.cfg.termination_deadline_s:g} s deadline has passed")
            return
        t0 = time.perf_counter()
        self.checkpoint(step, blocking=True)
        self.log(f"SIGTERM: emergency checkpoint step {step} saved to {ckpt.step_uri(self.uri, step)} in "
                 f"{time.perf_counter() - t0:.1f} s")

    def export(self) -> None:
        """The full weights to $SM_MODEL_DIR (a collective): an HF model as from_pretrained loads it; the built-in
        model as model.pt (a state dict) and config.json."""
        out = model_dir()
        if self.cfg.model == "hf":
            api.save_model(self.model, out, merged=self.cfg.lora_merge)  # with LoRA, the adapter folder unless merged
            if self.ctx.is_main:
                copied = copy_tokenizer(self.hf_dir, out)
                if copied:
                    self.log(f"with the model channel's {', '.join(copied)}")
            self.log(f"model written to {out}")
            return
        state = api.full_state_dict(self.model)
        if not self.ctx.is_main:
            return
        os.makedirs(out, exist_ok=True)
        torch.save(state, os.path.join(out, "model.pt"))
        info = {"model": self.cfg.model, "model_config": MODEL_CONFIGS[self.cfg.model].to_dict(),
                "hyperparameters": self.cfg.to_dict(), "step": max(self.step, self.cfg.steps),
                "world_size": self.ctx.world_size}
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(info, f, indent=2)
        print(f"model written to {out}", flush=True)
