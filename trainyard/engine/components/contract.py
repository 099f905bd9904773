"""What the engine reads of the SageMaker container contract: the checkpoint location, the model and
output folders (defaults that work outside a job too)."""
from __future__ import annotations

import json
import os

DEFAULT_INPUT_CONFIG_DIR = "/opt/ml/input/config"
# set by the host's driver: a file the engine creates once its first step is done, so that a host whose
# ranks print no step line (the built-in trainer's other hosts: only rank 0 speaks) still times its first step
FIRST_STEP_ENV = "TRAINYARD_FIRST_STEP_FILE"


def checkpoint_uri_from_contract(env: dict | None = None) -> str:
    """S3Uri of `$SM_INPUT_CONFIG_DIR/checkpointconfig.json`, or "" when absent."""
    env = os.environ if env is None else env
    path = os.path.join(env.get("SM_INPUT_CONFIG_DIR") or DEFAULT_INPUT_CONFIG_DIR, "checkpointconfig.json")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    uri = config.get("S3Uri") or ""
    if not isinstance(uri, str):
        raise ValueError(f"{path}: S3Uri must be a string, got {uri!r}")
    return uri


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
