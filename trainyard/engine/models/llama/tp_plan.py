"""Tensor and sequence parallelism for the decoder (Megatron-LM's layout, on DTensor).

`apply_tp(model, tp_mesh)` shards, over the `tp` ranks of one host:

- attention: wq, wk, wv column-parallel (each rank owns n_heads/tp query heads and n_kv_heads/tp key/value
  heads, so grouped-query attention stays local), wo row-parallel;
- MLP: w1 and w3 column-parallel, w2 row-parallel;
- between blocks, activations are sharded along the sequence (sequence parallelism): the norms run on
  1/tp of the tokens, the input of attention and MLP is all-gathered along the sequence, and the
  row-parallel outputs are reduce-scattered back to sequence shards (instead of all-reduced);
- the embedding is vocab-parallel (rows sharded, partial sums reduce-scattered to sequence shards) and
  the output projection is column-parallel over the vocabulary: logits stay sharded along the
  vocabulary, and `loss_context()` computes the cross-entropy on the shards (a max and a sum-exp
  all-reduce per token), never gathering the full logits.

A mixture of experts (`moe.py`) takes the sequence shard as it is: each rank routes its own tokens (the experts,
whole on the rank or spread by expert parallelism, see every token of the rank's shard once). The router is
replicated with its gradient summed over the group (each rank's is that of its tokens), the shared experts are
split like the MLP around a gather and a reduce-scatter of the rank's tokens, and the load-balancing loss counts
the group's tokens (engine/distributed/experts.py).

Missing pieces (a pipeline stage without the embedding or the head) are skipped.
"""
from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

from trainyard.engine.models.llama.moe import MoE
from trainyard.parallel.shapes import from_config


def apply_tp(model: nn.Module, tp_mesh, *, seq_len: int | None = None) -> nn.Module:
    """Shard `model` (a `Transformer` or a pipeline stage of one) over the 1-D `tp_mesh`, in place."""
    tp = tp_mesh.size()
    cfg = model.config
    from_config(cfg).check_tp(tp, seq_len)
    if tp == 1:
        return model
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        # DTensor logits sharded on the vocabulary: the loss runs under loss_context()
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    block_plan = {
        "attention_norm": SequenceParallel(),
        # (x, cos, sin): x arrives sequence-sharded and is gathered; the rope tables are plain tensors
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    moe_plan = {k: v for k, v in block_plan.items() if not k.startswith("feed_forward")} | {
        # the rank's tokens (its sequence shard) in and out as plain tensors
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
        # replicated, the input a shard of the tokens (dim 0 of the flattened rows): the gradient is summed
        "feed_forward.router": SequenceParallel(sequence_dim=0, use_local_output=True),
        "feed_forward.shared": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
        "feed_forward.shared.w1": ColwiseParallel(),
        "feed_forward.shared.w3": ColwiseParallel(),
        "feed_forward.shared.w2": RowwiseParallel(output_layouts=Shard(0)),
    }
    for block in model.layers.values():
        moe = isinstance(block.feed_forward, MoE)
        plan = moe_plan if moe else block_plan
        if moe and block.feed_forward.shared is None:
            plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward.shared")}
        parallelize_module(block, tp_mesh, plan)
    return model


def loss_context(tp: int):
    """The context the forward and backward of a tensor-parallel model run in: cross-entropy on logits
    sharded along the vocabulary (nothing when tp is 1)."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()
