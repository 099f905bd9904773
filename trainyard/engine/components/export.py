"""`trainyard checkpoint export URI OUT`: a sharded checkpoint consolidated into one safetensors file.

URI is a checkpoint location (the newest committed step that verifies is taken) or one step's prefix
(`.../step-00000100`). OUT gets `model.safetensors` (every model tensor at full size, under the model's
parameter names, so `Transformer(ModelConfig(**config["model_config"])).load_state_dict(...)` takes it)
and `config.json` (`model_config`, `step`, `source`). It runs in one process, whatever layout saved the
checkpoint: DCP reassembles the shards. Nothing is unpickled; every file read is checked against its
checksum.
"""
from __future__ import annotations

import json
import os
import re

MODEL_PREFIX = "app.model."
MODEL_CONFIG_FILE = "model.json"  # written next to the shards by the save (see checkpoint.py)


def resolve_step(uri: str) -> tuple[str, int]:
    """(step prefix, step) for a checkpoint location or a step prefix."""
    from trainyard.engine.components import checkpoint as ckpt

    match = re.search(rf"/{ckpt.STEP_PREFIX}(\d+)/?$", uri)
    if match:
        return uri.rstrip("/"), int(match.group(1))
    step = ckpt.newest_verified_step(uri)
    if step is None:
        raise ValueError(f"no committed checkpoint under {uri}")
    return ckpt.step_uri(uri, step), step


def export_checkpoint(uri: str, out_dir: str) -> dict:
    """Write OUT/model.safetensors and OUT/config.json; returns the config written."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainyard.engine.components import checkpoint as ckpt
    from trainyard.engine.components.ckpt_io import SafeReader

    step_path, step = resolve_step(uri)
    options = ckpt.storage_options(step_path)
    reader = SafeReader(step_path, **options)
    metadata = reader.read_metadata()
    state = {key[len(MODEL_PREFIX):]: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items()
             if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise ValueError(f"{step_path} holds no model tensors (keys start with {MODEL_PREFIX!r})")
    dcp.load({"app": {"model": state}}, storage_reader=reader, no_dist=True)
    fs, path = ckpt._fs(step_path)
    config_path = f"{path}/{MODEL_CONFIG_FILE}"
    model_config = json.loads(fs.cat(config_path)) if fs.exists(config_path) else None
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
    config = {"model_config": model_config, "step": step, "source": step_path,
              "parameters": sum(v.numel() for v in state.values())}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return config
