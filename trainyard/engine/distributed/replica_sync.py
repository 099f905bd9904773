"""MiCS's cross-replica gradient sync: bucketed, overlapped with the backward, optionally compressed.

A MiCS layout with r > 1 replicas shards every block with FSDP2 over its partition group only (1-D mesh
`dp_shard`); FSDP reduce-scatters each block's gradients inside the group as soon as that block's backward is
done, and this class averages the resulting gradient shards over the r replicas (`dp_replicate`).

Buckets are fixed: the parameters in the order their gradients become final in backward (blocks last to
first, then the root's), packed greedily into flat buckets of `bucket_bytes`. During the backward of the
last micro-batch (`final`), FSDP calls each parameter's post-accumulate-grad hook once its shard's
gradient holds the sum over the micro-batches; when every parameter of a bucket has been seen, the bucket is
copied into one flat buffer and its all-reduce (SUM over the replica group) starts asynchronously, so it runs
while the backward of the earlier blocks computes. At the end of the backward (an autograd final
callback, or `finish()`), the buckets still unsent are sent, every one is waited for, and the averaged values
are written back into the gradients. Replicas then hold identical gradients.

Exact: the sum and the division by r are the same operations FSDP2's own HSDP all-reduce does, element for
element (for r = 2 the fp32 result is bit-identical; tests/engine check it).

Compressed (`compression="bf16"` or `"int8"`): each replica quantises its bucket (int8: one fp32 scale per
group of `INT8_GROUP` values, absmax / 127) with error feedback (the quantisation error of a step is added
to the next step's gradient before quantising, as ZeRO++'s qgZ and 1-bit Adam do), the replicas all-gather
the quantised buckets, and every replica dequantises and sums them in replica order in fp32: all replicas get
the same values. A rank sends (r - 1) x the compressed bucket: for r = 2, 1/2 (bf16) or ~1/4 (int8) of the
exact all-reduce's 2 (r - 1) / r x the fp32 bucket; the residual costs one fp32 copy of the rank's gradient
shard.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainyard.parallel.parallelism import REPLICA_COMPRESSIONS

INT8_GROUP = 512


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class ReplicaSync:
    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, bucket_bytes: int,
                 compression: str | None = None):
        if compression not in (None, *REPLICA_COMPRESSIONS):
            raise ValueError(f"replica sync compression must be one of {list(REPLICA_COMPRESSIONS)} or None, got {compression!r}")
        if bucket_bytes < 1:
            raise ValueError(f"replica sync bucket size must be at least 1 byte, got {bucket_bytes}")
        self.group, self.compression = group, compression
        self.size = dist.get_world_size(group)
        self.params = params
        self.final = True
        """Whether the running backward is the last micro-batch's (set by `sync_microbatch`): only then do the
        gradients hold their sum over the micro-batches. True by default, so that a plain loop without
        accumulation syncs every backward (syncing an already averaged gradient again leaves it as it is)."""
        self.buckets: list[list[int]] = []
        size = 0
        for i, p in enumerate(params):
            nbytes = _local(p).numel() * 4
            if not self.buckets or size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
        self.bucket_of = [b for b, members in enumerate(self.buckets) for _ in members]
        self.residual: dict[int, torch.Tensor] = {}
        self._pending: list[int] = []
        self._sent: dict[int, tuple] = {}
        self._active = False
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def _hook(self, index: int):
        def ready(param: nn.Parameter) -> None:
            if not self.final:
                return
            if not self._active:
                self._start()
            b = self.bucket_of[index]
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._send(b)
        return ready

    def _start(self) -> None:
        self._active = True
        self._pending = [len(m) for m in self.buckets]
        self._sent = {}
        # runs when autograd finishes this backward, after FSDP's own final callback (queued earlier)
        torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def _grads(self, b: int) -> list[tuple[int, torch.Tensor]]:
        return [(i, _local(self.params[i].grad)) for i in self.buckets[b] if self.params[i].grad is not None]

    def _send(self, b: int) -> None:
        grads = self._grads(b)
        if not grads:
            self._sent[b] = (None, None, grads)
            return
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1).float() for _, g in grads])
            if self.compression is None:
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                self._sent[b] = (work, flat, grads)
                return
            residual = self.residual.get(b)
            if residual is not None and residual.shape == flat.shape:  # (a parameter without a gradient changes it)
                flat += residual
            packed = pack(flat, self.compression)
            self.residual[b] = flat - unpack(packed, self.compression, flat.numel())
            gathered = packed.new_empty(self.size * packed.numel())
            work = dist.all_gather_single(gathered, packed, group=self.group, async_op=True)
            self._sent[b] = (work, gathered.view(self.size, -1), grads)

    def finish(self) -> None:
        """Send what is unsent, wait for every bucket, write the averages into the gradients (idempotent)."""
        if not self._active:
            return
        self._active = False
        for b in range(len(self.buckets)):
            if b not in self._sent:
                self._send(b)
        with torch.no_grad():
            for b in range(len(self.buckets)):
                work, buf, grads = self._sent[b]
                if work is None:
                    continue
                work.wait()
                if self.compression is None:
                    total = buf
                else:
                    n = sum(g.numel() for _, g in grads)
                    total = unpack(buf[0], self.compression, n)
                    for k in range(1, self.size):
                        total += unpack(buf[k], self.compression, n)
                total.div_(self.size)
                offset = 0
                for _, g in grads:
                    g.copy_(total[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
        self._sent = {}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def pack(flat: torch.Tensor, compression: str) -> torch.Tensor:
    """`flat` (fp32) compressed to one tensor: bf16 values, or uint8 bytes of int8 values then fp32 scales."""
    if compression == "bf16":
        return flat.to(torch.bfloat16)
    n = flat.numel()
    groups = -(-n // INT8_GROUP)
    padded = torch.zeros(groups * INT8_GROUP, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    padded = padded.view(groups, INT8_GROUP)
    scale = padded.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(padded / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q.view(-1).view(torch.uint8), scale.view(torch.uint8)])


def unpack(packed: torch.Tensor, compression: str, n: int) -> torch.Tensor:
    """The fp32 values of `pack`'s result for `n` values."""
    if compression == "bf16":
        return packed.float()
    groups = -(-n // INT8_GROUP)
    q = packed[:groups * INT8_GROUP].view(torch.int8).view(groups, INT8_GROUP).float()
    scale = packed[groups * INT8_GROUP:].view(torch.float32)
    return (q * scale[:, None]).view(-1)[:n]
