"""What the planner knows of an instance type: per-GPU memory and its bandwidth, bf16 peak, NVLink and EFA
bandwidth (the catalog's `performance` section, from datasheets), the hourly price (`prices.json`), and the
calibrated efficiency of each GPU kind (docs/plan.md lists the runs it comes from).

Bandwidth a collective gets, per GPU and per direction:
- inside a host: NVLink's bidirectional figure / 2, times BUS_EFFICIENCY;
- across hosts: the instance's EFA bandwidth / GPUs per host (each GPU drives its share of the NICs), times
  BUS_EFFICIENCY.
- to and from host memory (CPU offload): the GPU's PCIe link, its bidirectional figure / 2, times BUS_EFFICIENCY.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from trainyard.job import catalog
from trainyard.errors import ConfigError

# Fraction of a link's bandwidth a large ring collective reaches (NCCL's bus bandwidth in nccl-tests is about
# 80% of NVLink's per-direction figure on A100/H100 hosts, and about as much of EFA's on p4d/p5).
BUS_EFFICIENCY = 0.8
# Fraction of a GPU's memory the planner lets a layout use: the rest is the CUDA context, NCCL's buffers and the
# caching allocator's fragmentation (about 4-6 GiB of an 80 GiB GPU in practice).
USABLE_MEMORY_FRACTION = 0.92
# Hardware FLOPs (recomputation included) per second as a fraction of the dense bf16 peak that the engine's
# matrix multiplies reach in eager mode, one constant per GPU kind, fitted with the two constants below to the
# runs of docs/plan.md ("Calibration": published runs and the built-in trainer's on one H100) and checked by
# tests/job/test_plan_calibration.py.
EFFICIENCY = {"NVIDIA H100": 0.52, "NVIDIA H200": 0.52, "NVIDIA A100": 0.63}
# With torch.compile (the built-in trainer's `compile`), the tokens' compute runs this much faster: inductor fuses
# the element-wise work between the matrix multiplies. Fitted to torchtitan's compiled runs (6,667 and 6,514
# tokens/s/GPU against 5,762 and 5,605 eager) and the built-in trainer's (docs/plan.md); measured on H100 only.
COMPILED_SPEEDUP = 1.08
# What a step costs besides its tokens' FLOPs and the communication: the optimizer step, the gradient clipping,
# FSDP's copies into and out of its buffers and, eager, the small kernels' launches the GPU waits for. Counted as
# this many bytes of GPU memory traffic per parameter the rank's optimizer updates (AdamW alone reads and writes
# 28), eager and compiled: fitted, not counted, to the built-in trainer's runs on one H100 (a 1.5B model: 80 ms
# and 36 ms a step), where it is a third of a 4 x 2,048-token step eager; on the published runs (1B parameters or
# fewer per GPU, steps of seconds) it is at most 4%.
STEP_BYTES_PER_PARAM = {False: 180, True: 80}
# Attention (the 12 L H Q T FLOPs) runs at this fraction of the matrix multiplies' efficiency: fused attention
# kernels reach about half the TFLOP/s of large GEMMs on A100/H100 (FlashAttention-2 paper, fwd+bwd).
ATTENTION_RELATIVE_EFFICIENCY = 0.5
# CPU offload: parameters a GPU's rank updates per second with PyTorch's fused AdamW on the host: 0.6-1.1e9 per
# thread measured on a 2-core CPU machine (64M fp32 parameters, torch 2.13); on a 16-core H100 host the offloaded
# steps of bench/plan_check.py --offload came within 4% of the plan with this figure (docs/plan.md). 1e9 per GPU
# moves about 28 GB/s of host memory per rank, 224 GB/s for 8 ranks: about what the memory channels of a
# two-socket p4d/p5 host sustain.
HOST_ADAM_PARAMS_PER_S = 1e9
# Share of the host's memory the offloaded states of all its ranks may take (the rest: the OS, the data loaders,
# the pinned staging buffers).
USABLE_HOST_MEMORY_FRACTION = 0.8


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    instance_type: str
    accelerator: str
    gpus_per_host: int
    gpu_memory_bytes: int
    peak_flops: float
    """Dense bf16 FLOP/s of one GPU."""
    fp32_flops: float
    """Its IEEE float32 FLOP/s (the engine leaves TF32 off): fp32 layouts' and the context-parallel ring's."""
    efficiency: float
    intra_bytes_per_s: float
    """Per GPU and direction, inside a host (what a ring collective gets)."""
    inter_bytes_per_s: float | None
    """Per GPU and direction, across hosts; None when the catalog has no EFA figure."""
    price_per_hour: float | None
    """USD per instance-hour (On-Demand list price), None when the table has none."""
    host_bytes_per_s: float | None = None
    """Per GPU and direction, between the GPU and host memory (PCIe); None: no offload (CPU hosts)."""
    host_memory_bytes: int = 0
    """Host memory of one instance."""
    memory_bytes_per_s: float | None = None
    """One GPU's memory bandwidth (the datasheet's); None: no per-step overhead is planned (CPU hosts)."""

    @property
    def usable_memory_bytes(self) -> int:
        return int(self.gpu_memory_bytes * USABLE_MEMORY_FRACTION)

    @property
    def usable_host_memory_per_gpu(self) -> int:
        """What one rank's offloaded states may take of its host's memory."""
        return int(self.host_memory_bytes * USABLE_HOST_MEMORY_FRACTION / self.gpus_per_host)


# Local CPU hosts (instance_type "local"): no datasheet, so nominal figures that keep the ranking meaningful
# (memory first, then compute against communication): a CPU core-group's order of magnitude, loopback TCP.
LOCAL_FLOPS = 1e11
LOCAL_BYTES_PER_S = 1e9


def bf16_peak_tflops(instance_type: str) -> float | None:
    """The bf16 dense datasheet peak of one GPU of `instance_type` (None: no GPU, or one the table lacks)."""
    it = catalog.lookup(instance_type)
    facts = catalog.performance()["accelerators"].get(it.accelerator) if it.num_gpus else None
    return facts["bf16_dense_tflops"] if facts else None


def _local(processes_per_host: int) -> Hardware:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(instance_type=catalog.LOCAL, accelerator="CPU (nominal speed)", gpus_per_host=processes_per_host,
                    gpu_memory_bytes=memory // processes_per_host, peak_flops=LOCAL_FLOPS, fp32_flops=LOCAL_FLOPS,
                    efficiency=1.0,
                    intra_bytes_per_s=LOCAL_BYTES_PER_S, inter_bytes_per_s=LOCAL_BYTES_PER_S, price_per_hour=None)


def hardware(instance_type: str, instance_count: int, *, region: str = "us-east-1",
             processes_per_host: int | None = None) -> Hardware:
    """The planner's facts for `instance_count` hosts of `instance_type` (`ml.` prefix or not); `local` hosts
    run `processes_per_host` ranks (default 1) with nominal speeds, their memory split between the ranks."""
    it = catalog.lookup(instance_type)
    if it.name == catalog.LOCAL:
        return _local(processes_per_host or 1)
    perf = catalog.performance()
    facts = perf["accelerators"].get(it.accelerator)
    if it.num_gpus == 0 or facts is None:
        known = sorted(n for n, v in catalog._catalog().items() if v["accelerator"] in perf["accelerators"])
        raise ConfigError("instance_type", f"{instance_type!r} ({it.accelerator or 'no accelerator'}) has no bf16 peak "
                                           f"or NVLink figure in the catalog: plan for one of {', '.join(known)}")
    efa = perf["efa_gbits_per_s"].get(it.name)
    if instance_count > 1 and efa is None:
        raise ConfigError("instance_count", f"{instance_count} hosts of {it.name}: the catalog has no EFA bandwidth "
                                            "for it; plan one host, or a type with EFA (p4d, p4de, p5, p5e, p5en)")
    price = catalog.hourly_price(it.name, region, spot=False)
    return Hardware(
        instance_type=it.name, accelerator=it.accelerator, gpus_per_host=it.num_gpus,
        gpu_memory_bytes=it.accelerator_memory_mib * 2 ** 20, peak_flops=facts["bf16_dense_tflops"] * 1e12,
        fp32_flops=facts["fp32_tflops"] * 1e12,
        efficiency=EFFICIENCY[it.accelerator],
        intra_bytes_per_s=facts["nvlink_gbytes_per_s"] / 2 * 1e9 * BUS_EFFICIENCY,
        inter_bytes_per_s=efa / 8 * 1e9 / it.num_gpus * BUS_EFFICIENCY if efa else None,
        price_per_hour=price.per_hour if price else None,
        host_bytes_per_s=facts["pcie_gbytes_per_s"] / 2 * 1e9 * BUS_EFFICIENCY,
        host_memory_bytes=it.memory_mib * 2 ** 20, memory_bytes_per_s=facts["hbm_gbytes_per_s"] * 1e9)
