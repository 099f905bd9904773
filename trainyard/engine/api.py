"""The engine as a library: shard any `nn.Module` or Hugging Face causal LM with MiCS, tensor and pipeline
parallelism, train it in the user's own loop, checkpoint it, export it.

    ctx = init()                                   # process group + mesh from the job's distribution
    model = transform(model)                       # TP -> AC -> MiCS per block -> root, weights kept or initialised
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    step = load_checkpoint(model, opt)             # newest verified committed step, resharded; 0 if none
    for step in range(step + 1, steps + 1):
        for i, mb in enumerate(micro_batches):     # this rank's rows: global_batch.chunk(ctx.dp_size)[ctx.dp_rank]
            with accumulate(model, i, n):
                (loss_fn(model, mb) / n).backward()
        norm = clip_grad_norm_(model, 1.0); opt.step(); opt.zero_grad()
        save_checkpoint(model, opt, step)          # async, committed by .metadata, verified on load
        log_metrics(step, {"grad_norm": norm})     # metrics.jsonl (job.metrics()) and TensorBoard, from rank 0
    save_model(model, os.environ["SM_MODEL_DIR"])  # HF models: loadable by from_pretrained

With pipeline parallelism a rank holds only some stages, so the loop runs micro-batches through the
schedule: `loss = forward_backward(model, inputs, targets, loss_fn, microbatches=n)` (which works for every
layout). The context `init()` builds is the process's one current context (like torch.distributed's
default group); every other call finds the model's layout on the model it returned.

What the job asked to record comes from its contract: `log_metrics` writes TensorBoard scalars when it has
`tensorboard_output_config` (components/tensorboard.py), and `mark_step` / `log_metrics` bound the steps its
profiler records (components/profiler.py).
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from trainyard.engine.components import checkpoint as ckpt
from trainyard.engine.components import heartbeat
from trainyard.engine.components.contract import (checkpoint_uri_from_contract, profiler_from_contract,
                                                 tensorboard_dir_from_contract)
from trainyard.engine.components.metrics_log import MetricsLog
from trainyard.engine.components.profiler import StepProfiler
from trainyard.engine.components.scaler import GradScaler
from trainyard.engine.components.tensorboard import require_tensorboard
from trainyard.engine.components.data import rank_rows
from trainyard.engine.distributed.context import shard_sequence
from trainyard.engine.distributed.experts import aux_weight
from trainyard.parallel.dims import ParallelDims
from trainyard.engine.distributed.mics import MiCSConfig
from trainyard.parallel.parallelism import Parallelism
from trainyard.engine.distributed.parallelize import (Parallelized, check_tp_gradients, clip_grad_norm, loss_value,
                                                      parallelize, plain, sync_for)
from trainyard.engine.distributed.parallelize import forward_backward as _forward_backward
from trainyard.engine.distributed.pipeline import PipelineConfig
from trainyard.engine.distributed.process import Dist, check_launched, destroy_distributed, init_distributed
from trainyard.engine.models import float8
from trainyard.engine.models.fused import (LMHidden, backend_of, lm_loss, describe_choices, plan_backends,
                                           record_choices, swap_kernels)
from trainyard.engine.quiet import quiet
from trainyard.engine.models.hf import adapters, weights as hf_weights
from trainyard.engine.models.registry import resolve_spec

_LAYOUT = "_trainyard_layout"  # the attribute of a transformed model that holds its Parallelized
# mixed_precision -> the compute dtype of MiCS's gathered parameters (None: fp32, not cast); float16 adds the loss
# scaler, float8 converts the Linear layers to torchao's Float8Linear and computes the rest in bf16
_PRECISIONS = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
               "fp8": torch.bfloat16, "float8": torch.bfloat16, "fp32": None, "float32": None, None: None}
_FLOAT8 = ("fp8", "float8")


@dataclass(kw_only=True)
class Context(Dist):
    """Where this process stands in the job (`Dist`: rank, world_size, local_rank, device, ...) and how the
    job lays out its model."""

    parallelism: Parallelism
    dims: ParallelDims
    coords: dict[str, int] = field(default_factory=dict)
    """This rank's index along every mesh dimension (`ParallelDims.coords`), computed once."""
    _savers: dict = field(default_factory=dict, repr=False)
    _profiler: StepProfiler | None = field(default=None, repr=False)
    """This rank's profiled steps (None: the job profiles none of its steps)."""
    _metrics: MetricsLog | None = field(default=None, repr=False)
    """Rank 0's metrics.jsonl and TensorBoard writer, opened by the first log_metrics."""
    _said: set = field(default_factory=set, repr=False)
    """Notes said once per process (`_no_location`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.coords = self.coords or self.dims.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        """Which slice of a global batch this rank takes (ranks of one TP/PP group share it)."""
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    def rows(self, global_batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch (its data-parallel slice; the ranks of one context-parallel group get
        the same rows, whole: `sequence_shard` cuts them)."""
        return rank_rows(global_batch, self.dp_rank, self.dp_size)

    def sequence_shard(self, *tensors: torch.Tensor):
        """This rank's zig-zag chunks of each tensor (batch, sequence, ...) under context parallelism, the tensors
        themselves otherwise (one tensor: it; several: a tuple). `forward_backward` and `evaluate` do it."""
        out = tuple(shard_sequence(t, self.dims.cp, self.cp_rank) for t in tensors)
        return out[0] if len(out) == 1 else out


_current: Context | None = None


def job_parallelism() -> Parallelism:
    """The job's layout from `TRAINYARD_DISTRIBUTION` (the SDK writes it from `JobSpec.parallelism`)."""
    return _parallelism(None)


def _parallelism(distribution: dict | Parallelism | None) -> Parallelism:
    """The engine's one parse of a distribution: one given to `init`/`transform` (any form `Parallelism.parse`
    accepts), else the job's, `TRAINYARD_DISTRIBUTION`."""
    if isinstance(distribution, Parallelism):
        return distribution
    if distribution is None:
        raw = os.environ.get("TRAINYARD_DISTRIBUTION") or "{}"
        try:
            distribution = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"TRAINYARD_DISTRIBUTION is not JSON ({e}): {raw[:200]!r}") from None
    return Parallelism.parse(distribution)


def init(distribution: dict | Parallelism | None = None) -> Context:
    """Join the job's process group (torchrun's variables; one plain process without them) and build the mesh
    from `distribution` (any form `Parallelism.parse` accepts), else from the job's (`TRAINYARD_DISTRIBUTION`,
    which the SDK sets). Calling it again returns the current context."""
    global _current
    check_launched(os.environ)  # before the layout: a multi-host job without a launcher is refused by that name
    par = _parallelism(distribution)
    if _current is not None:
        if distribution is not None and par != _current.parallelism:
            raise ValueError("init() was already called with another distribution; pass distribution= to "
                             "transform() to lay one model out differently")
        return _current
    quiet()  # torch's notes that say nothing about the job (engine/quiet.py); TRAINYARD_VERBOSE=1 shows them
    if tensorboard_dir_from_contract():
        require_tensorboard()  # before anything is built: the job asked for event files it could not write
    world = int(os.environ.get("WORLD_SIZE") or 1)
    dims = par.dims(world_size=world, processes_per_host=int(os.environ.get("LOCAL_WORLD_SIZE") or world))
    d: Dist = init_distributed()
    dims.build_mesh(d.device.type)
    _current = Context(**{f.name: getattr(d, f.name) for f in dataclasses.fields(Dist)}, parallelism=par, dims=dims)
    _current._profiler = StepProfiler.from_contract(profiler_from_contract(), d.rank, d.device)
    atexit.register(wait_for_checkpoints)
    atexit.register(_close_records, _current)
    return _current


def current() -> Context:
    """The context of `init()` (calling init() with the job's distribution when nobody did)."""
    return _current if _current is not None else init()


def finish() -> None:
    """Wait for checkpoints in flight and leave the process group (every rank calls it, at the end)."""
    global _current
    wait_for_checkpoints()
    if _current is not None:
        _close_records(_current)
    destroy_distributed()
    _current = None


def _close_records(ctx: Context) -> None:
    """Write what a profiled run still open recorded; close the metrics files (idempotent)."""
    if ctx._profiler is not None:
        ctx._profiler.close()
    if ctx._metrics is not None:
        ctx._metrics.close()
        ctx._metrics = None


def wait_for_checkpoints() -> bool:
    """Finish the asynchronous saves in flight; False when one failed (it was reported and not committed)."""
    ok = True
    if _current is not None:
        for saver in _current._savers.values():
            ok = saver.wait() and ok
    return ok


def checkpoint_held() -> float:
    """The seconds optimizer steps waited, since the last call, for asynchronous saves to finish copying the state
    (`save_checkpoint` returns before the copy; the next optimizer step, which changes the state, waits for it):
    with what `save_checkpoint` returned, what saving cost the loop."""
    return 0.0 if _current is None else sum(m.take_held() for m in _current._savers.values())


def checkpoint_busy(uri: str | None = None) -> bool:
    """Whether the last asynchronous save to `uri` (default: the job's checkpoint location) is still uploading on
    any rank (a collective: every rank gets the same answer). A loop that would rather skip a save than wait for a
    slow store asks this first: `if not checkpoint_busy(): save_checkpoint(...)`. False where nothing is saved."""
    uri = _uri(uri, check=False)
    ctx = current()
    return bool(uri) and uri in ctx._savers and ctx._savers[uri].busy()


def checkpoint_io(uri: str | None = None) -> list[dict]:
    """The figures of the saves and loads at `uri` (default: the job's checkpoint location) finished since the last
    call, oldest first: {"op": "save" or "load", "step", "bytes_per_rank", "gbps_per_rank"} (each rank's share
    and its rate; an asynchronous save's are gathered by the next `checkpoint_busy`, its upload being in the
    background). [] where nothing was saved or loaded."""
    uri = _uri(uri, check=False)
    ctx = current()
    return ctx._savers[uri].take_io() if uri and uri in ctx._savers else []


def _layout(model: nn.Module) -> Parallelized:
    par = getattr(model, _LAYOUT, None)
    if par is None:
        raise ValueError(f"{type(model).__name__} was not returned by trainyard.engine.transform(); call "
                         "model = transform(model) first")
    return par


def transform(model: nn.Module, *, distribution: dict | None = None, blocks=None, tp_plan: dict | None = None,
              activation_checkpointing: str | None = None, mixed_precision: str | torch.dtype | None = None,
              kernels=None, init: Callable[[nn.Module], None] | None = None, seed: int = 0,
              compile: bool = False) -> nn.Module:
    """`model` ready to train on this rank, laid out on the job's mesh (or on `distribution`): pipeline stages,
    tensor parallelism, activation checkpointing, MiCS sharding per block and the root, weights kept (rank 0's)
    or, for a model on the meta device, initialised layout-independently by `init` (called on every module, as
    `model.apply(init)`), `reset_parameters` or HF `_init_weights`, from `seed`. `kernels` ("eager", "triton",
    "auto"/True; default off) swaps norms, MLPs, rotary embeddings and, without TP or PP, the loss for
    trainyard.kernels ops (models/fused.py); the model then returns `LMHidden`: take its loss with
    `te.lm_loss(output, targets)` (or read `output.logits`). `compile=True` runs each block's forward through
    torch.compile (the first step then takes longer: the compilation). `kernels="auto"` with `compile=True` on
    CUDA first times each op, ours against torch.compile of its reference, at the model's shapes, and leaves to
    inductor the ops where compile's is as fast (trainyard/kernels/auto.py); the choices are printed and kept
    for the job's metrics (`layout.kernels`).

    `mixed_precision`: "bf16" (bf16 compute, fp32 master weights and gradient reduction), "fp16" (the same in
    float16, with dynamic loss scaling: `scaler(model)`), "float8" (torchao's FP8 Linear layers, the rest bf16;
    an NVIDIA GPU of compute capability >= 8.9), "fp32", or a torch dtype; default: the distribution's."""
    backend = backend_of(kernels)
    ctx = current()
    par = ctx.parallelism if distribution is None else _parallelism(distribution)
    precision = mixed_precision if mixed_precision is not None else par.mixed_precision
    if isinstance(precision, torch.dtype):
        if precision not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"mixed_precision {precision}: a compute dtype is torch.bfloat16, torch.float16 or "
                             "torch.float32; for FP8 training give 'float8' (torchao's FP8 Linear layers, the rest "
                             "bf16)")
        param_dtype = None if precision == torch.float32 else precision
    elif precision is None or (isinstance(precision, str) and precision.lower() in _PRECISIONS):
        precision = precision and precision.lower()
        param_dtype = _PRECISIONS[precision]
    else:
        raise ValueError(f"mixed_precision must be 'bf16', 'fp16', 'float8', 'fp32' or a torch dtype, got "
                         f"{precision!r}")
    fp8 = precision in _FLOAT8
    if fp8:  # before any work on the model: the GPU and torchao
        float8.require_float8(ctx.device, "mixed_precision")
    if param_dtype == torch.float16 and par.replica_compression is not None:
        raise ValueError(f"mixed_precision float16 with mics.replica_compression {par.replica_compression!r}: a "
                         "step whose gradients overflow would leave inf in the compression's error-feedback residual "
                         "and spoil every later step; set replica_compression to null, or use bf16")
    dims = ctx.dims if distribution is None else par.dims(world_size=ctx.world_size,
                                                          processes_per_host=ctx.processes_per_host)
    dims.build_mesh(ctx.device.type)
    mics = MiCSConfig(param_dtype=param_dtype, reduce_dtype=torch.float32,
                      hierarchical=par.hierarchical_allgather, reshard_after_forward=par.reshard_after_forward,
                      replica_sync=par.replica_sync, replica_bucket_mb=par.replica_bucket_mb,
                      replica_compression=par.replica_compression, hierarchical_chunks=par.hierarchical_chunks,
                      cpu_offload=par.cpu_offload)
    pipeline = PipelineConfig(schedule=par.pipeline_schedule, virtual_stages=par.virtual_stages,
                              microbatches=par.microbatches or par.pp, split=par.pipeline_split) if par.pp > 1 else None
    spec = resolve_spec(model, blocks=blocks, tp_plan=tp_plan)
    if spec.note and ctx.is_main:
        print(spec.note, flush=True)
    choices = {}
    if backend is not None and adapters.is_peft(model):
        raise ValueError(f"kernels={kernels!r} with a PEFT model: the kernels' swap is not verified through LoRA "
                         "layers (it would also return LMHidden instead of logits); leave kernels out")
    if backend is not None:
        choices, errors = plan_backends(model, backend, compile=compile, device=ctx.device, dtype=param_dtype)
        swapped = swap_kernels(model, backend, fused_loss=dims.tp == 1 and dims.pp == 1,
                               backends={op: c.backend for op, c in choices.items()})
        if ctx.is_main:
            print(f"kernels ({backend}): {swapped}{describe_choices(backend, choices, errors)}", flush=True)
    # FP8 weights all-gathered by MiCS when it shards over several ranks (torchao's FSDP2 extension); not with CPU
    # offload, whose shards live in host memory
    fp8_all_gather = fp8 and dims.dp_shard > 1 and not par.cpu_offload
    if fp8:  # after the kernels' probes (which run modules on the CPU), before TP and MiCS
        report = float8.convert(model, tp=dims.tp, fp8_all_gather=fp8_all_gather)
        if ctx.is_main:
            print(float8.describe(report, fp8_all_gather), flush=True)
    result = parallelize(model, spec, dims, device=ctx.device, mics=mics, pipeline=pipeline,
                         ac=activation_checkpointing or par.activation_checkpointing, two_hop=par.two_hop_sync,
                         seed=seed, init=init, compile=compile)
    result.kernels = record_choices(choices)
    result.scaler = GradScaler(result.model.parameters, enabled=param_dtype == torch.float16, device=ctx.device)
    # without a precomputed scale torchao computes each weight's at its all-gather (one all-reduce per weight);
    # optimizer_step precomputes them all in one after each step. torchao keeps a precomputed scale until the
    # next precompute: a loop steps with optimizer_step always or never (opt.step() alone is right too)
    result.float8_all_gather = fp8_all_gather
    object.__setattr__(result.model, _LAYOUT, result)
    return result.model


def scaler(model: nn.Module) -> GradScaler:
    """The loss scaler of a transformed model: under mixed_precision "fp16", dynamic loss scaling over its sharded
    gradients (`scaler(model).scale(loss).backward()` in an `accumulate` loop; `forward_backward` scales by
    itself; `clip_grad_norm_` unscales; `optimizer_step` skips a step whose gradients hold inf/nan on any rank);
    for every other precision a pass-through (`scale(loss)` is `loss`), so one loop serves all. Saved with the
    model's checkpoints."""
    return _layout(model).scaler


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """`optimizer.step()` for a transformed model, whatever its precision; returns whether it stepped (a
    collective under fp16 and float8). fp16: the gradients are unscaled (if `clip_grad_norm_` did not already)
    and, when any gradient shard of any rank is inf or nan, the step is skipped (False) and the loss scale halved;
    after 2,000 clean steps in a row it doubles. float8 with FP8 all-gather: the weights' scales for the next
    forward are computed after the step (one all-reduce)."""
    par = _layout(model)
    heartbeat.set_phase("optimizer")
    stepped = par.scaler.step(optimizer)
    par.scaler.update()
    if stepped and par.float8_all_gather:
        float8.precompute_scales(model)
    return stepped


def rows(model: nn.Module, global_batch: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global batch for `model`'s layout (its data-parallel slice; the ranks of one
    TP/PP group get the same rows). Same as ctx.rows unless transform() was given its own distribution."""
    par = _layout(model)
    return rank_rows(global_batch, par.coords["dp"], par.dims.dp)


def sequence_shard(model: nn.Module, *tensors: torch.Tensor):
    """This rank's zig-zag chunks of the sequences of `tensors` (batch, sequence, ...) for `model`'s layout: under
    context parallelism what `model(x)` and the loss of an `accumulate` loop take (inputs and targets alike); the
    tensors themselves without it. One tensor: it; several: a tuple."""
    par = _layout(model)
    out = tuple(par.sequence_shard(t) for t in tensors)
    return out[0] if len(out) == 1 else out


@contextlib.contextmanager
def accumulate(model: nn.Module, index: int, count: int):
    """Around micro-batch `index` of `count`: the 2-hop gradient sync (reduce-scatter inside the partition
    group every micro-batch, all-reduce across replicas on the last)."""
    par = _layout(model)
    if par.dims.pp > 1:
        raise ValueError("with pipeline parallelism the schedule runs the micro-batches: call "
                         "forward_backward(model, inputs, targets, loss_fn, microbatches=n) instead")
    if not 0 <= index < count:
        raise ValueError(f"micro-batch index {index} is outside 0..{count - 1}")
    sync_for(par, index, count)
    scale = par.scaler.get_scale() if par.scaler is not None else 1.0
    # e.g. the built-in model's vocab-parallel cross-entropy; a load-balancing loss weighs as the micro-batch's
    with par.spec.loss_context(par.dims.tp), aux_weight(scale / count):
        yield
    if index == count - 1:
        par.finish_experts()
        check_tp_gradients(par)  # once, after the first step's backward


def forward_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *, microbatches: int = 1) -> float:
    """Forward and backward of this rank's rows in `microbatches` chunks (through the pipeline schedule when
    there is one), gradients reduced; returns the global-batch mean loss (a collective)."""
    par = _layout(model)
    total = _forward_backward(par, inputs, targets, microbatches, loss_fn)
    check_tp_gradients(par)
    return loss_value(total, par.dims)


def global_loss(model: nn.Module, loss: torch.Tensor | float) -> float:
    """The global-batch mean of a per-rank loss (a collective; every rank calls it): in an `accumulate` loop,
    pass the sum over this rank's micro-batches of `loss / n` (each micro-batch's mean over its tokens, divided
    by the micro-batch count). Ranks of one tensor-parallel group hold the same value and count once."""
    par = _layout(model)
    value = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
    return loss_value(plain(value).float().to(par.device), par.dims)


def _eval_microbatches(par: Parallelized, microbatches: int | None) -> int:
    """The micro-batches of a run without gradients: as given, else the pipeline's (at least its degree), else 1."""
    if microbatches is not None:
        return microbatches
    return par.pipeline.microbatches if par.pipeline is not None else 1


def evaluate(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
             loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *, microbatches: int | None = None) -> float:
    """The global-batch mean loss of this rank's rows (whole sequences) without gradients (a collective), on every
    layout: through
    the pipeline schedule's forward-only run under pipeline parallelism (`microbatches` default: the pipeline's),
    else the model's forward (default: one). Call `model.eval()` first for a model with dropout."""
    par = _layout(model)
    microbatches = _eval_microbatches(par, microbatches)
    total = torch.zeros((), device=inputs.device)
    inputs, targets = par.sequence_shard(inputs), par.sequence_shard(targets)
    with torch.no_grad(), par.spec.loss_context(par.dims.tp):
        if par.dims.pp > 1:
            losses: list[torch.Tensor] = []
            par.schedule(microbatches, loss_fn).eval(*((inputs,) if par.holds_first else ()),
                                                     target=targets if par.holds_last else None,
                                                     losses=losses if par.holds_last else None)
            for loss in losses:
                total += plain(loss).float() / microbatches
        else:
            for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
                total += plain(loss_fn(model(x), y)).float() / microbatches
    return loss_value(total, par.dims)


def predict(model: nn.Module, inputs: torch.Tensor, *, microbatches: int | None = None):
    """The model's output for this rank's `inputs`, without gradients (a collective under pipeline parallelism):
    under pipeline parallelism the last stage's output (the logits of an HF model) on the ranks that hold it and
    None on the others (through the schedule's forward-only run, in `microbatches` chunks: default the
    pipeline's); else `model(inputs)`."""
    par = _layout(model)
    if par.dims.cp > 1:
        raise ValueError(f"predict under context_parallel_degree {par.dims.cp}: not supported yet (each rank holds "
                         "chunks of the sequence); call model(te.sequence_shard(model, inputs)) under torch.no_grad() "
                         "for this rank's chunks of the output, or predict with a layout without context parallelism")
    with torch.no_grad():
        if par.dims.pp == 1:
            return model(inputs)
        out = par.schedule(_eval_microbatches(par, microbatches), None).eval(*((inputs,) if par.holds_first else ()))
        return out if par.holds_last else None


def clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """Clip the gradients of the whole model to `max_norm` (2-norm over every shard and stage); returns the
    norm before clipping. Under fp16 the gradients are unscaled first (the norm and the clipping are those of the
    true gradients; inf or nan when the step will be skipped)."""
    par = _layout(model)
    check_tp_gradients(par)
    heartbeat.set_phase("optimizer")
    par.scaler.unscale_()  # a no-op but under fp16; once per step
    return clip_grad_norm(model, par.dims, max_norm)


def mark_step(step: int) -> None:
    """Say which step this rank is in, for the job's hang detection (a failure then names it) and its profiler
    (a profiled step is recorded from here): call it at the top of each step of your loop. The built-in trainer
    does."""
    heartbeat.set_step(step)
    if _current is not None and _current._profiler is not None:
        _current._profiler.at_step(step)


def log_metrics(step: int, metrics: dict[str, Any]) -> None:
    """Record step `step`'s figures; call it on every rank when the step is done. Rank 0 appends
    `{"step": step, **metrics}` to `$SM_OUTPUT_DATA_DIR/metrics.jsonl` (`job.metrics()` returns the rows) and, when
    the job has `tensorboard_output_config`, writes every number of it (nested dicts too) as a TensorBoard scalar
    at `step`; a profiled run whose last step this is ends here. Values must be JSON-serialisable."""
    ctx = current()
    if ctx.is_main:
        if ctx._metrics is None:
            ctx._metrics = MetricsLog.from_contract()
        ctx._metrics.write({"step": step, **metrics})
    if ctx._profiler is not None:
        ctx._profiler.after_step(step)


def _uri(uri: str | None, *, check: bool = True) -> str:
    """`uri`, else the job's checkpoint location; "" when there is neither. Checked (the bucket exists) once per
    process and location: a later save asks the store nothing before its upload, which a store that stalls would
    otherwise hold the loop on; `check=False` (asking about saves already made) never asks."""
    uri = uri or checkpoint_uri_from_contract()
    if uri and check and uri not in _CHECKED:
        ckpt.validate_uri(uri)
        _CHECKED.add(uri)
    return uri


_CHECKED: set[str] = set()


def _no_location(what: str, ctx: Context) -> None:
    """Say once per process, on the first rank, that checkpoints go nowhere."""
    if ctx.is_main and what not in ctx._said:
        ctx._said.add(what)
        print(f"{what}: the job has no checkpoint location and no uri was given: {_NO_LOCATION[what]} (set "
              "checkpoint_s3_uri on the Estimator, or pass uri='s3://...' or a path; said once)", flush=True)


_NO_LOCATION = {"save_checkpoint": "nothing is saved", "load_checkpoint": "training starts at step 0"}


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, *, uri: str | None = None,
                    extra: dict | None = None, scheduler=None, blocking: bool = False,
                    keep_last: int = ckpt.DEFAULT_KEEP_LAST, trainable_only: bool = False) -> float:
    """Save step `step` (a collective): model, optimizer, `scheduler` and `extra` (numbers or tensors), to
    `uri` (default: the job's checkpoint location). Asynchronous unless `blocking`: the call returns once the
    state is staged in host memory (the seconds it blocked), at most one save in flight; committed by
    `.metadata`, verified on load, older steps purged beyond `keep_last`; a float16 model's loss scaler is saved
    with it. `trainable_only`: of the model, only the parameters that train (requires_grad: a PEFT model's
    adapters), with their optimizer state; `load_checkpoint` loads them over the frozen weights the model has (load
    the base model first, e.g. with `load_pretrained`). A job without a checkpoint location
    (no `checkpoint_s3_uri`) and no `uri`: nothing is saved, said once; the same script runs with and without."""
    par = _layout(model)
    uri = _uri(uri)
    ctx = current()
    if not uri:
        _no_location("save_checkpoint", ctx)
        return 0.0
    heartbeat.set_phase("checkpoint")
    return _checkpoints(ctx, uri, keep_last).save(step, model, optimizer, scheduler, extra=extra,
                                                  scaler=_saved_scaler(par), blocking=blocking,
                                                  trainable_only=trainable_only)


def _saved_scaler(par: Parallelized) -> GradScaler | None:
    """The loss scaler a checkpoint holds: a float16 model's (its scale and growth tracker), else none."""
    return par.scaler if par.scaler is not None and par.scaler.enabled else None


def _checkpoints(ctx: Context, uri: str, keep_last: int | None = None) -> ckpt.CheckpointManager:
    """The context's manager of the checkpoints at `uri` (one per location: its save in flight); `keep_last`,
    when given, is what its saves keep from now on."""
    manager = ctx._savers.get(uri)
    if manager is None:
        manager = ctx._savers[uri] = ckpt.CheckpointManager(
            uri, say=lambda m: print(m, flush=True) if ctx.is_main else None)
    if keep_last is not None:
        manager.keep_last = keep_last
    return manager


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, uri: str | None = None,
                    extra: dict | None = None, scheduler=None) -> int:
    """Load the newest verified committed step under `uri` (default: the job's checkpoint location) into this
    layout, resharding as needed (a collective); returns the step, 0 when there is none, or when the job has no
    checkpoint location and no `uri` is given. `extra` is filled in place with the values saved under its keys; a
    float16 model's loss scaler gets its saved scale back."""
    par = _layout(model)
    uri = _uri(uri)
    ctx = current()
    if not uri:
        _no_location("load_checkpoint", ctx)
        return 0
    heartbeat.set_phase("checkpoint")
    wait_for_checkpoints()
    step = _checkpoints(ctx, uri).resume(model, optimizer, scheduler, extra=extra, scaler=_saved_scaler(par),
                                         warn=lambda m: print(m, flush=True) if ctx.is_main else None)
    return step or 0


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU, gathered from every shard and stage ({} on other ranks;
    a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    par = _layout(model)
    rank = dist.get_rank()
    if par.dims.pp == 1:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if rank == 0 else {}
    # each stage gathers its own weights; the first rank of every stage sends them to rank 0
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    leader = par.coords["dp"] == 0 and par.coords["tp"] == 0
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()} if leader else None)
    return {k: v for part in parts if part for k, v in part.items()} if rank == 0 else {}


def save_model(model: nn.Module, path: str, *, max_shard_size: int = 5 * 2**30, merged: bool = False) -> None:
    """The full weights, written by rank 0 to `path` (a directory or `s3://` prefix; a collective). A Hugging
    Face model is written as `from_pretrained` loads it (config.json + safetensors, sharded with an index above
    `max_shard_size` bytes); any other model as safetensors plus `trainyard_model.json`. A PEFT model: its
    adapters as PEFT writes them (adapter_config.json + adapter_model.safetensors, for
    `PeftModel.from_pretrained`), or with `merged` the base model with the adapters merged into its weights, as a
    Hugging Face model."""
    par = _layout(model)
    state = full_state_dict(model)
    root = par.parts[0]  # with several stages on this rank (virtual stages) the model is their RankModel: the
    if adapters.is_peft(root):  # first stage, a cut copy of the whole model, keeps its class, config and adapters
        if dist.get_rank() == 0:
            if merged:
                inner = adapters.inner_model(root)
                config = copy.deepcopy(inner.config)
                config.architectures = [type(inner).__name__]
                tied = dict(getattr(inner, "_tied_weights_keys", None) or {}) if config.tie_word_embeddings else None
                hf_weights.write_pretrained(adapters.merged_state(root, state), path, config=config,
                                            max_shard_size=max_shard_size, tied=tied)
            else:
                adapters.write_adapter(root, state, path)
        dist.barrier()
        return
    # merged=True without adapters: there is nothing to merge, and the model is written as it is
    if dist.get_rank() == 0:
        config = getattr(root, "config", None) if par.spec.name.startswith("hf:") else None
        if config is not None:
            config = copy.deepcopy(config)
            config.architectures = [par.spec.name.removeprefix("hf:")]
        tied = None
        if config is not None and getattr(config, "tie_word_embeddings", False):
            tied = dict(getattr(root, "_tied_weights_keys", None) or {})
        hf_weights.write_pretrained(state, path, config=config, max_shard_size=max_shard_size, tied=tied)
    dist.barrier()


def load_pretrained(model: nn.Module, path_or_uri: str, *, strict: bool = True) -> dict:
    """Safetensors weights (one file, or shards with `model.safetensors.index.json`; a directory or `s3://`)
    into a transformed model, each rank reading only the byte ranges of its own shards (a collective on
    entry and exit). Returns what this rank read."""
    par = _layout(model)
    for saver in (_current._savers.values() if _current is not None else ()):
        saver.ready()  # the weights change: an asynchronous save's copy of them first
    root = par.parts[0]  # the model, or its first stage where the rank holds several (save_model)
    tensors = hf_weights.model_tensors(model)
    # a PEFT model: the base model's files, into the weights its LoRA layers wrap (the adapters are not in them)
    targets = adapters.base_tensors(root, tensors) if adapters.is_peft(root) else None
    elsewhere: frozenset[str] = frozenset()
    if par.dims.pp > 1:  # the other stages' names are the model's too: not "unexpected" in the files
        mine = set(tensors if targets is None else targets)  # as the files name them
        stages: list = [None] * par.dims.pp
        dist.all_gather_object(stages, sorted(mine), group=par.dims.mesh.get_group("pp"))
        elsewhere = frozenset(n for names in stages for n in names) - mine
    config = getattr(adapters.inner_model(root) if adapters.is_peft(root) else root, "config", None)
    report = hf_weights.load_pretrained_into(model, path_or_uri, strict=strict, elsewhere=elsewhere, targets=targets,
                                             model_type=getattr(config, "model_type", None))
    dist.barrier()
    return report
