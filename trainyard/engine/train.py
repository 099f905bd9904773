"""The built-in trainer's command line: `[torchrun ...] python -m trainyard.engine.train --steps 20 --model tiny ...`.

Hyperparameters are parsed and checked against the job's distribution before the process group is joined,
so a bad batch or layout fails at once on every rank; then `Trainer` (trainer.py) builds, resumes, trains,
and exports the model unless SIGTERM stopped it.
"""
from __future__ import annotations

import os
import sys

from trainyard.engine import api
from trainyard.engine.components.process_exit import exit_now
from trainyard.engine.config import TrainConfig, parse_hyperparameters, reconcile_distribution
from trainyard.engine.trainer import Trainer


def load_config(argv: list[str]) -> TrainConfig:
    """The trainer's configuration, read once: the hyperparameters reconciled with the job's distribution."""
    return reconcile_distribution(parse_hyperparameters(argv), api.job_parallelism(),
                                  int(os.environ.get("WORLD_SIZE") or 1))


def run(cfg: TrainConfig) -> None:
    """Train with `cfg` (from `load_config`), then export the model unless SIGTERM stopped it."""
    try:
        trainer = Trainer(cfg)
        if trainer.run() and cfg.save_model:
            trainer.export()
    finally:
        api.finish()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"trainyard.engine.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    run(cfg)
    return 0


if __name__ == "__main__":
    exit_now(main())  # after the exit handlers, without the interpreter's teardown (components/process_exit.py)
