"""Checkpoints with torch.distributed.checkpoint (DCP) to an fsspec URI: `s3://bucket/prefix` or a path.

Layout: one prefix per step, `<uri>/step-00000100/`, holding per rank `rank-NNNNN/__<rank>_0.distcp` (safetensors) and
its checksum manifest `rank-NNNNN/__<rank>.checksums.json`, the model's shape `model.json`, and a
`.metadata` object that DCP's coordinator writes last (to `.metadata.tmp`, then renamed). `.metadata`
is the commit marker: a step without it is an interrupted save and is never loaded. Resume (`resume`)
lists the `step-*` prefixes (there is no pointer file to trust), loads the newest committed one while
checking every file it reads against its manifest, and on damage falls back to the one before, with a
warning naming the damaged step.

The saved state is one dict of tensors: {"app": model + optimizer (get_state_dict, sharded as
DTensors, so a load reshards to another process count; optimizer settings such as lr and betas packed
as float64 tensors), "trainer": step and LR-scheduler state as tensors}. Nothing is pickled, and a
checkpoint that holds pickled entries is refused before anything of it is read.

The package: `locations.py` (where steps live, listing, purging, the list rank 0 broadcasts), `state.py` (what a
checkpoint holds), `io.py` (the verified writer and reader, `CheckpointDamaged`), `manager.py` (save, load,
resume, `CheckpointManager`). Its public names are importable from the package.
"""
from trainyard.engine.components.checkpoint.io import CheckpointDamaged, SafeReader, VerifiedWriter, verify_step
from trainyard.engine.components.checkpoint.locations import (COMMIT_MARKER, DEFAULT_KEEP_LAST, STEP_DIGITS,
                                                              STEP_PREFIX, check_location_form, committed_steps,
                                                              filesystem, is_remote, latest_committed_step,
                                                              list_steps, purge, step_uri, storage_options,
                                                              validate_uri)
from trainyard.engine.components.checkpoint.manager import (AsyncSaver, CheckpointManager, damage, load_checkpoint,
                                                            newest_verified_step, resume, save_checkpoint)
from trainyard.engine.components.checkpoint.state import (ExtraState, ModelOptimState, TrainerState, from_tensors,
                                                          state_of, to_tensors, write_model_config)

__all__ = ["COMMIT_MARKER", "DEFAULT_KEEP_LAST", "STEP_DIGITS", "STEP_PREFIX", "AsyncSaver", "CheckpointDamaged",
           "CheckpointManager", "ExtraState", "ModelOptimState", "SafeReader", "TrainerState", "VerifiedWriter",
           "check_location_form", "committed_steps", "damage", "filesystem", "from_tensors", "is_remote",
           "latest_committed_step", "list_steps", "load_checkpoint", "newest_verified_step", "purge", "resume",
           "save_checkpoint", "state_of", "step_uri", "storage_options", "to_tensors", "validate_uri", "verify_step",
           "write_model_config"]
