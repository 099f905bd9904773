"""trainyard.engine: shard any nn.Module or Hugging Face causal LM with MiCS, tensor and pipeline parallelism,
checkpoint it, export it (docs/engine.md). `import trainyard.engine as te; ctx = te.init(); model = te.transform(model)`.

The public names live in `api.py` (and `equivalence.py`); they are resolved on first use so that the torch-free
parts of the engine (the parallelism and layout checks the SDK runs) import without loading torch.
"""
__all__ = ["Context", "init", "current", "finish", "transform", "rows", "sequence_shard", "accumulate", "wait_for_checkpoints", "checkpoint_busy", "checkpoint_held", "checkpoint_io", "forward_backward", "global_loss",
           "evaluate", "predict", "clip_grad_norm_", "optimizer_step", "scaler", "mark_step", "log_metrics",
           "save_checkpoint", "load_checkpoint", "save_model", "load_pretrained", "full_state_dict",
           "check_equivalence", "Parallelism", "lm_loss", "LMHidden", "build_model", "router_stats"]


def __getattr__(name: str):
    if name == "check_equivalence":
        from trainyard.engine.equivalence import check_equivalence

        return check_equivalence
    if name in ("build_model", "router_stats"):  # the built-in model (a preset or a ModelConfig), its MoE routing
        from trainyard.engine.models.llama import model, moe

        return {"build_model": model.build, "router_stats": moe.router_stats}[name]
    if name == "Parallelism":
        from trainyard.parallel.parallelism import Parallelism

        return Parallelism
    if name in __all__:
        from trainyard.engine import api

        return getattr(api, name)
    raise AttributeError(f"module 'trainyard.engine' has no attribute {name!r}")
