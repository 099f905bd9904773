"""One candidate layout of a job: the degrees and the settings the planner varies, and the `distribution`
(Trainyard's typed form) that asks the engine for it."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    dp: int
    """Data-parallel ranks (world / (tp x pp x cp))."""
    partition_group_size: int
    """MiCS partition group p: model states sharded over p data-parallel ranks (p = dp: ZeRO-3; 1: DDP)."""
    tp: int
    pp: int
    pipeline_schedule: str
    """`none` without a pipeline, else gpipe, 1f1b or interleaved_1f1b."""
    virtual_stages: int
    micro_batch_size: int
    """Sequences per forward/backward on one data-parallel rank."""
    microbatches: int
    """Micro-batches per rank per step (gradient accumulation steps; the pipeline's micro-batches)."""
    activation_checkpointing: str
    """none, selective (every second block) or full (every block)."""
    precision: str
    """bf16 (bf16 compute, fp32 master weights, gradients and optimizer states) or fp32."""
    cpu_offload: bool = False
    """Sharded parameters, gradients and optimizer states in host memory (`mics.cpu_offload`)."""
    cp: int = 1
    """Context-parallel ranks one sequence is split over (inside a host)."""
    ep: int = 1
    """Expert-parallel ranks a mixture of experts' experts are spread over (data-parallel ranks)."""

    @property
    def replicas(self) -> int:
        return self.dp // self.partition_group_size

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def distribution(self) -> dict:
        """The typed `distribution` that runs this layout."""
        mics: dict = {"partition_group_size": self.partition_group_size}
        if self.cpu_offload:
            mics["cpu_offload"] = True
        d: dict = {"mics": mics,
                   "tensor_parallel_degree": self.tp, "pipeline_parallel_degree": self.pp,
                   "activation_checkpointing": self.activation_checkpointing, "mixed_precision": self.precision,
                   "gradient_accumulation_steps": self.microbatches}
        if self.pp > 1:
            d |= {"pipeline_schedule": self.pipeline_schedule, "virtual_stages": self.virtual_stages,
                  "microbatches": self.microbatches}
        if self.cp > 1:
            d["context_parallel_degree"] = self.cp
        if self.ep > 1:
            d["expert_parallel_degree"] = self.ep
        return d

    def to_dict(self) -> dict:
        return asdict(self)
