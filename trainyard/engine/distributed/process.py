"""Process group and device from torchrun's environment. The mesh is ParallelDims' (parallel.py)."""
from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainyard.engine.components import heartbeat
from trainyard.parallel.dims import forget_meshes


@dataclass(kw_only=True, slots=True)
class Dist:
    """Where this process stands in the job."""

    rank: int
    """Global rank (torchrun's RANK; 0 for a plain process)."""
    world_size: int
    """Number of processes (torchrun's WORLD_SIZE; 1 for a plain process)."""
    local_rank: int
    """Rank within this host (torchrun's LOCAL_RANK); selects the GPU."""
    device: torch.device
    """cuda:LOCAL_RANK when CUDA is available, else cpu."""
    backend: str
    """nccl on GPUs, gloo on CPU."""
    processes_per_host: int
    """Ranks on this host (torchrun's LOCAL_WORLD_SIZE; 1 for a plain process)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(env: dict, name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def init_distributed(env: dict | None = None) -> Dist:
    """Join the process group torchrun describes (or form a group of one) and build the mesh.

    Without RANK/WORLD_SIZE in the environment this is a single process: world 1, rank 0, with an
    in-memory store, so no port is needed.
    """
    env = os.environ if env is None else env
    world = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", 0)
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        check_launched(env)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if "RANK" in env and "MASTER_ADDR" in env:
            dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
        elif world == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        else:
            raise ValueError(f"WORLD_SIZE={world} but RANK/MASTER_ADDR are not set: launch with torchrun")
    pph = _env_int(env, "LOCAL_WORLD_SIZE", world)
    heartbeat.start(env)  # in a job: what this rank is doing, for the hang detection
    return Dist(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend,
                processes_per_host=pph)


def check_launched(env) -> None:
    """A job of several hosts whose processes no launcher started (no `distribution`: plain python once per host,
    as on SageMaker) would train one model per host, each alone: refused, naming the fix."""
    try:
        hosts = json.loads(env.get("SM_HOSTS") or "[]")
    except ValueError:
        return
    if "RANK" not in env and isinstance(hosts, list) and len(hosts) > 1:
        raise ValueError(f"distribution: this job has {len(hosts)} hosts, and without a distribution each runs the "
                         "script as plain python, alone (as SageMaker does): every host would train a model of its "
                         "own. Give the estimator distribution={'torch_distributed': {'enabled': True}} (or "
                         "Trainyard's form) so that torchrun starts the hosts' processes together")


def destroy_distributed() -> None:
    if dist.is_initialized():
        # FSDP modules sit in reference cycles: collect them now, while the group is alive, not at
        # interpreter exit, where gloo work they hold aborts the process ("terminate called without an
        # active exception"). And no rank tears its group down while a peer may still talk to it.
        gc.collect()
        dist.barrier()
        forget_meshes()
        dist.destroy_process_group()

