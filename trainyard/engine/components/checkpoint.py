"""Checkpoints with torch.distributed.checkpoint (DCP) to an fsspec URI: `s3://bucket/prefix` or a path.

Layout: one prefix per step, `<uri>/step-00000100/`, holding per rank `rank-NNNNN/__<rank>_0.distcp` (safetensors) and
its checksum manifest `rank-NNNNN/__<rank>.checksums.json`, the model's shape `model.json`, and a
`.metadata` object that DCP's coordinator writes last (to `.metadata.tmp`, then renamed). `.metadata`
is the commit marker: a step without it is an interrupted save and is never loaded. Resume (`resume`)
lists the `step-*` prefixes (there is no pointer file to trust), loads the newest committed one while
checking every file it reads against its manifest, and on damage falls back to the one before, with a
warning naming the damaged step.

The saved state is one dict of tensors: {"app": model + optimizer (get_state_dict, sharded as
DTensors, so a load reshards to another process count; optimizer settings such as lr and betas packed
as float64 tensors), "trainer": step and LR-scheduler state as tensors}. Nothing is pickled, and a
checkpoint that holds pickled entries is refused before anything of it is read.
"""
from __future__ import annotations

import functools
import json
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from trainyard.engine.components.ckpt_io import CheckpointDamaged, SafeReader, VerifiedWriter, verify_step

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
    check_location_form(uri)


def check_location_form(uri: str, *, relative: bool = True) -> None:
    """ValueError unless `uri` is `s3://bucket/...`, `file:///...` or a path (no I/O): `s3:/b` (one slash),
    `http://` and other schemes are mistakes. `relative=False`: a relative path is one too (in a job it would land
    in the job's code folder)."""
    if uri.startswith(("s3://", "file:///")):
        return
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    if scheme:
        hint = " (two slashes after s3:)" if scheme[1].lower() in ("s3", "file") else ""
        raise ValueError(f"checkpoint uri {uri!r}: not a checkpoint location; use s3://bucket/prefix{hint}, "
                         "file:///absolute/path or an absolute path")
    if not relative and not uri.startswith("/"):
        raise ValueError(f"checkpoint uri {uri!r} is a relative path, which in a job lands in its code folder; use "
                         "s3://bucket/prefix, file:///absolute/path or an absolute path")


def storage_options(uri: str) -> dict[str, Any]:
    """fsspec options for `uri`: the S3 endpoint, and the keys when the environment has them, named explicitly,
    so that fsspec's instance cache never hands out a filesystem bound to another endpoint or other keys (it
    keys instances by these options)."""
    if not uri.startswith("s3://"):
        return {}
    # botocore's "standard" retries: throttling (503 SlowDown), 5xx and dropped connections, with
    # backoff, on top of s3fs's own retries of the errors it knows
    options: dict[str, Any] = {"config_kwargs": {"retries": {"max_attempts": 10, "mode": "standard"}}}
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        options.update(key=os.environ["AWS_ACCESS_KEY_ID"], secret=os.environ.get("AWS_SECRET_ACCESS_KEY"))
        if os.environ.get("AWS_SESSION_TOKEN"):
            options["token"] = os.environ["AWS_SESSION_TOKEN"]
    return options


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
        if steps[step]:  # uncommit first: a purge cut short leaves an ignored prefix, never a damaged step
            fs.rm(f"{path}/{COMMIT_MARKER}")
        fs.rm(path, recursive=True)
    fs.invalidate_cache()
    return sorted(doomed)


# Optimizer state keyed by parameter name, param-group settings included ("param_groups.<name>.lr"):
# with pipeline parallelism every rank holds different parameters, and a nested "param_groups" list
# would be one key that DCP saves once, from one rank, for all of them.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelOptimState(Stateful):
    """Model and optimizer through DCP's state-dict API (FSDP2-aware, reshards on load)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:  # loading weights only: the model's entries alone are requested
            return {"model": get_model_state_dict(self.model, options=_OPTIONS)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        return {"model": model_sd, "optim": to_tensors(optim_sd)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"], options=_OPTIONS)
            return
        _, template = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=from_tensors(state_dict["optim"], template), options=_OPTIONS)


_GROUP_PREFIX = "param_groups."


def to_tensors(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat optimizer state dict as tensors only. The settings DCP repeats for every parameter
    (`param_groups.<name>.lr`, `.betas`, ...) are packed into one float64 vector per parameter, in the
    sorted order of their names (float64 holds the float32/float64 settings, integers and booleans
    exactly); None settings are left out. Other values are already tensors."""
    out: dict[str, Any] = {}
    packs: dict[str, list[tuple[str, Any]]] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            out[key] = value
        elif key.startswith(_GROUP_PREFIX):
            name, setting = key.rsplit(".", 1)
            if value is not None:
                packs.setdefault(name, []).append((setting, value))
        else:
            raise TypeError(f"checkpoint state {key!r} is a {type(value).__name__}; only tensors are saved")
    for name, settings in packs.items():
        numbers: list[float] = []
        for setting, value in sorted(settings):
            items = value if isinstance(value, (tuple, list)) else (value,)
            if not all(isinstance(v, (bool, int, float)) for v in items):
                raise TypeError(f"optimizer setting {name}.{setting} = {value!r} is not numeric")
            numbers.extend(float(v) for v in items)
        out[name] = torch.tensor(numbers, dtype=torch.float64)
    return out


def from_tensors(loaded: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """Undo `to_tensors`, giving each setting the Python type it has in `template` (the live state)."""
    out = {k: loaded.get(k, v) for k, v in template.items() if not k.startswith(_GROUP_PREFIX)}
    groups: dict[str, list[tuple[str, Any]]] = {}
    for key, value in template.items():
        if key.startswith(_GROUP_PREFIX):
            name, setting = key.rsplit(".", 1)
            groups.setdefault(name, []).append((setting, value))
    for name, settings in groups.items():
        values = iter(loaded[name].tolist()) if name in loaded else None
        for setting, value in sorted(settings, key=lambda kv: kv[0]):
            key = f"{name}.{setting}"
            if value is None or values is None:
                out[key] = value
            elif isinstance(value, (tuple, list)):
                out[key] = type(value)(type(t)(next(values)) for t in value)
            else:
                out[key] = type(value)(next(values))
    return out


class TrainerState(Stateful):
    """The step number and the LR scheduler's numeric state, stored as tensors.

    Scheduler entries that are numbers or lists of numbers become float64 tensors (exact for the
    integers and float32/float64 values involved); others (e.g. LambdaLR's lr_lambdas) are not saved.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler | None, step: int = 0) -> None:
        self.scheduler, self.step = scheduler, step

    def _numeric_items(self) -> dict[str, Any]:
        out = {}
        if self.scheduler is None:
            return out
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
        if self.scheduler is None:
            return
        current = self.scheduler.state_dict()
        for key, tensor in state_dict["scheduler"].items():
            template = current[key]
            if isinstance(template, list):
                current[key] = [type(t)(v) for t, v in zip(template, tensor.tolist())]
            else:
                current[key] = type(template)(tensor.item())
        self.scheduler.load_state_dict(current)


class ExtraState(Stateful):
    """A user's extra values (numbers or tensors) under their keys; a load fills the given dict in place,
    each value back in the type it has there."""

    def __init__(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if not isinstance(value, (torch.Tensor, bool, int, float)):
                raise TypeError(f"extra[{key!r}] is a {type(value).__name__}; checkpoints hold numbers and tensors")
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return {k: v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)
                for k, v in self.values.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, loaded in state_dict.items():
            template = self.values[key]
            self.values[key] = loaded if isinstance(template, torch.Tensor) else type(template)(loaded.item())


def _state(model, optimizer, scheduler, step: int, extra: dict | None) -> dict[str, Stateful]:
    state: dict[str, Stateful] = {"app": ModelOptimState(model, optimizer), "trainer": TrainerState(scheduler, step)}
    if extra:
        state["extra"] = ExtraState(extra)
    return state


def _write_model_config(target: str, model: nn.Module) -> None:
    """`<step>/model.json`: the model's shape, for `trainyard checkpoint export` (rank 0, before the save,
    so a committed step has it)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or (dist.is_initialized() and dist.get_rank() != 0):
        return
    fs, path = _fs(target)
    fs.makedirs(path, exist_ok=True)  # local paths; a no-op on object stores
    fs.pipe_file(f"{path}/model.json", json.dumps(config.to_dict(), indent=1).encode())


def save_checkpoint(uri: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None, *, keep_last: int = DEFAULT_KEEP_LAST,
                    extra: dict | None = None) -> str:
    """Save synchronously to `<uri>/step-N` (a collective: every rank calls it); then rank 0 purges
    old steps. Returns the step's URI."""
    target = step_uri(uri, step)
    state = _state(model, optimizer, scheduler, step, extra)
    # fsync only makes sense for local files (for others DCP would fall back to a machine-wide sync).
    writer = VerifiedWriter(target, sync_files=not is_remote(uri), **storage_options(uri))
    _write_model_config(target, model)
    dcp.save(state, storage_writer=writer)
    # dcp.save returns on every rank only after the coordinator wrote .metadata: the step is committed.
    if not dist.is_initialized() or dist.get_rank() == 0:
        purge(uri, keep_last, protect=step)
    return target


class AsyncSaver:
    """Saves with at most one in flight: `save()` stages the state to host memory (the only part the
    training loop waits for) and DCP uploads it from a background thread, over a process group of its
    own so that its collectives never interleave with training's. When the upload is committed, rank 0
    purges old steps from that background thread too. `wait()` finishes the save in flight: on failure
    it reports and returns False (the step was never committed: DCP writes `.metadata` last), and the
    next interval saves again."""

    def __init__(self, uri: str, *, keep_last: int = DEFAULT_KEEP_LAST, say=print) -> None:
        self.uri, self.keep_last, self.say = uri, keep_last, say
        self.distributed = dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.pending: tuple[int, Future] | None = None
        self.failed: list[int] = []

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler | None, *, extra: dict | None = None) -> float:
        """Start saving step `step` (a collective); returns the seconds the caller was blocked."""
        start = time.perf_counter()
        self.wait()
        state = _state(model, optimizer, scheduler, step, extra)
        writer = VerifiedWriter(step_uri(self.uri, step), sync_files=not is_remote(self.uri),
                                **storage_options(self.uri))
        try:  # only rank 0 writes it: a failure here must not keep it out of the collective save
            _write_model_config(step_uri(self.uri, step), model)
        except OSError as e:
            self.say(f"WARNING: checkpoint step {step}: model.json not written ({e}); the save goes on")
        upload = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                no_dist=not self.distributed)
        upload = getattr(upload, "upload_completion", upload)
        purges = not self.distributed or dist.get_rank() == 0
        self.pending = (step, self._finisher.submit(self._finish, step, upload, purges))
        return time.perf_counter() - start

    @functools.cached_property
    def _finisher(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(1, thread_name_prefix="ckpt-finish")

    def _finish(self, step: int, upload, purges: bool) -> None:
        """In the background: wait for the upload; once it is committed, purge old steps (rank 0). A failed
        purge is reported and leaves the steps for the next one."""
        upload.result()
        self.say(f"checkpoint step {step} saved to {step_uri(self.uri, step)}")
        if purges:
            try:
                purge(self.uri, self.keep_last, protect=step)
            except Exception as e:  # noqa: BLE001 - the step is committed whatever the purge does
                self.say(f"WARNING: purging old checkpoints under {self.uri} failed ({e}); the next save retries")

    def wait(self) -> bool:
        """Finish the save in flight, if any; False when it failed (reported)."""
        if self.pending is None:
            return True
        step, finished = self.pending
        self.pending = None
        try:
            finished.result()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self.failed.append(step)
            self.say(f"WARNING: checkpoint step {step} to {self.uri} failed and was not committed; the next "
                     f"interval saves again: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}")
            return False
        return True


def load_checkpoint(uri: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None, *, extra: dict | None = None) -> int:
    """Load step `step` from `uri` into model, optimizer, scheduler and `extra` (filled in place; a
    collective). Returns the step."""
    target = step_uri(uri, step)
    state = _state(model, optimizer, scheduler, 0, extra)
    trainer = state["trainer"]
    reader = SafeReader(target, verify=True, **storage_options(uri))
    reader.read_metadata()  # refuses a checkpoint with pickled entries here, with its own error
    dcp.load(state, storage_reader=reader)
    if trainer.step != step:
        raise ValueError(f"checkpoint {target} holds step {trainer.step}, expected {step}")
    return trainer.step


def resume(uri: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
           scheduler: torch.optim.lr_scheduler.LRScheduler | None, warn=print, *, extra: dict | None = None) -> int | None:
    """Load the newest committed step under `uri` that verifies (a collective); None when there is none.

    Each data file is checked against its manifest as it is read, so damage anywhere fails the load on
    every rank; the step is then skipped with a warning naming it and the one before is loaded (which
    overwrites whatever the failed attempt had loaded). If committed steps exist but none loads, this
    raises rather than let training start from half-loaded weights."""
    from torch.distributed.checkpoint.api import CheckpointException

    rank = dist.get_rank() if dist.is_initialized() else 0
    steps = sorted((s for s, ok in list_steps(uri).items() if ok), reverse=True) if rank == 0 else []
    if dist.is_initialized():
        box = [steps]
        dist.broadcast_object_list(box, src=0)
        steps = box[0]
    problems = []
    for step in steps:
        try:
            return load_checkpoint(uri, step, model, optimizer, scheduler, extra=extra)
        except (CheckpointDamaged, CheckpointException) as e:
            text = str(e)
            found = [line for line in text.splitlines() if "CheckpointDamaged" in line or "step-" in line]
            problem = (found[-1] if found else text.strip().splitlines()[-1]).split("CheckpointDamaged: ")[-1]
            problems.append(f"step {step}: {problem}")
            if rank == 0:
                warn(f"WARNING: checkpoint step {step} at {uri} is damaged and is skipped: {problem}")
    if problems:
        raise CheckpointDamaged(f"no committed checkpoint under {uri} could be loaded ({'; '.join(problems)}); "
                                "move the damaged steps away to start from scratch")
    return None


def newest_verified_step(uri: str, warn=print) -> int | None:
    """The newest committed step under `uri` whose files verify (a collective when distributed: the ranks
    share the reading). Damaged steps are skipped with a warning (`warn`, on rank 0) naming them."""
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    steps = sorted((s for s, ok in list_steps(uri).items() if ok), reverse=True) if rank == 0 else []
    if distributed:
        box = [steps]
        dist.broadcast_object_list(box, src=0)
        steps = box[0]
    for step in steps:
        try:
            verify_step(step_uri(uri, step), storage_options(uri), rank=rank, world=world)
            problem = ""
        except (CheckpointDamaged, OSError, ValueError) as e:
            problem = str(e) or type(e).__name__
        if distributed:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, problem)
            problem = next((p for p in gathered if p), "")
        if not problem:
            return step
        if rank == 0:
            warn(f"WARNING: checkpoint step {step} at {uri} is damaged and is skipped: {problem}")
    return None
