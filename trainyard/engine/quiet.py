"""Torch's (and its libraries') notes that say nothing about the user's job, hidden by default: the one list, each
with why.

`quiet()` is called by `trainyard.engine.init()` (so by the built-in trainer and every script that uses the
engine API) and by the `trainyard` command line. It hides exactly the entries below, matched by their
message text (torch's own words, which a user's warning does not repeat), and nothing else: a user's own
warnings, and any torch warning not listed, still show. `TRAINYARD_VERBOSE=1` in the environment (for a job:
`environment={"TRAINYARD_VERBOSE": "1"}`; on the command line: `trainyard --verbose ...`) shows them all.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

VERBOSE_ENV = "TRAINYARD_VERBOSE"


@dataclass(frozen=True, slots=True)
class Harmless:
    message: str
    """A regex matched at the start of the message."""
    why: str
    """Why the user loses nothing by not seeing it."""
    category: type[Warning] | None = None
    """For a `warnings.warn` message; None for a record of a torch logger."""
    logger: str | None = None
    """The torch logger that emits it (records of other loggers are left alone)."""


HARMLESS: tuple[Harmless, ...] = (
    Harmless(
        category=UserWarning,
        message=r"Slicing a flattened dim from root mesh will be deprecated",
        why="ParallelDims takes the flattened `dp_shard` (and the 2-D `dp_replicate, dp_shard`) dimension from "
            "the root mesh, which torch 2.13 (the pinned version) supports; the notice is about a future "
            "torch, and the 2-D slice has no other public form yet",
    ),
    Harmless(
        logger="torch.distributed.tensor._redistribute",
        message=r"While redistributing from",
        why="DTensor says that a redistribution (the grad-norm reduction, a checkpoint gather) runs as several "
            "collectives instead of one merged collective: a note on speed for tiny, unevenly divisible "
            "tensors; the result is the same",
    ),
    Harmless(
        category=UserWarning,
        message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
                r"load in a single process",
        why="`trainyard checkpoint export` and single-process loads read a sharded checkpoint in one process on "
            "purpose; that is what the message assumes",
    ),
    Harmless(
        category=FutureWarning,
        message=r"`is_gradient_checkpointing` is deprecated",
        why="peft reads the model's `is_gradient_checkpointing`, which transformers 5 deprecated for "
            "`is_activation_checkpointing`: a note to peft's authors, in every LoRA job's log, that no code or "
            "setting of the user's causes",
    ),
)


class _DropHarmless(logging.Filter):
    def __init__(self, patterns: list[re.Pattern]):
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not any(p.match(text) for p in self.patterns)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def quiet(show_all: bool | None = None) -> None:
    """Hide the `HARMLESS` notes in this process (unless `show_all`, default: `TRAINYARD_VERBOSE`)."""
    if verbose() if show_all is None else show_all:
        return
    by_logger: dict[str, list[re.Pattern]] = {}
    for h in HARMLESS:
        if h.category is not None:
            warnings.filterwarnings("ignore", message=h.message, category=h.category)
        else:
            by_logger.setdefault(h.logger, []).append(re.compile(h.message, re.DOTALL))
    for name, patterns in by_logger.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) for f in log.filters):
            log.addFilter(_DropHarmless(patterns))
