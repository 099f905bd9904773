"""Memory one GPU holds at the peak of a training step, for the engine's layouts (MiCS on FSDP2, TP with sequence
parallelism, pipeline stages, activation checkpointing). Bytes, by what holds them:

- parameters, gradients, optimizer states (the model states): fp32 master weights (4 B), fp32 gradient shards
  (4 B: the reduction runs in fp32) and AdamW's two fp32 moments (8 B) per parameter of the rank's pipeline
  stage(s), matrices split over tp, all of it sharded over the partition group p: 16 Psi / p (REFERENCE.md),
  in bf16-mixed and fp32 alike; under context parallelism over p x cp ranks (the cp ranks share the group).
- activations: what backward needs of the micro-batches in flight (one without a pipeline; the schedule's
  warm-up depth with one), from the built-in block's saved tensors (`per_layer_bytes`), split over tp; under
  context parallelism for the rank's seq_len / cp tokens, plus the ring's float32 output.
- expert parallelism, or tensor parallelism of a mixture of experts: the rank's n_experts / ep experts of every
  block are held whole (16 bytes per parameter: MiCS leaves them alone, tp does not split them), the rest of the
  block as above.
- buffers: transient copies: two gathered blocks (the one computing and the one prefetched) in the compute
  dtype, the root (embedding, final norm, head) gathered for the whole step, and at the loss (last stage) the
  logits, the saved fp32 log-softmax, its fp32 gradient and that gradient in the compute dtype.
The peak (`Memory.total`) is not the sum of the parts: parameters and optimizer states are held throughout;
activations and buffers peak at the loss, before any gradient exists, and shrink as backward frees them while
the gradients grow (in backward: the activations left, the block being recomputed, the unsharded copies and
gradients, the logits); the optimizer step sees every gradient. The peak is the parameters and optimizer states
plus the largest of the three, which is what the engine measures (tests/job/test_plan_memory.py on CPU,
bench/plan_check.py on a GPU).
The rank reported is the worst of the first pipeline stage (embedding, deepest warm-up) and the last (head,
logits).

CPU offload (FSDP2's CPUOffloadPolicy): the model states live in host memory (`Memory.host`, 16 Psi / p per
rank; the fused CPU AdamW works in place); the GPU holds the gathered copies (always made: the shards are copied
in before each all-gather), the activations, and each block's fp32 gradients until their reduce-scatter sends
the shard to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainyard.job.plan.layout import Layout
from trainyard.parallel.shapes import ModelShape

MASTER, GRAD, ADAM = 4, 4, 8  # bytes per parameter: fp32 weights, fp32 gradient shard, two fp32 moments
# PyTorch's foreach AdamW (the engine's optimizer off CUDA) allocates temporaries of about this share of the
# parameter shards' bytes during its step (0.55-0.64 measured on the CPU layouts of tests/job/test_plan_memory.py);
# the fused AdamW the engine uses on CUDA works in place
FOREACH_TEMPORARIES = 0.6
COMPUTE_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    """What the micro-batches in flight keep for backward."""
    buffers: int
    """FSDP's unsharded copies and, on the last stage, the loss's tensors in its backward."""
    recompute: int = 0
    """One checkpointed block's activations, rebuilt in backward (after the loss's tensors are freed)."""
    gathered: int = 0
    """What is held through backward besides the activations: the unsharded copies, the logits, and the
    unsharded fp32 gradients of the root (reduced only at the end of backward) and of the block in backward."""
    optimizer_step: int = 0
    """Temporaries of the optimizer step (PyTorch's foreach AdamW on CPU; none for the fused one on GPUs)."""
    host: int = 0
    """Host memory of the rank's offloaded model states (CPU offload; 0 otherwise)."""

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        """The peak: parameters and optimizer states throughout, then the larger of the forward's end
        (activations and buffers: the gradients are not there yet) and the optimizer step (every gradient)."""
        backward = self.activations + self.recompute + self.gathered
        step = self.gradients + self.optimizer_step
        return self.parameters + self.optimizer + max(self.activations + self.buffers, backward, step)

    def to_dict(self) -> dict:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "recompute": self.recompute,
                "host": self.host, "total": self.total}


def per_layer_bytes(shape: ModelShape, precision: str) -> float:
    """Bytes one token leaves saved for backward in one block without checkpointing, as the built-in block's
    autograd graph holds them (measured with saved-tensor hooks on CPU, the same in fp32 and bf16, whatever the
    key/value heads: attention sees them repeated to every head): c x (8 dim + 4 ffn) + 4 x 2 dim, c the compute
    dtype's bytes. The c-sized tensors: the two norms' outputs, q, k and v after rotation and repetition, the
    attention output and its contiguous copy (8 dim), the SwiGLU gate, its activation, the up projection and the
    product (4 ffn; a plain MLP keeps 2); the fp32 ones: the two norms' fp32 inputs (2 dim)."""
    c = COMPUTE_BYTES[precision]
    mlp = (4 if shape.gated_mlp else 2) * shape.ffn_hidden
    if shape.n_experts:  # a mixture of experts: the SwiGLUs of the token's top_k and shared experts, and its rows
        # gathered for and returned by the experts
        mlp = 4 * shape.expert_hidden * (shape.top_k + shape.n_shared_experts) + 2 * shape.top_k * shape.dim
    return c * (8 * shape.dim + mlp) + 4 * 2 * shape.dim


def in_flight(layout: Layout, stage_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at once, in units of the rank's whole set of
    layers: 1 without a pipeline; GPipe all m; 1F1B pp - rank (warm-up depth); interleaved 1F1B its warm-up
    of (v - 1) pp + 2 (pp - 1 - rank) + 1 chunk micro-batches, each a 1/v of the rank's layers."""
    pp, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    if pp == 1:
        return 1.0
    if layout.pipeline_schedule == "gpipe":
        return float(m)
    if layout.pipeline_schedule == "1f1b":
        return float(min(m, pp - stage_rank))
    return min(m * v, (v - 1) * pp + 2 * (pp - 1 - stage_rank) + 1) / v


def _activations(shape: ModelShape, layout: Layout, seq_len: int, layers: int, stage_rank: int) -> tuple[float, float]:
    """(bytes kept for backward by the micro-batches in flight, bytes of one block rebuilt by checkpointing)."""
    c = COMPUTE_BYTES[layout.precision]
    tokens = layout.micro_batch_size * seq_len // layout.cp  # context parallelism: the rank's chunks only
    # the ring also saves its float32 output for the backward
    full = (per_layer_bytes(shape, layout.precision) + (4 * shape.dim if layout.cp > 1 else 0)) / layout.tp
    kept = shape.dim * c / layout.tp  # a checkpointed block keeps its input
    ac = layout.activation_checkpointing
    saved = {"none": layers * full, "full": layers * kept,
             "selective": (layers - layers // 2) * kept + layers // 2 * full}[ac]
    return tokens * saved * in_flight(layout, stage_rank), (tokens * full if ac != "none" else 0.0)


def estimate(shape: ModelShape, layout: Layout, seq_len: int, *, fused_optimizer: bool = True) -> Memory:
    """The memory of the rank that needs the most (first or last pipeline stage); `fused_optimizer` False for
    hosts without CUDA (the engine's AdamW is then PyTorch's foreach one, see FOREACH_TEMPORARIES)."""
    c = COMPUTE_BYTES[layout.precision]
    # the states are sharded over the partition group's data-parallel ranks and their context-parallel ranks
    p, tp, pp = layout.partition_group_size * layout.cp, layout.tp, layout.pp
    layers = shape.n_layers // pp
    block = shape.block_matrix_params / tp + 2 * shape.dim
    # expert (or tensor) parallelism: a rank holds n_experts / ep of each block's experts whole (MiCS leaves them alone)
    experts = shape.block_expert_params / layout.ep if shape.experts_held_whole(ep=layout.ep, tp=tp) else 0.0
    if experts:
        block -= shape.block_expert_params / tp
    tokens = layout.micro_batch_size * seq_len // layout.cp
    candidates = []
    for stage_rank in sorted({0, pp - 1}):
        root = 0.0
        if stage_rank == 0:
            root += shape.embedding_params / tp
        if stage_rank == pp - 1:
            root += (shape.head_params - shape.dim) / tp + shape.dim
        params = layers * block + root
        # FSDP2's unsharded copies: two blocks (one prefetched) and the root, in the compute dtype; none when the
        # parameters are used as they are (fp32 in a partition group of one, not offloaded)
        offload = layout.cpu_offload
        gathered = (min(2, layers) * block + root) * c if (p > 1 or c != 4 or offload) else 0.0
        logits = held_logits = 0.0
        if stage_rank == pp - 1:  # the loss's backward: the logits, the saved fp32 log-softmax, its fp32 gradient
            # and that gradient cast to the compute dtype (no cast in fp32, where the fp32 copy is the logits)
            logits = tokens * shape.vocab_size / tp * (c + 4 + 4 + (c if c != 4 else 0))
            held_logits = tokens * shape.vocab_size / tp * c  # the logits stay referenced until backward returns
        # through backward too: the logits, the unsharded fp32 gradients of the root (reduced only when backward
        # ends) and of the block in backward, when a partition group reduces them
        backward = gathered + held_logits + ((root + block) * 4 if (p > 1 or offload) else 0.0)
        stored, rebuilt = _activations(shape, layout, seq_len, layers, stage_rank)
        spread = layers * experts  # expert-parallel experts: whole on the rank, never offloaded
        states = params * (MASTER + GRAD + ADAM) / p
        on_gpu = 0.0 if offload else 1.0
        candidates.append(Memory(
            parameters=round(on_gpu * params * MASTER / p + spread * MASTER),
            gradients=round(on_gpu * params * GRAD / p + spread * GRAD),
            optimizer=round(on_gpu * params * ADAM / p + spread * ADAM),
            activations=round(stored), recompute=round(rebuilt), buffers=round(gathered + logits),
            gathered=round(backward), host=round(states) if offload else 0,
            optimizer_step=0 if fused_optimizer or offload else round(params * MASTER / p * FOREACH_TEMPORARIES)))
    return max(candidates, key=lambda m: m.total)
