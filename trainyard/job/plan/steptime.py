"""Time of one optimizer step on the engine, per GPU, from FLOPs and bytes.

Compute: hardware FLOPs of the rank's tokens (model FLOPs 6 N + 12 L H Q T, plus the forward recomputed by
activation checkpointing: 2 N_blocks + 4 L H Q T per token for full, half of it for selective; N the active
parameters of a mixture of experts) at the GPU's calibrated efficiency (attention at ATTENTION_RELATIVE_EFFICIENCY
of it; the context-parallel ring's float32 blocks, and every matrix multiply of an fp32 layout, at the GPU's fp32
rate: the engine leaves TF32 off; COMPILED_SPEEDUP faster with torch.compile), stretched by the pipeline bubble
(pp - 1) / (v m).
Overhead, once per step: STEP_BYTES_PER_PARAM (eager or compiled) per parameter the rank's optimizer updates, at
the GPU's memory bandwidth.

Communication, bytes each rank sends per step (ring algorithm; REFERENCE.md, engine meter):
- MiCS / FSDP2 over the partition group of p ranks, per micro-batch: all-gather of the stage's parameters in the
  compute dtype before forward and again before backward (reshard after forward), reduce-scatter of the fp32
  gradients: (2 c + 4) Psi_rank (p - 1) / p. A group spanning k hosts runs both in two hops: (k - 1) / p of the
  bytes cross hosts, the rest stays inside.
- across the r replicas, once per step (2-hop sync): all-reduce of the fp32 gradient shard, 2 x 4 Psi_rank / p
  x (r - 1) / r.
- tensor parallelism with sequence parallelism, per block and micro-batch: 2 all-gathers and 2 reduce-scatters
  of the block's activations (b s dim c) in forward, as many in backward, again in a recomputed forward.
- pipeline: each micro-batch's activations and their gradients cross every stage boundary (v per rank).
- context parallelism (the rank's seq_len / cp tokens): the ring, per layer and micro-batch, 2 (cp - 1) x its keys
  and values in the compute dtype plus cp x their fp32 gradients; it runs behind the attention it feeds.
- expert parallelism: the all-to-all of the assignments that leave the rank ((ep - 1) / ep under uniform
  routing), 4 per layer and micro-batch (dispatch and combine, forward and backward); waited for.
Overlap: the engine prefetches the next block's all-gather and reduce-scatters while backward runs, and its
replica sync is bucketed behind the backward: those hide under compute except the first gather and last
reduce-scatter (one block's worth); tensor-parallel and pipeline transfers are waited for.
CPU offload: per micro-batch, each all-gather first copies the rank's fp32 shard in over PCIe (twice: forward
and backward) and each reduce-scatter's fp32 shard goes back; on their own link, overlapped as the gathers are.
The optimizer step then runs on the host (HOST_ADAM_PARAMS_PER_S) after the backward: waited for.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainyard.job.plan.hardware import (ATTENTION_RELATIVE_EFFICIENCY, COMPILED_SPEEDUP, HOST_ADAM_PARAMS_PER_S,
                                         STEP_BYTES_PER_PARAM, Hardware)
from trainyard.job.plan.layout import Layout
from trainyard.job.plan.memory import COMPUTE_BYTES
from trainyard.parallel.shapes import ModelShape

RECOMPUTED = {"none": 0.0, "selective": 0.5, "full": 1.0}  # share of the blocks whose forward runs twice


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    compute_s: float
    bubble_s: float
    comm_intra_bytes: float
    comm_inter_bytes: float
    overlapped_comm_s: float
    """Communication the engine overlaps with compute (MiCS gathers and reductions, replica sync)."""
    exposed_comm_s: float
    """Communication the step waits for."""
    offload_s: float = 0.0
    """CPU offload: the host's optimizer step and the PCIe copies compute does not hide."""
    overhead_s: float = 0.0
    """Once per step: the optimizer, clipping, FSDP's copies and (eager) kernel launches (STEP_BYTES_PER_PARAM)."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s + self.offload_s + self.overhead_s


def hardware_flops_per_token(shape: ModelShape, seq_len: int, ac: str) -> tuple[float, float]:
    """(matrix-multiply FLOPs, attention FLOPs) of one token, recomputation included."""
    attention = shape.attention_flops_per_token(seq_len)
    dense = shape.flops_per_token(seq_len) - attention
    share = RECOMPUTED[ac]
    block_dense = 2.0 * shape.n_layers * shape.active_block_matrix_params  # forward: 2 FLOPs per weight used
    return dense + share * block_dense, attention * (1 + share / 3)  # forward attention is a third of fwd + bwd


def _crosses_hosts(group: int, stride: int, gpus_per_host: int, hosts: int) -> bool:
    """Whether a group of `group` ranks `stride` apart spans more than one host."""
    return hosts > 1 and group > 1 and group * stride > gpus_per_host


@dataclass
class _Traffic:
    """Bytes sent per rank and step, split intra- / inter-host, and the seconds they take."""
    intra: float = 0.0
    inter: float = 0.0
    seconds: float = 0.0

    def add(self, nbytes: float, *, inter: bool, hw: Hardware) -> None:
        if inter:
            self.inter += nbytes
            self.seconds += nbytes / (hw.inter_bytes_per_s or hw.intra_bytes_per_s)
        else:
            self.intra += nbytes
            self.seconds += nbytes / hw.intra_bytes_per_s


def _stage_params(shape: ModelShape, layout: Layout) -> float:
    """Parameters of an average rank that MiCS shards: its blocks' matrices over tp (without the experts that
    expert parallelism spreads), their norms, its share of the root."""
    layers = shape.n_layers // layout.pp
    whole = shape.experts_held_whole(ep=layout.ep, tp=layout.tp)
    matrices = shape.block_matrix_params - (shape.block_expert_params if whole else 0)
    return layers * (matrices / layout.tp + 2 * shape.dim) + \
        (shape.embedding_params + shape.head_params) / (layout.tp * layout.pp)


def _updated_params(shape: ModelShape, layout: Layout) -> float:
    """Parameters an average rank's optimizer updates: its shard of what MiCS shards (over p x cp ranks) and the
    experts it holds whole."""
    whole = shape.experts_held_whole(ep=layout.ep, tp=layout.tp)
    experts = shape.n_layers // layout.pp * shape.block_expert_params / layout.ep if whole else 0.0
    return _stage_params(shape, layout) / (layout.partition_group_size * layout.cp) + experts


def _sharding_traffic(shape: ModelShape, layout: Layout, seq_len: int, hw: Hardware, hosts: int) -> _Traffic:
    """MiCS's gathers and reduce-scatters inside the partition group (ranks tp apart) every micro-batch, two
    hops when the group spans k hosts ((k - 1) of the p - 1 shards cross them); the replicas' all-reduce of
    the fp32 gradient shard (ranks p x tp apart) once per step; the spread experts' gradient all-reduce over the
    ranks holding the same experts; context parallelism's ring (keys and values cp - 1 hops forward and again
    backward, and in a recomputed forward, their fp32 gradients cp hops), which runs behind the attention blocks.
    The engine overlaps all of it with compute."""
    c = COMPUTE_BYTES[layout.precision]
    # under context parallelism the group is p x cp ranks, tp apart (the cp ranks share it)
    p, r, tp, gph = layout.partition_group_size * layout.cp, layout.replicas, layout.tp, hw.gpus_per_host
    params = _stage_params(shape, layout)
    traffic = _Traffic()
    if p > 1:
        gathered = layout.microbatches * (2 * c + 4) * params * (p - 1) / p
        crossing = 0.0
        if _crosses_hosts(p, tp, gph, hosts):
            crossing = gathered * (p * tp // gph - 1) / (p - 1)
        traffic.add(gathered - crossing, inter=False, hw=hw)
        traffic.add(crossing, inter=True, hw=hw)
    if r > 1:
        traffic.add(2 * 4 * params / p * (r - 1) / r, inter=_crosses_hosts(r, p * tp, gph, hosts), hw=hw)
    ep = layout.ep
    holders = layout.dp // ep * layout.cp * tp  # the ranks holding the same experts (each routes its own tokens)
    if shape.experts_held_whole(ep=ep, tp=tp) and holders > 1:  # their fp32 gradients, summed over those ranks
        spread = shape.n_layers // layout.pp * shape.block_expert_params / ep
        traffic.add(2 * 4 * spread * (holders - 1) / holders,
                    inter=_crosses_hosts(layout.dp // ep, ep * tp * layout.cp, gph, hosts), hw=hw)
    if layout.cp > 1:  # the ring, per layer and micro-batch, behind the attention blocks it feeds
        cp, c = layout.cp, COMPUTE_BYTES[layout.precision]
        kv = 2 * layout.micro_batch_size * seq_len // cp * shape.kv_dim / tp  # keys and values, elements
        hops = 2 * (cp - 1) * kv * c + cp * kv * 4 + RECOMPUTED[layout.activation_checkpointing] * (cp - 1) * kv * c
        traffic.add(layout.microbatches * shape.n_layers // layout.pp * hops, inter=False, hw=hw)
    return traffic


def _waited_traffic(shape: ModelShape, layout: Layout, seq_len: int, hw: Hardware, hosts: int) -> _Traffic:
    """Tensor parallelism (4 collectives of a block's activations forward, 4 backward, 4 per recomputed forward,
    per block and micro-batch), the pipeline's sends (activations forward, their gradients backward, across
    v boundaries per rank) and expert parallelism's all-to-all (each assignment leaves the rank with probability
    (ep - 1) / ep, dispatched and combined, forward and backward, again in a recomputed forward): the step waits
    for them."""
    c = COMPUTE_BYTES[layout.precision]
    tp, pp, m = layout.tp, layout.pp, layout.microbatches
    mb_tokens = layout.micro_batch_size * seq_len // layout.cp  # the rank's tokens of a micro-batch
    traffic = _Traffic()
    if layout.ep > 1:  # a mixture of experts' dispatch and combine, forward and backward (uniform routing)
        ep, recompute = layout.ep, RECOMPUTED[layout.activation_checkpointing]
        rows = mb_tokens / tp * shape.top_k * (ep - 1) / ep  # under tp a rank routes its sequence-parallel shard
        traffic.add(m * (shape.n_layers // pp) * (4 + 2 * recompute) * rows * shape.dim * c,
                    inter=_crosses_hosts(ep, tp * layout.cp, hw.gpus_per_host, hosts), hw=hw)
    if tp > 1:
        # gather and reduce-scatter around attention and the MLP; a mixture of experts' routed experts take the
        # sequence-parallel shards as they are (its shared experts are split like an MLP)
        split = 2 if shape.n_experts and not shape.n_shared_experts else 4
        calls = 2 * split + split * RECOMPUTED[layout.activation_checkpointing]
        layers = shape.n_layers // pp
        traffic.add(m * layers * calls * mb_tokens * shape.dim * c * (tp - 1) / tp, inter=False, hw=hw)
    if pp > 1:
        traffic.add(m * 2 * layout.virtual_stages * mb_tokens * shape.dim * c / tp,
                    inter=_crosses_hosts(pp, layout.world // pp, hw.gpus_per_host, hosts), hw=hw)
    return traffic


def estimate(shape: ModelShape, layout: Layout, seq_len: int, global_batch: int, hw: Hardware, hosts: int, *,
             compiled: bool = False) -> StepTime:
    """`compiled`: the job runs its blocks under torch.compile (the built-in trainer's `compile`)."""
    dense, attention = hardware_flops_per_token(shape, seq_len, layout.activation_checkpointing)
    tokens_per_gpu = global_batch * seq_len / layout.world
    # the engine leaves TF32 off: fp32 matrix multiplies run at the GPU's fp32 rate; compiled runs faster on GPUs
    # (a local host's speeds are nominal)
    peak = hw.fp32_flops if layout.precision == "fp32" else hw.peak_flops
    rate = hw.efficiency * peak * (COMPILED_SPEEDUP if compiled and hw.memory_bytes_per_s else 1.0)
    attention_rate = rate * ATTENTION_RELATIVE_EFFICIENCY
    if layout.cp > 1 and layout.precision != "fp32":  # the ring's blocks are float32 matmuls
        attention_rate *= hw.fp32_flops / hw.peak_flops
    compute = tokens_per_gpu * (dense / rate + attention / attention_rate)
    bubble = compute * (layout.pp - 1) / (layout.virtual_stages * layout.microbatches) if layout.pp > 1 else 0.0
    hidden = _sharding_traffic(shape, layout, seq_len, hw, hosts)
    waited = _waited_traffic(shape, layout, seq_len, hw, hosts)
    units = max(1, (shape.n_layers // layout.pp) * layout.microbatches)
    pcie = host_adam = 0.0
    if layout.cpu_offload:
        shard = _stage_params(shape, layout) / (layout.partition_group_size * layout.cp)
        pcie = layout.microbatches * 2 * 4 * shard / (hw.host_bytes_per_s or hw.intra_bytes_per_s)  # in: 2 gathers
        host_adam = shard / HOST_ADAM_PARAMS_PER_S
    # MiCS's traffic and the offload's PCIe copies run behind compute, on their own links, pipelined block by
    # block: what shows is one block's worth of each, or the longer of the two (plus one block of the other)
    # beyond compute. (Each hidden behind the same compute separately would count that compute twice: less
    # compute, as under torch.compile or without recomputation, would then plan a slower step.)
    h = hidden.seconds
    behind = max((h + pcie) / units, max(h, pcie) + min(h, pcie) / units - compute)
    share = h / (h + pcie) if h + pcie else 0.0
    exposed = waited.seconds + behind * share
    offload = host_adam + behind * (1 - share)
    overhead = 0.0
    if hw.memory_bytes_per_s:
        overhead = STEP_BYTES_PER_PARAM[compiled] * _updated_params(shape, layout) / hw.memory_bytes_per_s
    return StepTime(compute_s=compute, bubble_s=bubble, comm_intra_bytes=hidden.intra + waited.intra,
                    comm_inter_bytes=hidden.inter + waited.inter, overlapped_comm_s=hidden.seconds,
                    exposed_comm_s=exposed, offload_s=offload, overhead_s=overhead)
