"""What the engine reads of the SageMaker container contract: the checkpoint location, the model and
output folders (defaults that work outside a job too), the TensorBoard folder and the profiler's steps.

The config files' names are defined here and written by trainyard/container/contract.py (the engine imports
nothing of the container).
"""
from __future__ import annotations

import json
import os

DEFAULT_INPUT_CONFIG_DIR = "/opt/ml/input/config"
CHECKPOINT_CONFIG = "checkpointconfig.json"  # SageMaker's: {"LocalPath", "S3Uri"}
TENSORBOARD_CONFIG = "tensorboardoutputconfig.json"  # SageMaker's: {"LocalPath", "S3OutputPath"}
# SageMaker's {"ProfilingParameters": {"LocalPath", ...}, ...} with Trainyard's "Steps" and "Ranks"
PROFILER_CONFIG = "profilerconfig.json"
# set by the host's driver: a file the engine creates once its first step is done, so that a host whose
# ranks print no step line (the built-in trainer's other hosts: only rank 0 speaks) still times its first step
FIRST_STEP_ENV = "TRAINYARD_FIRST_STEP_FILE"
# at the root of a checkpoint location that the engine writes straight to object storage ({"written_to": uri}):
# the driver's checkpoint sync then leaves its step folders there (te.load_checkpoint reads them from the
# store), instead of copying every kept step to every host's /opt/ml/checkpoints first
DIRECT_CHECKPOINTS = ".trainyard-engine-checkpoints.json"


def _config(name: str, env: dict | None) -> tuple[str, dict | None]:
    """(path, content) of the config file `name` in `$SM_INPUT_CONFIG_DIR`; content None when it is absent."""
    env = os.environ if env is None else env
    path = os.path.join(env.get("SM_INPUT_CONFIG_DIR") or DEFAULT_INPUT_CONFIG_DIR, name)
    if not os.path.exists(path):
        return path, None
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return path, config


def _string(path: str, config: dict, key: str) -> str:
    value = config.get(key) or ""
    if not isinstance(value, str):
        raise ValueError(f"{path}: {key} must be a string, got {value!r}")
    return value


def checkpoint_uri_from_contract(env: dict | None = None) -> str:
    """S3Uri of `$SM_INPUT_CONFIG_DIR/checkpointconfig.json`, or "" when absent."""
    path, config = _config(CHECKPOINT_CONFIG, env)
    return "" if config is None else _string(path, config, "S3Uri")


def tensorboard_dir_from_contract(env: dict | None = None) -> str:
    """LocalPath of `tensorboardoutputconfig.json`: the folder the job's TensorBoard event files go to (the driver
    syncs it to S3); "" when the job asked for none."""
    path, config = _config(TENSORBOARD_CONFIG, env)
    return "" if config is None else _string(path, config, "LocalPath")


def profiler_from_contract(env: dict | None = None) -> dict | None:
    """{"steps", "ranks", "dir"} of `profilerconfig.json`, or None when the job asked for no profiler."""
    path, config = _config(PROFILER_CONFIG, env)
    if config is None:
        return None
    params = config.get("ProfilingParameters") or {}
    steps, ranks = config.get("Steps"), config.get("Ranks")
    for key, value in (("Steps", steps), ("Ranks", ranks)):
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{path}: {key} must be a list of whole numbers, got {value!r}")
    return {"steps": steps, "ranks": ranks, "dir": _string(path, params, "LocalPath")}


def output_data_dir(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("SM_OUTPUT_DATA_DIR") or "."


def model_dir(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("SM_MODEL_DIR") or "model"


def mark_first_step(env: dict | None = None) -> None:
    """Create `$TRAINYARD_FIRST_STEP_FILE` when the driver asked for it (a no-op outside a job)."""
    env = os.environ if env is None else env
    path = env.get(FIRST_STEP_ENV)
    if path and not os.path.exists(path):
        with open(path, "a"):
            pass
