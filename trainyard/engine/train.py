"""The built-in trainer's command line: `[torchrun ...] python -m trainyard.engine.train --steps 20 --model tiny ...`.

Hyperparameters are parsed and checked against the job's distribution before the process group is joined,
so a bad batch or layout fails at once on every rank; then `Trainer` (trainer.py) builds, resumes, trains,
and exports the model unless SIGTERM stopped it.
"""
from __future__ import annotations

import gc
import os
import sys

if __name__ == "__main__":  # a process of its own: its imports' objects all live on, as in the preload server
    gc.disable()            # (container/preload.py), so no collection runs while they are made; frozen before main

from trainyard.engine import api  # noqa: E402
from trainyard.engine.components.process_exit import exit_now  # noqa: E402
from trainyard.engine.config import TrainConfig, parse_hyperparameters, reconcile_distribution  # noqa: E402
from trainyard.engine.trainer import Trainer  # noqa: E402
from trainyard.parallel.parallelism import Parallelism  # noqa: E402


def load_config(argv: list[str]) -> tuple[TrainConfig, Parallelism]:
    """The trainer's configuration and the job's layout, each read once: the hyperparameters reconciled with the
    job's distribution (`TRAINYARD_DISTRIBUTION`, parsed here and nowhere else in the process)."""
    par = api.job_parallelism()
    return reconcile_distribution(parse_hyperparameters(argv), par, int(os.environ.get("WORLD_SIZE") or 1)), par


def run(cfg: TrainConfig, parallelism: Parallelism | None = None) -> None:
    """Train with `cfg` on `parallelism` (both from `load_config`), then export the model unless SIGTERM stopped
    it."""
    try:
        trainer = Trainer(cfg, parallelism)
        if trainer.run() and cfg.save_model:
            trainer.export()
    finally:
        api.finish()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, parallelism = load_config(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"trainyard.engine.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    run(cfg, parallelism)
    return 0


if __name__ == "__main__":
    gc.freeze()  # what the imports made is never traversed again (a full collection: 0.16 s on the CI machine)
    gc.enable()
    exit_now(main())  # after the exit handlers, without the interpreter's teardown (components/process_exit.py)
