"""The pre-flight health check: every host's compute and links measured before the first step.

    torchrun ... --module trainyard.container.health --out <folder> [--min-ratio R] [--expected-tflops T] [--turns]

The driver runs it (started as the job's processes are, container/launcher.py, after the bandwidth probe, before the
user's script) when the job asks (`Estimator(health_check=True)`). Every rank measures:

- compute: matmul throughput, TFLOP/s (GPU: bf16 4096 x 4096 products; CPU: fp32 512 x 512, with the rank's
  threads), the rank's own, after a warm-up, every rank at once (a host's ranks share its power and cooling as in
  training); hosts emulated on one machine (`--turns`: a local job) measure one host at a time, or they would
  compare their share of the machine's cores;
- collectives: all-reduce bus bandwidth (nccl-tests' figure, container/probe.py) within its host (the host's ranks)
  and across hosts (the ranks of the same local index on every host), GB/s; NCCL on GPUs, gloo on the CPU;
- the network: on EFA instances the libfabric provider NCCL will use (`FI_PROVIDER`) and the EFA device count the
  driver found (container/efa.py).

The figures are all-gathered, and every rank reaches the same verdict: per host, the median of its ranks' compute
(each rank's is kept too), its intra-host bandwidth, its share of the inter-host one; a host is far below its peers
when its compute is under `min_ratio` x the median of the other hosts' (with one host: under `min_ratio` x the
figure expected of its instance type, where the catalog has one; a host alone on a CPU, or on a GPU the catalog
lacks, has nothing to be compared with: it is listed in `unjudged`, and said). Each host's first rank writes
`<out>/health.json`:

    {"hosts": {"algo-1": {"compute_tflops": ..., "rank_tflops": [...], "intra_gbps": ..., "inter_gbps": ...,
                          "ranks": 2, "expected_tflops": null, "ratio": 1.0, "efa": {...}}, ...},
     "slow": ["algo-2"], "reason": "Health check: algo-2's compute ..."}

which the driver reads (the job fails with `reason`, or goes on, as the job's `health_check` says).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from trainyard.container.probe import bus_bandwidth_gbps

CPU_MATMUL, GPU_MATMUL = 512, 4096
ALLREDUCE_MIB = {"cuda": 64, "cpu": 4}
ITERS = 5


def matmul_tflops(device, *, seconds: float = 0.4) -> float:
    """This rank's matmul throughput: products of two random n x n matrices for about `seconds` after a warm-up."""
    import torch

    cuda = device.type == "cuda"
    n = GPU_MATMUL if cuda else CPU_MATMUL
    dtype = torch.bfloat16 if cuda else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    if cuda:
        torch.cuda.synchronize(device)
    count, start = 0, time.perf_counter()
    while True:
        for _ in range(4):
            torch.mm(a, b)
        count += 4
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * n ** 3 * count / elapsed / 1e12


def allreduce_gbps(group, size: int, device, nbytes: int) -> float | None:
    """Bus bandwidth of an all-reduce of `nbytes` over `group` (None when the group has one rank)."""
    import torch
    import torch.distributed as dist

    if size <= 1:
        return None
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buf, group=group)  # connections, registration
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(ITERS):
        dist.all_reduce(buf, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return bus_bandwidth_gbps(nbytes, (time.perf_counter() - start) / ITERS, size)


def verdict(ranks: list[dict], *, min_ratio: float, expected_tflops: float | None) -> dict:
    """Per host, from every rank's figures (dicts with host, compute_tflops, intra_gbps, inter_gbps, efa): the host's
    figures, which hosts are far below their peers, and the reason to fail with."""
    hosts: dict[str, dict] = {}
    for r in ranks:
        h = hosts.setdefault(r["host"], {"intra_gbps": r["intra_gbps"], "inter_gbps": r["inter_gbps"],
                                         "rank_tflops": [], "efa": r["efa"]})
        h["rank_tflops"].append(round(r["compute_tflops"], 6))
        for key in ("intra_gbps", "inter_gbps"):
            if r[key] is not None:
                h[key] = r[key] if h[key] is None else min(h[key], r[key])
    for h in hosts.values():  # the host's typical rank (ranks that share cores are not measured alike)
        h["ranks"], h["compute_tflops"] = len(h["rank_tflops"]), statistics.median(h["rank_tflops"])
    slow, why, unjudged = [], [], []
    for name, h in hosts.items():
        peers = [o["compute_tflops"] for other, o in hosts.items() if other != name]
        reference = statistics.median(peers) if peers else expected_tflops
        h["expected_tflops"] = expected_tflops
        h["ratio"] = round(h["compute_tflops"] / reference, 3) if reference else None
        if h["ratio"] is None:
            unjudged.append(name)
        elif h["ratio"] < min_ratio:
            slow.append(name)
            against = "the median of the other hosts" if peers else "the instance type's expected figure"
            why.append(f"{name}'s compute {h['compute_tflops']:.3g} TFLOP/s is {h['ratio']:.2f}x {against} "
                       f"({reference:.3g})")
    reason = ""
    if slow:
        reason = (f"Health check: {'; '.join(why)}, below the {min_ratio:g}x the check allows: a throttled or faulty "
                  "host, found before training started")
    return {"hosts": hosts, "slow": slow, "reason": reason, "min_ratio": min_ratio, "unjudged": unjudged}


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m trainyard.container.health")
    p.add_argument("--out", required=True, help="folder for health.json (each host's first rank writes it)")
    p.add_argument("--min-ratio", type=float, default=0.7)
    p.add_argument("--expected-tflops", type=float, default=None)
    p.add_argument("--turns", action="store_true",
                   help="hosts that share one machine (emulated ones): each measures its compute in turn")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pph = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    hosts = world // pph
    try:
        intra, _ = dist.new_subgroups(pph) if hosts > 1 else (dist.group.WORLD, None)
        inter, _ = dist.new_subgroups_by_enumeration([[h * pph + i for h in range(hosts)] for i in range(pph)])
        nbytes = ALLREDUCE_MIB[device.type] * 2**20
        compute = 0.0
        for turn in range(hosts if a.turns else 1):  # emulated hosts share the machine's cores: one host at a time
            dist.barrier()  # no rank measures while another still starts
            if not a.turns or turn == rank // pph:
                compute = matmul_tflops(device)
        mine = {"rank": rank, "host": os.environ.get("SM_CURRENT_HOST") or f"host {rank // pph}",
                "compute_tflops": compute,
                "intra_gbps": allreduce_gbps(intra, pph, device, nbytes),
                "inter_gbps": allreduce_gbps(inter, hosts, device, nbytes),
                "efa": {"provider": os.environ.get("FI_PROVIDER") or None,
                        "devices": int(os.environ.get("TRAINYARD_EFA_DEVICES") or 0)}}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        result = verdict(everyone, min_ratio=a.min_ratio, expected_tflops=a.expected_tflops)
        if local_rank == 0:
            os.makedirs(a.out, exist_ok=True)
            tmp = os.path.join(a.out, "health.json.tmp")
            with open(tmp, "w") as fh:
                json.dump(result, fh)
            os.replace(tmp, os.path.join(a.out, "health.json"))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
