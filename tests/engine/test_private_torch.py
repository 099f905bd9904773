"""The private torch APIs the package uses, named: read from the source with `ast` (imports and attribute chains
rooted at a torch module), they must be exactly PRIVATE below, and each must still exist in the installed torch.
A new use fails the first test until it is listed (with the reason); a torch upgrade that drops or moves one
fails the second, naming it, instead of a job failing later."""
from __future__ import annotations

import ast
import importlib
import os

import pytest
import torch

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "trainyard")

# name -> where and why
PRIVATE = {
    "torch.distributed._functional_collectives":
        "heartbeat and comm meter wrap DTensor's collectives (engine/components/heartbeat.py, meter.py); the MoE "
        "layer's all-to-all with autograd (engine/models/llama/moe.py)",
    "torch._grouped_mm": "one grouped GEMM per expert projection on CUDA in bf16 (engine/models/llama/moe.py)",
    "torch._C._current_graph_task_id":
        "an activation-checkpoint recompute inside backward does not count router statistics twice (moe.py)",
    "torch.distributed.fsdp._fully_shard._fsdp_api":
        "AllGather, ReduceScatter: MiCS's hierarchical collectives plug into FSDP2 (engine/distributed/mics.py)",
    "torch.distributed.checkpoint._fsspec_filesystem":
        "DCP on object storage: FileSystem, FsspecReader, FsspecWriter (components/checkpoint/io.py)",
    "torch.distributed.checkpoint.filesystem._StoragePrefix": "one storage prefix per rank in DCP's plans",
    "torch.distributed.checkpoint.filesystem._StorageInfo":
        "where a tensor lies in a data file, in the results of VerifiedWriter's own safetensors writer",
    "torch.distributed.checkpoint._hf_utils":
        "the metadata keys DCP's safetensors writer puts in a data file's header, which VerifiedWriter's puts too",
    "torch.distributed._shard._utils": "narrow_tensor_by_index: resharding reads of DCP checkpoints",
    "torch._subclasses": "fake_tensor.is_fake: a kernel launch under torch.compile's tracing takes no CUDA device "
                         "context (kernels/dispatch.py)",
    "torch._amp_foreach_non_finite_check_and_unscale_":
        "the fp16 loss scaler's unscale and inf/nan check in one fused pass, as torch.amp.GradScaler does "
        "(engine/components/scaler.py)",
    "torch.distributed.tensor.placement_types._StridedShard": "FSDP2 x TP placements read back from checkpoints",
    "torch.cuda.memory._record_memory_history": "the profiler's memory snapshots",
    "torch.cuda.memory._dump_snapshot": "the profiler's memory snapshots",
    "torch.autograd.Variable._execution_engine": "the MiCS gradient sync's end-of-backward callback",
    "torch._foreach_mul_": "clipping many gradient shards at once",
    "torch._foreach_norm": "the gradient norm of many local shards at once (parallelize.sharded_squared_norm)",
    "torch._C._distributed_c10d._resolve_process_group": "the comm meter names a functional collective's group",
    "torch.distributed.pipelining.schedules._batch_p2p": "the comm meter counts pipeline sends",
    "torch._compile": "lazy_dynamo: the module of torch's `_disable_dynamo` decorator, replaced while deferred",
    "torch._compile._disable_dynamo": "lazy_dynamo fills its wrappers' `__dynamo_disable` cache with the plain "
                                      "function until torch._dynamo is imported (engine/components/lazy_dynamo.py)",
    "torch._disable_dynamo": "lazy_dynamo: torch's own name for the same decorator",
    "torch._dynamo": "lazy_dynamo stands in for the package until something may compile",
}


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *parts]
    return None


def _private(parts: list[str]) -> str | None:
    """The chain up to and including its last private component (`_x`, not `__x__`), or None: the members of a
    private module are that module's use (`funcol.all_reduce` is `torch.distributed._functional_collectives`)."""
    last = max((k for k, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), default=None)
    return None if last is None else ".".join(parts[: last + 1])


def _uses(path: str) -> set[str]:
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    aliases: dict[str, str] = {}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
                    hit = _private(a.name.split("."))
                    if hit:
                        found.add(hit)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                hit = _private(full.split("."))
                if hit:
                    found.add(hit)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # parts of a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                hit = _private(aliases[parts[0]].split(".") + parts[1:])
                if hit:
                    found.add(hit)
    return found


def _all_uses() -> dict[str, list[str]]:
    uses: dict[str, list[str]] = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                for use in _uses(path):
                    uses.setdefault(use, []).append(os.path.relpath(path, PACKAGE))
    return uses


def test_every_private_torch_api_in_use_is_named():
    uses = _all_uses()
    assert "torch.distributed._functional_collectives" in uses, "the scan misses a known use: the reader is broken"
    unlisted = {u: where for u, where in uses.items() if u not in PRIVATE}
    assert not unlisted, f"private torch APIs in use but not named in PRIVATE (add them with the reason): {unlisted}"
    stale = sorted(set(PRIVATE) - set(uses))
    assert not stale, f"PRIVATE names APIs the package no longer uses: {stale}"


@pytest.mark.parametrize("name", sorted(PRIVATE))
def test_each_named_private_api_exists_in_this_torch(name):
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            assert hasattr(obj, attr), f"torch {torch.__version__} has no {name} ({PRIVATE[name]})"
            obj = getattr(obj, attr)
        return
    pytest.fail(f"torch {torch.__version__} cannot import any part of {name}")
