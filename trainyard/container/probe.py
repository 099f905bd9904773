"""A preflight bandwidth probe: all-reduce one buffer a few times and print the bus bandwidth per rank.

    torchrun ... --module trainyard.container.probe [--size-mib S] [--iters N] [--warmup W]

The driver runs it (started as the job's processes are, container/launcher.py, before the user's script) when the
job's environment has `TRAINYARD_BANDWIDTH_PROBE=1`. Each rank prints one line:

    bandwidth probe: rank R: all-reduce bus bandwidth X GB/s (size S MiB, N iterations)

Bus bandwidth is nccl-tests' figure: algorithm bandwidth (bytes / time of one all-reduce) times
2(n-1)/n, the share of the buffer each rank sends and receives in a ring all-reduce; it is comparable
across world sizes and with the link's rate. GB is 10^9 bytes. With one rank nothing crosses a link and
the figure is 0.

GPUs: NCCL, 256 MiB per rank (large enough that latency is a small share of the time). Otherwise gloo
on the CPU, 8 MiB. `TRAINYARD_PROBE_SIZE_MIB`, `TRAINYARD_PROBE_ITERS` and `TRAINYARD_PROBE_WARMUP`
override the defaults (the job's environment reaches the probe too).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

GPU_SIZE_MIB = 256
CPU_SIZE_MIB = 8
GPU_ITERS, CPU_ITERS = 20, 5
WARMUP = 3  # the first collectives pay for connection setup and (NCCL) for registering the buffer
LINE = "bandwidth probe: rank {rank}: all-reduce bus bandwidth {gbps:.2f} GB/s (size {mib:g} MiB, {iters} iterations)"


def bus_bandwidth_gbps(nbytes: int, seconds_per_op: float, world: int) -> float:
    """nccl-tests' bus bandwidth of one all-reduce of `nbytes` on `world` ranks, in GB/s (10^9 B/s)."""
    if world <= 1 or seconds_per_op <= 0:
        return 0.0
    return 2 * (world - 1) / world * nbytes / seconds_per_op / 1e9


def _env_number(name: str, kind=float):
    value = os.environ.get(name)
    return kind(value) if value else None


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m trainyard.container.probe")
    p.add_argument("--size-mib", type=float, default=_env_number("TRAINYARD_PROBE_SIZE_MIB"))
    p.add_argument("--iters", type=int, default=_env_number("TRAINYARD_PROBE_ITERS", int))
    p.add_argument("--warmup", type=int, default=_env_number("TRAINYARD_PROBE_WARMUP", int))
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    a = p.parse_args(argv)

    cuda = torch.cuda.is_available() if a.device == "auto" else a.device == "cuda"
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    size_mib = a.size_mib or (GPU_SIZE_MIB if cuda else CPU_SIZE_MIB)
    iters = a.iters or (GPU_ITERS if cuda else CPU_ITERS)
    warmup = WARMUP if a.warmup is None else a.warmup
    rank, world = dist.get_rank(), dist.get_world_size()

    # float32 zeros: sums stay zero (no overflow to inf over many iterations), and the size is exact
    numel = max(1, int(size_mib * 2**20) // 4)
    buf = torch.zeros(numel, dtype=torch.float32, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    try:
        for _ in range(warmup):
            dist.all_reduce(buf)
        sync()
        dist.barrier()  # every rank starts the clock together: none times its wait for a late peer
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        elapsed = time.perf_counter() - start
        gbps = bus_bandwidth_gbps(numel * 4, elapsed / iters, world)
        # one write for the line and its newline: under PYTHONUNBUFFERED `print` writes them apart, and torchrun's
        # tailer may put the other rank's line between them (no worker site here to make writes whole lines)
        sys.stdout.write(LINE.format(rank=rank, gbps=gbps, mib=numel * 4 / 2**20, iters=iters) + "\n")
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
