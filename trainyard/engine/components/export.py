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


# what the errors say a valid URI looks like
VALID = ("a checkpoint location, 's3://bucket/prefix' (the job's checkpoint_s3_uri) or a local folder, or one "
         "step in it ('.../step-00000100')")


def check_location(uri: object) -> str:
    """`uri` as a location to read from, or ValueError saying what is wrong with it and what a valid one
    looks like: a malformed `s3:` URI, a bucket that does not exist, a local path that does not exist."""
    from trainyard.engine.components import checkpoint as ckpt

    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"checkpoint URI {uri!r} is empty; give {VALID}")
    scheme, sep, rest = uri.partition("://")
    if not sep and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", uri) and not os.path.exists(uri):  # `s3:/b`, `s3:b`
        scheme = uri.split(":", 1)[0]
        raise ValueError(f"{uri!r} is not a valid URI: write {scheme}://, two slashes after the scheme "
                         f"(e.g. '{scheme}://{uri.split(':', 1)[1].lstrip('/') or 'bucket/prefix'}'); give {VALID}")
    if sep and scheme not in ("s3", "file"):
        raise ValueError(f"{uri!r}: scheme {scheme}:// is not supported; give {VALID}")
    if scheme == "s3" and sep:
        bucket = rest.split("/", 1)[0]
        if not bucket:
            raise ValueError(f"{uri!r} names no bucket; give {VALID}")
        ckpt.validate_uri(uri)  # the bucket exists (ValueError naming it and AWS_ENDPOINT_URL otherwise)
        return uri
    path = rest if sep else uri
    if not os.path.exists(path):
        raise ValueError(f"{uri!r} does not exist on this machine; give {VALID}")
    return uri


def resolve_step(uri: str) -> tuple[str, int]:
    """(step prefix, step) for a checkpoint location or a step prefix; ValueError saying what is wrong
    with a malformed or missing location, or one that holds no committed step."""
    from trainyard.engine.components import checkpoint as ckpt

    check_location(uri)
    match = re.search(rf"/{ckpt.STEP_PREFIX}(\d+)/?$", uri)
    if match:
        step_path = uri.rstrip("/")
        fs, path = ckpt.filesystem(step_path)
        if not fs.exists(f"{path}/{ckpt.COMMIT_MARKER}"):
            raise ValueError(f"{step_path} holds no committed step (no {ckpt.COMMIT_MARKER}: missing, or its save "
                             "did not finish); give the checkpoint location to take its newest committed step")
        return step_path, int(match.group(1))
    step = ckpt.newest_verified_step(uri)
    if step is None:
        steps = ckpt.list_steps(uri)
        what = (f"its {len(steps)} step(s) are not committed or do not verify" if steps else
                f"nothing named {ckpt.STEP_PREFIX}* is under it")
        raise ValueError(f"no committed checkpoint under {uri}: {what}; give {VALID}")
    return ckpt.step_uri(uri, step), step


def export_checkpoint(uri: str, out_dir: str) -> dict:
    """Write OUT/model.safetensors and OUT/config.json; returns the config written."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainyard.engine.components import checkpoint as ckpt
    from trainyard.engine.components.checkpoint.io import SafeReader

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
    fs, path = ckpt.filesystem(step_path)
    config_path = f"{path}/{MODEL_CONFIG_FILE}"
    model_config = json.loads(fs.cat(config_path)) if fs.exists(config_path) else None
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
    config = {"model_config": model_config, "step": step, "source": step_path,
              "parameters": sum(v.numel() for v in state.values())}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return config
