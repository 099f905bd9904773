"""Saving and loading checkpoints with torch.distributed.checkpoint (DCP), and `CheckpointManager`: one
location's saves (asynchronous, at most one in flight, or blocking), the wait for them, resume, and the newest
verified step. Damage found on load comes as `CheckpointDamaged` (io.py), typed through DCP's gathered
failures (`damage`)."""
from __future__ import annotations

import functools
import json
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from trainyard.engine.components.checkpoint.io import CheckpointDamaged, SafeReader, VerifiedWriter, verify_step
from trainyard.engine.components.checkpoint.locations import (DEFAULT_KEEP_LAST, check_keep_last,
                                                              committed_steps, filesystem, is_remote, purge, step_uri,
                                                              storage_options)
from trainyard.engine.components.contract import DIRECT_CHECKPOINTS
from trainyard.engine.components.checkpoint.staging import stager
from trainyard.engine.components.checkpoint.state import (SCALER_KEY, holds, saved_model_names, state_of,
                                                          trainable_names, write_model_config)


def save_checkpoint(uri: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None, *, keep_last: int = DEFAULT_KEEP_LAST,
                    extra: dict | None = None, scaler=None, moved: list | None = None,
                    trainable_only: bool = False) -> str:
    """Save synchronously to `<uri>/step-N` (a collective: every rank calls it); then rank 0 purges
    old steps. Returns the step's URI. `scaler`: a float16 run's loss scaler (a Stateful), saved beside. `moved`,
    when given, gets this rank's (bytes written, seconds). `trainable_only`: of the model, the parameters that
    train alone (a fine-tuning run's adapters; the frozen base is loaded from its own files)."""
    check_keep_last(keep_last)
    target = step_uri(uri, step)
    only = trainable_names(model) if trainable_only else None
    state = state_of(model, optimizer, scheduler, step, extra, scaler, only)
    # fsync only makes sense for local files (for others DCP would fall back to a machine-wide sync).
    writer = VerifiedWriter(target, sync_files=not is_remote(uri), **storage_options(uri))
    write_model_config(target, model)
    try:
        dcp.save(state, storage_writer=writer)
    except CheckpointException as e:  # a BaseException, which `except Exception` would miss: the rank's own error
        raise _unwrapped(e, f"checkpoint step {step} to {uri} failed") from e
    if moved is not None:
        moved.append(writer.moved)
    # dcp.save returns on every rank only after the coordinator wrote .metadata: the step is committed.
    if not dist.is_initialized() or dist.get_rank() == 0:
        purge(uri, keep_last, protect=step)
    return target


class AsyncSaver:
    """Saves with at most one in flight: `save()` starts copying the state to host memory in the background (the
    optimizer's next step waits for the copy: the only part the training loop may wait for) and DCP uploads it from
    a background thread, over a process group of its own so that its collectives never interleave with training's.
    When the upload is committed, rank 0 purges old steps from that background thread too. `wait()` finishes the
    save in flight: on failure it reports and returns False (the step was never committed: DCP writes `.metadata`
    last), and the next interval saves again."""

    def __init__(self, uri: str, *, keep_last: int = DEFAULT_KEEP_LAST, say=print) -> None:
        self.uri, self.keep_last, self.say = uri, keep_last, say
        self.distributed = dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.pending: tuple[int, Future] | None = None
        self.failed: list[int] = []
        self.done: tuple[int, int, float] = (0, 0, 0.0)  # the last committed save: step, this rank's bytes, seconds
        self.staging: Future | None = None  # the copy of the state in flight, which the next optimizer step awaits
        self.held = 0.0  # seconds optimizer steps waited for it, not yet taken (`take_held`)
        self._guarded: weakref.WeakSet = weakref.WeakSet()  # the optimizers whose steps await the copy

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler | None, *, extra: dict | None = None,
             scaler=None, trainable_only: bool = False) -> float:
        """Start saving step `step` (a collective); returns the seconds the caller was blocked.

        The state is copied to host memory in the background, in step with the loop: the optimizer's next step
        (the first thing that changes the weights and the optimizer's state) waits for the copy, and counts the
        wait in `held`. A model with persistent buffers (a forward may change them: BatchNorm statistics, an
        expert's bias) is copied before `save` returns; `extra` and a loss scaler's state are new tensors, taken
        when `save` is called."""
        check_keep_last(self.keep_last)
        start = time.perf_counter()
        self.wait()
        only = trainable_names(model) if trainable_only else None
        # what dcp.async_save does, in an order that leaves the loop's thread sooner: all of its own work (the walk
        # of the state, the writer) first, then the copy in the stager's thread, then the upload (dcp.save of the
        # copy) in the finisher's, which outlives the save (async_save starts a thread for every save)
        state = {key: value.state_dict() for key, value in
                 state_of(model, optimizer, scheduler, step, extra, scaler, only).items()}
        writer = VerifiedWriter(step_uri(self.uri, step), sync_files=not is_remote(self.uri),
                                **storage_options(self.uri))
        purges = not self.distributed or dist.get_rank() == 0
        self.staging = self._stager.stage(state)
        self.pending = (step, self._finisher.submit(self._finish, step, self.staging, writer, purges, model))
        if _persistent_buffers(model):
            self.ready()
        elif optimizer not in self._guarded:
            optimizer.register_step_pre_hook(self._before_step)
            self._guarded.add(optimizer)
        return time.perf_counter() - start

    @functools.cached_property
    def _stager(self):
        return stager()

    def ready(self, *, counted: bool = False) -> float:
        """Wait until the state of the save in flight is copied (what may change it, may then); the seconds
        waited, added to `held` when `counted` (an optimizer step's wait; the other callers' own time holds theirs).
        A failed copy is reported by `wait`, with the upload it fails."""
        staging, self.staging = self.staging, None
        if staging is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            staging.result()
        except BaseException as e:  # noqa: BLE001 - the upload fails with it, and `wait` reports that
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
        waited = time.perf_counter() - t0
        if counted:
            self.held += waited
        return waited

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.ready(counted=True)

    def take_held(self) -> float:
        """The seconds optimizer steps waited for copies since the last call."""
        held, self.held = self.held, 0.0
        return held

    @functools.cached_property
    def _finisher(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(1, thread_name_prefix="ckpt-finish")

    def _finish(self, step: int, staging: Future, writer: VerifiedWriter, purges: bool, model: nn.Module) -> None:
        """In the background: upload the copy once it is made; once it is committed, write its model.json (rank 0:
        written here, not before the save, so that a slow or unreachable store never holds the loop) and purge old
        steps (rank 0). A failed purge or model.json is reported and leaves the step committed."""
        dcp.save(staging.result(), storage_writer=writer, process_group=self.group, no_dist=not self.distributed)
        self.done = (step, *writer.moved)
        try:
            write_model_config(step_uri(self.uri, step), model)
        except Exception as e:  # noqa: BLE001 - the step is committed; only `trainyard checkpoint export` needs it
            self.say(f"WARNING: checkpoint step {step}: model.json not written ({e}); the step is committed")
        self.say(f"checkpoint step {step} saved to {step_uri(self.uri, step)}")
        if purges:
            try:
                purge(self.uri, self.keep_last, protect=step)
            except Exception as e:  # noqa: BLE001 - the step is committed whatever the purge does
                self.say(f"WARNING: purging old checkpoints under {self.uri} failed ({e}); the next save retries")

    def in_flight(self) -> bool:
        """Whether this rank's last save is still uploading (or purging)."""
        return self.pending is not None and not self.pending[1].done()

    def wait(self) -> bool:
        """Finish the save in flight, if any; False when it failed (reported)."""
        self.ready()
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
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None, *, extra: dict | None = None,
                    scaler=None, warn=print, moved: list | None = None) -> int:
    """Load step `step` from `uri` into model, optimizer, scheduler, `extra` (filled in place) and `scaler` (a
    collective). Returns the step; `moved`, when given, gets this rank's (bytes read, seconds). A step saved
    without a loss scaler (by a bfloat16 or float32 run) leaves
    `scaler` as it is, said by `warn` on rank 0."""
    target = step_uri(uri, step)
    reader = SafeReader(target, verify=True, **storage_options(uri))
    metadata = reader.read_metadata()  # refuses a checkpoint with pickled entries here, with its own error
    state = state_of(model, optimizer, scheduler, 0, extra, scaler, _saved_part(model, metadata, target, warn),
                     optim_saved=holds(metadata, "app.optim"))
    trainer = state["trainer"]
    if scaler is not None and not holds(metadata, SCALER_KEY):
        del state[SCALER_KEY]
        if not dist.is_initialized() or dist.get_rank() == 0:
            warn(f"checkpoint step {step} at {uri} holds no loss-scaler state (saved by a run without float16): "
                 f"the loss scaling starts afresh ({scaler!r})")
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as e:  # a BaseException: what failed on the ranks, by type
        found = found_damage(e)
        if found is not None:
            raise CheckpointDamaged(str(found)) from e
        raise _unwrapped(e, f"checkpoint step {step} at {uri} could not be loaded") from e
    if moved is not None:
        moved.append(reader.moved)
    if trainer.step != step:
        raise ValueError(f"checkpoint {target} holds step {trainer.step}, expected {step}")
    return trainer.step


def _saved_part(model: nn.Module, metadata, target: str, warn) -> set[str] | None:
    """The model entries to load from a step: None (all) when it holds every parameter; those it holds when it was
    saved with trainable_only and holds every parameter that trains here (the others keep their weights, said on
    rank 0). A step of another model is refused, naming what differs: a shape, a trainable parameter it lacks, or a
    parameter it trained that is frozen here."""
    saved, names = saved_model_names(metadata), {n for n, _ in model.named_parameters()}
    resized = [(n, tuple(size), tuple(p.shape)) for n, p in model.named_parameters()
               if (size := getattr(metadata.state_dict_metadata.get(f"app.model.{n}"), "size", None)) is not None
               and tuple(size) != tuple(p.shape)]
    if resized:  # not damage: the step is whole, and another model's (told apart here, before DCP's size check)
        name, theirs, ours = resized[0]
        raise ValueError(f"checkpoint {target} holds {name} of shape {list(theirs)} where this model's is {list(ours)}"
                         f"{f' ({len(resized) - 1} more differ)' if len(resized) > 1 else ''}: it was saved from "
                         "another model or with other adapters (another lora_r?); resume from a checkpoint of this "
                         "model, or give this job another checkpoint location")
    if names <= saved:
        return None
    trainable = trainable_names(model)
    missing = sorted(trainable - saved)
    if missing:
        raise ValueError(f"checkpoint {target} holds no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                         f"({len(missing)} trainable parameters of this model): it was saved from another model or "
                         "with other adapters; resume from a checkpoint of this model")
    # a step of the trainable parameters alone: what it holds trained there, and must not land in frozen weights
    frozen = sorted((saved & names) - trainable)
    if frozen:
        raise ValueError(f"checkpoint {target} holds trained values of {', '.join(frozen[:3])}"
                         f"{' ...' if len(frozen) > 3 else ''} ({len(frozen)} parameters frozen in this model): it was "
                         "saved with other adapters or bias settings (LoraConfig's bias, modules_to_save); resume with "
                         "the settings it was saved with, or from a checkpoint of this model")
    if not dist.is_initialized() or dist.get_rank() == 0:
        warn(f"checkpoint {target} holds the trainable parameters only ({len(names & saved)} of {len(names)}): the "
             "others keep the weights they have (the base model's, loaded before)")
    return saved


def resume(uri: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
           scheduler: torch.optim.lr_scheduler.LRScheduler | None, warn=print, *, extra: dict | None = None,
           scaler=None, moved: list | None = None) -> int | None:
    """Load the newest committed step under `uri` that verifies (a collective); None when there is none.

    Each data file is checked against its manifest as it is read, so damage anywhere fails the load on
    every rank; the step is then skipped with a warning naming it and the one before is loaded (which
    overwrites whatever the failed attempt had loaded). If committed steps exist but none loads, this
    raises rather than let training start from half-loaded weights. A failure that is not damage (the store
    unreachable after the retries, a step of another model) is raised as it is: a whole step is never skipped
    for a broken connection."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    problems = []
    for step in committed_steps(uri):
        try:
            return load_checkpoint(uri, step, model, optimizer, scheduler, extra=extra, scaler=scaler, warn=warn,
                                   moved=moved)
        except CheckpointDamaged as e:
            problem = damage(e)
            problems.append(f"step {step}: {problem}")
            if rank == 0:
                warn(f"WARNING: checkpoint step {step} at {uri} is damaged and is skipped: {problem}")
    if problems:
        raise CheckpointDamaged(f"no committed checkpoint under {uri} could be loaded ({'; '.join(problems)}); "
                                "move the damaged steps away to start from scratch")
    return None


def damage(e: CheckpointDamaged | CheckpointException) -> str:
    """What failed in a load, from its exception's types (never its text): this rank's CheckpointDamaged, or
    the first CheckpointDamaged that DCP gathered from any rank into its CheckpointException, else the first
    rank's failure as `Type: message`."""
    if isinstance(e, CheckpointDamaged):
        return str(e)
    found = found_damage(e)
    if found is not None:
        return str(found)
    failure = first_failure(e)
    return f"{type(failure).__name__}: {failure}" if failure is not None else type(e).__name__


def found_damage(e: CheckpointException) -> CheckpointDamaged | None:
    """The first CheckpointDamaged DCP gathered from any rank, or None: the step's files are not known bad."""
    return next((exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointDamaged)), None)


def first_failure(e: CheckpointException) -> BaseException | None:
    """The lowest rank's failure DCP gathered."""
    return e.failures[min(e.failures)][0] if e.failures else None


def _unwrapped(e: CheckpointException, what: str) -> Exception:
    """The error to raise for DCP's CheckpointException: the lowest rank's own failure (an OSError, a botocore
    error, ...), else a RuntimeError saying `what` and why."""
    failure = first_failure(e)
    return failure if isinstance(failure, Exception) else RuntimeError(f"{what}: {damage(e)}")


def newest_verified_step(uri: str, warn=print) -> int | None:
    """The newest committed step under `uri` whose files verify (a collective when distributed: the ranks
    share the reading). Damaged steps are skipped with a warning (`warn`, on rank 0) naming them."""
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    for step in committed_steps(uri):
        try:
            verify_step(step_uri(uri, step), storage_options(uri), rank=rank, world=world)
            problem = ("", "")
        except (CheckpointDamaged, ValueError) as e:
            problem = ("damaged", str(e) or type(e).__name__)
        except OSError as e:  # the store, not the step (a missing file is CheckpointDamaged): never skipped for it
            problem = ("unreadable", f"{type(e).__name__}: {e}")
        if distributed:  # every rank decides alike: an unreadable step on any rank first, then damage on any
            gathered: list = [None] * world
            dist.all_gather_object(gathered, problem)
            problem = min((p for p in gathered if p[0]), key=lambda p: p[0] != "unreadable", default=("", ""))
        kind, text = problem
        if not kind:
            return step
        if kind == "unreadable":
            raise OSError(f"checkpoint step {step} at {uri} could not be read ({text}); it is not known to be "
                          "damaged, so it is not skipped: try again when the store answers")
        if rank == 0:
            warn(f"WARNING: checkpoint step {step} at {uri} is damaged and is skipped: {text}")
    return None


def mark_direct(uri: str, say=print) -> None:
    """Say at the root of an object-storage location that the engine writes its steps there itself (rank 0,
    once per process and location; `contract.DIRECT_CHECKPOINTS`): the driver's checkpoint sync then leaves
    them in the store. Not for a folder: one under /opt/ml/checkpoints reaches the store through the sync,
    and its steps must come back through it. A mark that cannot be written only costs that download."""
    if not is_remote(uri) or uri in _MARKED or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _MARKED.add(uri)
    try:
        fs, path = filesystem(uri)
        fs.pipe_file(f"{path.rstrip('/')}/{DIRECT_CHECKPOINTS}", json.dumps({"written_to": uri}).encode())
    except Exception as e:  # noqa: BLE001 - the save goes on; a later sync restores the steps as well
        say(f"WARNING: {uri}/{DIRECT_CHECKPOINTS} not written ({type(e).__name__}: {e}); the save goes on")


_MARKED: set[str] = set()


def _persistent_buffers(model: nn.Module) -> bool:
    """Whether the model's state holds buffers (a forward may change them, where only an optimizer step changes
    parameters)."""
    return any(name not in m._non_persistent_buffers_set for m in model.modules() for name in m._buffers)


class CheckpointManager:
    """One checkpoint location's saves and loads: `save` (asynchronous unless `blocking`; at most one in
    flight), `wait` (the save in flight; False when it failed and was not committed), `busy` (whether that upload is
still in flight on any rank), `resume` (the newest
    verified step, loaded), `newest_verified` (its number, nothing loaded), `take_io` (each finished save's and
    load's bytes and GB/s per rank)."""

    def __init__(self, uri: str, *, keep_last: int = DEFAULT_KEEP_LAST, say=print) -> None:
        self.uri, self.keep_last, self.say = uri, keep_last, say
        self._saver: AsyncSaver | None = None
        self._group = None  # a gloo group of the manager's own gathers (made by the first; uploads use the saver's)
        self._reported = 0  # the last asynchronous save whose figures are in `io`
        self.io: list[dict] = []  # the saves and loads finished and gathered from every rank, not yet taken

    def _gather(self, values: list[float]) -> list[list[float]]:
        """`values` from every rank, in rank order (a collective)."""
        if not dist.is_initialized():
            return [values]
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        mine = torch.tensor(values, dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine, group=self._group)
        return [t.tolist() for t in every]

    def _record(self, op: str, step: int, moved: list[list[float]]) -> None:
        """One save's or load's figures: each rank's bytes and GB/s."""
        self.io.append({"op": op, "step": step, "bytes_per_rank": [int(b) for b, _ in moved],
                        "gbps_per_rank": [round(b / s / 1e9, 4) if s > 0 else 0.0 for b, s in moved]})

    def take_io(self) -> list[dict]:
        """The figures of the saves and loads recorded since the last call (each rank's bytes and GB/s)."""
        taken, self.io = self.io, []
        return taken

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, *, extra: dict | None = None,
             scaler=None, blocking: bool = False, trainable_only: bool = False) -> float:
        """Save step `step` (a collective); returns the seconds the caller was blocked."""
        check_keep_last(self.keep_last)  # before anything is written, the location's mark included
        if blocking:
            t0 = time.perf_counter()
            self.wait()
            mark_direct(self.uri, self.say)
            moved: list = []
            save_checkpoint(self.uri, step, model, optimizer, scheduler, keep_last=self.keep_last, extra=extra,
                            scaler=scaler, moved=moved, trainable_only=trainable_only)
            blocked = time.perf_counter() - t0
            self._record("save", step, self._gather(list(moved[0])))
            return blocked
        if self._saver is None:
            mark_direct(self.uri, self.say)
            self._saver = AsyncSaver(self.uri, keep_last=self.keep_last, say=self.say)
        self._saver.keep_last = self.keep_last  # the save's own keep_last, as a blocking save has it
        return self._saver.save(step, model, optimizer, scheduler, extra=extra, scaler=scaler,
                                trainable_only=trainable_only)

    def wait(self) -> bool:
        return True if self._saver is None else self._saver.wait()

    def ready(self) -> float:
        """Wait for this location's background copy of the state, if one is in flight (`AsyncSaver.ready`)."""
        return 0.0 if self._saver is None else self._saver.ready()

    def take_held(self) -> float:
        """The seconds optimizer steps waited for this location's background copies since the last call."""
        return 0.0 if self._saver is None else self._saver.take_held()

    def busy(self) -> bool:
        """Whether the last asynchronous save is still uploading on any rank (a collective once this location
        has saved asynchronously; before that False everywhere): a save due now would wait for it. The same
        gather records the figures of an upload that every rank has finished."""
        if self._saver is None:
            return False
        step, size, seconds = self._saver.done
        every = self._gather([float(self._saver.in_flight()), step, size, seconds])
        if all(int(r[1]) == step for r in every) and step > self._reported:
            self._reported = step
            self._record("save", step, [r[2:] for r in every])
        return any(r[0] for r in every)

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, *, extra: dict | None = None,
               scaler=None, warn=print) -> int | None:
        self.wait()
        moved: list = []
        step = resume(self.uri, model, optimizer, scheduler, warn, extra=extra, scaler=scaler, moved=moved)
        if step is not None:
            self._record("load", step, self._gather(list(moved[-1])))
        return step

    def newest_verified(self, warn=print) -> int | None:
        self.wait()
        return newest_verified_step(self.uri, warn)
