"""Hyperparameters of the built-in trainer and the SageMaker container contract it reads.

Hyperparameters arrive as `--name value` arguments: plain strings for strings, compact JSON for
everything else (`--steps 20 --lr 0.001 --save_model false`). A JSON-quoted string (`--model
'"tiny"'`, as SageMaker's hyperparameters.json stores values) is accepted too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from trainyard.engine.components.formats import TOKEN_DTYPES, check_location_form
from trainyard.parallel.layout import check_cp, check_experts, check_pipeline
from trainyard.parallel.parallelism import Parallelism
from trainyard.parallel.presets import MODEL_CONFIGS
from trainyard.parallel.shapes import from_config
from trainyard.errors import did_you_mean

KERNEL_MODES = ("off", "eager", "eager-chunked", "triton", "auto")  # what models/fused.py's MODES take

DTYPES = ("auto", "float32", "bfloat16", "float16", "float8")
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: NVIDIA Ada (8.9), Hopper (9.0) and later (models/float8.py)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Hyperparameters of `python -m trainyard.engine.train`."""

    model: str = "10m"
    """The built-in model's configuration (a key of MODEL_CONFIGS: tiny, 6l, 10m, and the published shapes
    llama3.2-1b, llama3-8b, llama3-70b, and llama3-8b-4l: 8B's layer and vocabulary, 4 layers), or `hf`: the Hugging
    Face causal LM in channel `model_channel`."""
    model_channel: str = "model"
    """With model hf: the input channel holding config.json, optional safetensors weights and tokenizer.json."""
    steps: int = 20
    """Total optimizer steps of the run; a resumed run continues up to this step."""
    seed: int = 0
    """Seed of the weight init and of the data stream."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all ranks."""
    micro_batch_size: int = 2
    """Sequences per forward/backward on one rank; the rest is gradient accumulation."""
    seq_len: int = 128
    """Tokens per training sequence."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 5
    """Steps of linear warmup from lr/warmup_steps to lr (0: no warmup)."""
    decay_steps: int = 0
    """Length of the schedule: cosine decay ends at this step (0: the value of steps). Set it when a
    run is split into several resumed runs, so every part follows the same schedule."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at min_lr_ratio * lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices and embeddings (not to norms)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping; the norm is still reported)."""
    dtype: str = "auto"
    """Compute dtype: float32, bfloat16 (bf16 compute, fp32 master weights and gradient reduction), float16
    (the same in fp16, with dynamic loss scaling: a step whose gradients overflow is skipped), float8 (torchao's
    FP8 Linear layers, the rest bfloat16; NVIDIA GPUs of compute capability 8.9 or newer), or auto (bfloat16 on
    CUDA, float32 on CPU)."""
    checkpoint_uri: str = ""
    """Checkpoint location (s3://bucket/prefix or a path); overrides checkpointconfig.json's S3Uri."""
    checkpoint_every: int = 0
    """Save every this many steps (0: no periodic saves). With a checkpoint location, the last step
    is always saved."""
    checkpoint_async: bool = True
    """Save checkpoints in the background: the loop waits only while the state is copied to host
    memory; at most one save is in flight (false: the loop waits for every save to complete)."""
    termination_deadline_s: float = 20.0
    """After SIGTERM (spot interruption, stop()), the step in progress finishes and an emergency
    checkpoint is written if this many seconds since the signal have not passed (torchrun kills at 30)."""
    keep_last: int = 2
    """Committed checkpoints kept (at least 2); older ones are deleted after each save."""
    dataset: str = "synthetic"
    """`synthetic`, or an input channel name (e.g. `train`: token files in $SM_CHANNEL_TRAIN)."""
    token_dtype: str = "uint16"
    """Element type of the token files: uint16 or uint32 (little-endian)."""
    log_every: int = 1
    """Print a progress line every this many steps (metrics.jsonl gets every step)."""
    save_model: bool = True
    """Write the full weights to $SM_MODEL_DIR at the end."""
    compile: bool = False
    """torch.compile each transformer block's forward (inductor's fused kernels; the first step compiles)."""
    kernels: str = "off"
    """trainyard.kernels ops for the norms, SwiGLU MLPs, rotary embeddings and (without TP or PP) the loss:
    off, eager (eager-chunked: the ops' references, the loss chunked so the logits are never whole),
    triton (CUDA; CPU under TRITON_INTERPRET=1) or auto (Triton where it runs, else eager)."""

    straggler_check_every: int = 10
    """Compare the ranks' step times every this many steps (0: never): a rank whose compute (its step's time less
    the communication it waited for) is straggler_ratio x the median of its peers' for straggler_steps consecutive
    steps is named with its host (components/stragglers.py). One all-gather of a few numbers each time."""
    straggler_ratio: float = 1.3
    """How much slower than the median of its peers a rank's step must be to count as slow."""
    straggler_steps: int = 20
    """Consecutive slow steps before a rank is named a straggler."""
    straggler_remove: bool = False
    """With the job's `elastic`: a rank still slow at a committed checkpoint ends the attempt there, and the job goes
    on from that checkpoint without its host (retry class `straggler`); False: stragglers are only named."""

    sdc_check_every: int = 100
    """Compare every parameter shard with its replicas (MiCS's partition groups) every this many steps, before
    every checkpoint save and at the last step (0: never): a copy that differs fails the attempt as data corruption, naming the rank
    and host (components/sdc.py). A layout with one replica of each shard has nothing to compare."""

    task: str = "pretrain"
    """`pretrain`: next-token prediction on every token of the data. `sft`: supervised fine-tuning of model hf on the
    `dataset` channel's `.jsonl` chat examples, rendered with the model's chat template, the loss on the assistants'
    tokens only, every such token weighing the same (components/sft.py)."""
    packing: bool = True
    """With task sft: several examples in one sequence, attention confined to each (False: one example a sequence,
    padded)."""
    lora_r: int = 0
    """With model hf: train LoRA adapters of this rank (peft) over the frozen model instead of every weight (0: off);
    checkpoints hold the adapters, the export is the adapter folder (adapter_config.json, adapter_model.safetensors)."""
    lora_alpha: float = 16.0
    """LoRA's scaling numerator: the adapters' output is scaled by lora_alpha / lora_r."""
    lora_targets: str = "all-linear"
    """The linear layers LoRA wraps: comma-separated module names (q_proj,v_proj), or all-linear (every linear
    layer but the output head)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_merge: bool = False
    """Export the model with the adapters merged into its weights (a plain Hugging Face model) instead of the adapter
    folder."""

    def __post_init__(self) -> None:
        if self.task not in ("pretrain", "sft"):
            raise ValueError(f"task must be pretrain or sft, got {self.task!r}")
        if self.task == "sft" and self.model != "hf":
            raise ValueError(f"task sft fine-tunes a Hugging Face model: set model hf (got model {self.model!r}) and "
                             "give its folder as the model channel")
        if self.lora_r < 0 or (self.lora_r and self.model != "hf"):
            raise ValueError(f"lora_r {self.lora_r}: LoRA adapters are for model hf, with lora_r >= 1 (0: off)")
        if self.task == "sft" and self.kernels != "off":
            raise ValueError(f"kernels {self.kernels!r} with task sft: fine-tuning takes the model's logits, which the "
                             "kernels' fused loss replaces; set kernels off")
        if self.lora_merge and not self.lora_r:
            raise ValueError("lora_merge merges LoRA adapters into the weights, and lora_r is 0 (no adapters): set "
                             "lora_r, or leave lora_merge out")
        if self.lora_r and not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        unused = [f"{k} {getattr(self, k)!r}" for k in ("lora_alpha", "lora_targets", "lora_dropout")
                  if not self.lora_r and getattr(self, k) != _FIELDS[k].default]
        if unused:  # set for adapters that are not made: a forgotten lora_r would train every weight
            raise ValueError(f"{', '.join(unused)} set LoRA adapters, and lora_r is 0 (no adapters: every weight "
                             "trains): set lora_r, or leave them out")
        if self.model not in MODEL_CONFIGS and self.model != "hf":
            raise ValueError(f"model: unknown model {self.model!r}; choose one of {sorted(MODEL_CONFIGS)} or hf")
        for name in ("steps", "global_batch_size", "micro_batch_size", "seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.keep_last < 2:  # the newest committed step may turn out damaged: keep one to fall back to
            raise ValueError(f"keep_last must be >= 2, got {self.keep_last}")
        if not self.straggler_ratio > 1:
            raise ValueError(f"straggler_ratio must be > 1, got {self.straggler_ratio}")
        if self.straggler_steps < 1:
            raise ValueError(f"straggler_steps must be >= 1, got {self.straggler_steps}")
        if self.straggler_remove and not (self.straggler_check_every and self.checkpoint_every):
            raise ValueError("straggler_remove leaves a straggler's host out at a checkpoint: it needs "
                             f"straggler_check_every ({self.straggler_check_every}) and checkpoint_every "
                             f"({self.checkpoint_every}) above 0")
        for name in ("seed", "warmup_steps", "decay_steps", "checkpoint_every", "straggler_check_every",
                     "sdc_check_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.termination_deadline_s < 0:
            raise ValueError(f"termination_deadline_s must be >= 0, got {self.termination_deadline_s}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {self.max_grad_norm}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {list(KERNEL_MODES)}, got {self.kernels!r}")
        if self.checkpoint_uri:
            check_location_form(self.checkpoint_uri)  # a relative path is fine here; in a job the SDK refuses it
        if self.token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"token_dtype must be one of {sorted(TOKEN_DTYPES)}, got {self.token_dtype!r}")
        if self.model in MODEL_CONFIGS and self.seq_len > MODEL_CONFIGS[self.model].max_seq_len:
            raise ValueError(
                f"seq_len {self.seq_len} exceeds the max_seq_len {MODEL_CONFIGS[self.model].max_seq_len} "
                f"of model {self.model!r}"
            )

    @property
    def schedule_steps(self) -> int:
        return self.decay_steps or self.steps

    def accumulation(self, dp: int) -> int:
        """Micro-batches per rank per step over `dp` data-parallel ranks; raises ValueError when the batch
        does not split evenly."""
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be divisible by micro_batch_size "
                f"({self.micro_batch_size}) * data-parallel ranks ({dp}) = {per_step}; set global_batch_size "
                f"to a multiple of {per_step} or lower micro_batch_size"
            )
        return self.global_batch_size // per_step

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_FIELD_TYPES = {name: type(f.default) for name, f in _FIELDS.items()}


def _convert(name: str, kind: type, raw: str):
    """One hyperparameter value from its command-line string."""
    try:
        decoded = json.loads(raw)
    except json.JSONDecodeError:
        decoded = raw
    if kind is str:
        return decoded if isinstance(decoded, str) else raw
    if isinstance(decoded, str):  # a JSON-quoted number or boolean: "\"20\"", "\"false\""
        decoded = decoded.strip()
    if kind is bool:
        text = str(decoded).lower() if not isinstance(decoded, bool) else decoded
        if text in (True, "true"):
            return True
        if text in (False, "false"):
            return False
        raise ValueError(f"{name}: expected true or false, got {raw!r}")
    if kind is int:
        if isinstance(decoded, bool):
            raise ValueError(f"{name}: expected an integer, got {raw!r}")
        if isinstance(decoded, int):
            return decoded
        if isinstance(decoded, float) and decoded.is_integer():
            return int(decoded)
        try:
            return int(str(decoded))
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
    if kind is float:
        if isinstance(decoded, bool):
            raise ValueError(f"{name}: expected a number, got {raw!r}")
        try:
            return float(decoded)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected a number, got {raw!r}") from None
    raise TypeError(f"no converter for {kind}")


def parse_hyperparameters(argv: list[str]) -> TrainConfig:
    """`--name value` arguments to a TrainConfig; ValueError names unknown or invalid hyperparameters."""
    parser = argparse.ArgumentParser(prog="trainyard.engine.train", add_help=True, allow_abbrev=False)
    for name in _FIELD_TYPES:
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        parser.add_argument(*flags, dest=name, metavar="VALUE", default=None)
    args, unknown = parser.parse_known_args(argv)
    names = [t[2:].split("=", 1)[0] for t in unknown if t.startswith("--")]
    if names:
        named = ", ".join(f"--{n}{did_you_mean(n.replace('-', '_'), _FIELD_TYPES, prefix='--')}" for n in names)
        raise ValueError(f"unknown hyperparameter(s) {named}; known: {', '.join(sorted(_FIELD_TYPES))}")
    if unknown:
        raise ValueError(f"stray argument(s) {' '.join(unknown)}: hyperparameters are given as --name value")
    values = {name: _convert(name, _FIELD_TYPES[name], raw) for name, raw in vars(args).items() if raw is not None}
    return TrainConfig(**values)


_PRECISION_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def reconcile_distribution(cfg: TrainConfig, par: Parallelism, world_size: int) -> TrainConfig:
    """`cfg` with the parsed distribution `par` applied (a new config; `cfg` is left as it was), refusing
    contradictions (ValueError naming both sides).

    mixed_precision sets dtype (which must be `auto` or the same); gradient_clipping sets max_grad_norm;
    gradient_accumulation_steps and microbatches (the pipeline's micro-batches) must both equal
    global_batch_size / (micro_batch_size x data-parallel degree). The built-in model's shape is checked
    against the tensor- and pipeline-parallel layout (an HF model's when it is built).
    """
    if par.mixed_precision:
        want = _PRECISION_DTYPES[par.mixed_precision]
        if cfg.dtype not in ("auto", want):
            raise ValueError(f"dtype {cfg.dtype!r} contradicts distribution mixed_precision {par.mixed_precision!r}; "
                             "drop one")
        cfg = dataclasses.replace(cfg, dtype=want)
    if par.gradient_clipping is not None:
        cfg = dataclasses.replace(cfg, max_grad_norm=float(par.gradient_clipping))
    dp = par.data_parallel_degree(world_size)
    accum = cfg.accumulation(dp)
    for key in ("gradient_accumulation_steps", "microbatches"):
        s = getattr(par, key)
        if s is not None and accum != s:
            raise ValueError(
                f"distribution {key} {s} does not match global_batch_size ({cfg.global_batch_size}) / "
                f"(micro_batch_size ({cfg.micro_batch_size}) x data-parallel degree ({dp})) = {accum}; set "
                f"micro_batch_size to {max(1, cfg.global_batch_size // (dp * s))} or change global_batch_size")
    if cfg.model in MODEL_CONFIGS:
        mcfg = MODEL_CONFIGS[cfg.model]
        from_config(mcfg).check_tp(par.tp, cfg.seq_len)
        check_experts(ep=par.ep, tp=par.tp, pp=par.pp, n_experts=mcfg.n_experts, model=cfg.model)
    check_cp(cp=par.cp, seq_len=cfg.seq_len, tp=par.tp)
    if cfg.task == "sft" and (par.pp > 1 or par.cp > 1):
        raise ValueError(f"task sft: pipeline_parallel_degree {par.pp} and context_parallel_degree {par.cp}: "
                         "fine-tuning runs its examples through the model's own forward with their positions; "
                         "set both to 1 and use MiCS and tensor parallelism")
    if cfg.dtype == "float16" and par.replica_compression is not None:  # te.transform refuses it too
        raise ValueError(f"dtype float16 with mics.replica_compression {par.replica_compression!r}: a step whose "
                         "gradients overflow would leave inf in the compression's error-feedback residual and spoil "
                         "every later step; set replica_compression to null, or use dtype bfloat16")
    if cfg.lora_r and cfg.lora_dropout and par.tp > 1:  # the engine refuses it too (models/hf/adapters.py)
        raise ValueError(f"lora_dropout {cfg.lora_dropout:g} with tensor_parallel_degree {par.tp}: each rank would "
                         "drop other elements of the input a column-wise layer's whole A sees, and A's copies would "
                         "train apart; set lora_dropout to 0 or tensor_parallel_degree to 1")
    if par.pp > 1:
        check_pipeline(pp=par.pp, schedule=par.pipeline_schedule, virtual_stages=par.virtual_stages,
                       microbatches=accum, split=par.pipeline_split,
                       n_layers=MODEL_CONFIGS[cfg.model].n_layers if cfg.model in MODEL_CONFIGS else None)
    return cfg
