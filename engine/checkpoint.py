"""Checkpoints with torch.distributed.checkpoint (DCP) to an fsspec URI: `s3://bucket/prefix` or a path.

Layout: one prefix per step, `<uri>/step-00000100/`, holding one `__<rank>_0.distcp` file per rank
and a `.metadata` object that DCP's coordinator writes last (to `.metadata.tmp`, then renamed).
`.metadata` is the commit marker: a step without it is an interrupted save and is never loaded.
Resume lists the `step-*` prefixes; there is no pointer file to trust.

The saved state is one dict: {"app": model + optimizer (get_state_dict, sharded as DTensors, so a
load reshards to another process count), "trainer": step and LR-scheduler state as tensors}.
No pickled Python objects.
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
# torch 2.13 does not re-export the fsspec storage classes from torch.distributed.checkpoint.
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

STEP_PREFIX = "step-"
# Zero-padded to 8 digits so names sort in step order (100M steps is beyond any run).
STEP_DIGITS = 8
COMMIT_MARKER = ".metadata"
DEFAULT_KEEP_LAST = 2
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def step_uri(uri: str, step: int) -> str:
    """`<uri>/step-00000100`: where step `step` is saved."""
    _check_uri_type(uri)
    return f"{uri.rstrip('/')}/{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def _check_uri_type(uri: Any) -> None:
    # pathlib.Path folds "s3://b" into "s3:/b": storage locations are always str.
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"checkpoint uri must be a non-empty str, got {uri!r}")


def storage_options(uri: str) -> dict[str, Any]:
    """fsspec options for `uri`: the S3 endpoint named explicitly, so that fsspec's instance cache never
    hands out a filesystem bound to another endpoint (it keys instances by these options)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if uri.startswith("s3://") and endpoint:
        return {"client_kwargs": {"endpoint_url": endpoint}}
    return {}


def _fs(uri: str):
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(uri, **storage_options(uri))
    return fs, path.rstrip("/")


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def validate_uri(uri: str) -> None:
    """Fail early on an unusable checkpoint location.

    For `s3://` the bucket must exist: s3fs would otherwise create it on the first write, and the
    engine must never create buckets (on real S3 that is the platform's or the user's decision).
    """
    _check_uri_type(uri)
    if uri.startswith("s3://"):
        bucket = uri[len("s3://"):].split("/", 1)[0]
        if not bucket:
            raise ValueError(f"checkpoint uri {uri!r} names no bucket")
        fs, _ = _fs(uri)
        if not fs.exists(bucket):
            raise ValueError(
                f"checkpoint uri {uri!r}: bucket {bucket!r} does not exist or cannot be reached "
                f"(check AWS_ENDPOINT_URL and credentials)"
            )


def list_steps(uri: str) -> dict[int, bool]:
    """Every `step-*` prefix under `uri`: {step: committed (has .metadata)}."""
    _check_uri_type(uri)
    fs, root = _fs(uri)
    fs.invalidate_cache()  # s3fs caches listings; another process may have written since
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return {}
    steps: dict[int, bool] = {}
    for entry in entries:
        match = _STEP_RE.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if match:
            steps[int(match.group(1))] = fs.exists(f"{root}/{match.group(0)}/{COMMIT_MARKER}")
    return steps


def latest_committed_step(uri: str) -> int | None:
    """The newest step under `uri` whose save completed (its `.metadata` exists), or None."""
    committed = [step for step, ok in list_steps(uri).items() if ok]
    return max(committed) if committed else None


def purge(uri: str, keep_last: int, *, protect: int | None = None) -> list[int]:
    """Delete committed steps older than the newest `keep_last`, and interrupted saves older than
    the oldest step kept. Never deletes `protect` (the step just written). Returns deleted steps."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    steps = list_steps(uri)
    committed = sorted((s for s, ok in steps.items() if ok), reverse=True)
    kept = set(committed[:keep_last])
    if protect is not None:
        kept.add(protect)
    oldest_kept = min(kept) if kept else None
    doomed = [s for s, ok in steps.items()
              if s not in kept and (ok or (oldest_kept is not None and s < oldest_kept))]
    fs, _ = _fs(uri)
    for step in sorted(doomed):
        _, path = _fs(step_uri(uri, step))
        fs.rm(path, recursive=True)
    fs.invalidate_cache()
    return sorted(doomed)


# Optimizer state keyed by parameter name, param-group settings included ("param_groups.<name>.lr"):
# with pipeline parallelism every rank holds different parameters, and a nested "param_groups" list
# would be one key that DCP saves once, from one rank, for all of them.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelOptimState(Stateful):
    """Model and optimizer through DCP's state-dict API (FSDP2-aware, reshards on load)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=_OPTIONS)


class TrainerState(Stateful):
    """The step number and the LR scheduler's numeric state, stored as tensors.

    Scheduler entries that are numbers or lists of numbers become float64 tensors (exact for the
    integers and float32/float64 values involved); others (e.g. LambdaLR's lr_lambdas) are not saved.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, step: int = 0) -> None:
        self.scheduler, self.step = scheduler, step

    def _numeric_items(self) -> dict[str, Any]:
        out = {}
        for key, value in self.scheduler.state_dict().items():
            if isinstance(value, (bool, int, float)) or (
                isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value)
            ):
                out[key] = value
        return out

    def state_dict(self) -> dict[str, Any]:
        sched = {k: torch.tensor(v, dtype=torch.float64) for k, v in self._numeric_items().items()}
        return {"step": torch.tensor(self.step, dtype=torch.int64), "scheduler": sched}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        current = self.scheduler.state_dict()
        for key, tensor in state_dict["scheduler"].items():
            template = current[key]
            if isinstance(template, list):
                current[key] = [type(t)(v) for t, v in zip(template, tensor.tolist())]
            else:
                current[key] = type(template)(tensor.item())
        self.scheduler.load_state_dict(current)


def save_checkpoint(uri: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, *, keep_last: int = DEFAULT_KEEP_LAST) -> str:
    """Save synchronously to `<uri>/step-N` (a collective: every rank calls it); then rank 0 purges
    old steps. Returns the step's URI."""
    target = step_uri(uri, step)
    state = {"app": ModelOptimState(model, optimizer), "trainer": TrainerState(scheduler, step)}
    # fsync only makes sense for local files (for others DCP would fall back to a machine-wide sync).
    writer = FsspecWriter(target, sync_files=not is_remote(uri), **storage_options(uri))
    dcp.save(state, storage_writer=writer)
    # dcp.save returns on every rank only after the coordinator wrote .metadata: the step is committed.
    if not dist.is_initialized() or dist.get_rank() == 0:
        purge(uri, keep_last, protect=step)
    return target


def load_checkpoint(uri: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler) -> int:
    """Load step `step` from `uri` into model, optimizer and scheduler (a collective). Returns the step."""
    target = step_uri(uri, step)
    trainer = TrainerState(scheduler)
    dcp.load({"app": ModelOptimState(model, optimizer), "trainer": trainer}, storage_reader=FsspecReader(target, **storage_options(uri)))
    if trainer.step != step:
        raise ValueError(f"checkpoint {target} holds step {trainer.step}, expected {step}")
    return trainer.step
