"""What the engine reads of the SageMaker container contract: the checkpoint location, the model and
output folders (defaults that work outside a job too)."""
from __future__ import annotations

import json
import os

DEFAULT_INPUT_CONFIG_DIR = "/opt/ml/input/config"


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


