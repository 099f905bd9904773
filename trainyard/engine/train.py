"""The built-in trainer's command line: `[torchrun ...] python -m trainyard.engine.train --steps 20 --model tiny ...`.

Hyperparameters are parsed and checked against the job's distribution before the process group is joined,
so a bad batch or layout fails at once on every rank; then `Trainer` (trainer.py) builds, resumes, trains,
and exports the model unless SIGTERM stopped it.
"""
from __future__ import annotations

import os
import sys

from trainyard.engine import api
from trainyard.engine.config import TrainConfig, parse_hyperparameters, reconcile_distribution
from trainyard.engine.distributed.parallelism import Parallelism
from trainyard.engine.trainer import Trainer


def run(cfg: TrainConfig) -> None:
    try:
        trainer = Trainer(cfg)
        if trainer.run() and cfg.save_model:
            trainer.export()
    finally:
        api.finish()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_hyperparameters(sys.argv[1:] if argv is None else argv)
        reconcile_distribution(cfg, Parallelism.parse(api._job_distribution()), int(os.environ.get("WORLD_SIZE") or 1))
    except ValueError as e:
        print(f"trainyard.engine.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
