"""`distribution="auto"`: the plan's best fitting layout as a typed `distribution`, and the record of the choice
that the job's description keeps (`describe()["Plan"]`)."""
from __future__ import annotations

from trainyard.errors import ConfigError
from trainyard.job.plan.planner import Plan, PlannedLayout, plan
from trainyard.parallel.shapes import ModelShape


def choose(model: str | ModelShape, *, seq_len: int, global_batch_size: int, instance_type: str, instance_count: int,
           processes_per_host: int, precision: str, micro_batch_size: int | None = None,
           compile: bool = False) -> tuple[PlannedLayout, Plan]:
    """The best layout that fits (ConfigError naming the closest one and by how much otherwise)."""
    result = plan(model, seq_len=seq_len, global_batch_size=global_batch_size, instance_type=instance_type,
                  instance_count=instance_count, precision=precision, processes_per_host=processes_per_host,
                  micro_batch_size=micro_batch_size, compile=compile)
    if result.best is None:
        near = result.layouts[0]
        raise ConfigError("distribution", f"'auto': no layout of {result.model.name} fits {instance_count} x "
                                          f"{result.hardware.instance_type}; the closest "
                                          f"({near.layout.distribution()}) "
                                          f"is {near.over_bytes / 2 ** 30:.1f} GiB over per GPU. Use more or larger "
                                          "instances, a shorter seq_len or a smaller micro_batch_size")
    return result.best, result


def record(chosen: PlannedLayout, result: Plan) -> dict:
    """What describe() shows of the choice: the layout, its predictions and how many layouts were weighed."""
    return {"chosen": chosen.to_dict(), "layouts_considered": len(result.layouts),
            "layouts_fitting": sum(p.fits for p in result.layouts), "model": result.model.name,
            "seq_len": result.seq_len, "global_batch_size": result.global_batch_size, "compile": result.compiled}


def summary(chosen: PlannedLayout, compiled: bool = False) -> str:
    """One line for the console before launch."""
    lay = chosen.layout
    pipe = f", pp {lay.pp} {lay.pipeline_schedule}" if lay.pp > 1 else ""
    pipe += f", cp {lay.cp}" if lay.cp > 1 else ""
    pipe += f", ep {lay.ep}" if lay.ep > 1 else ""
    return (f"distribution 'auto': dp {lay.dp} (partition groups of {lay.partition_group_size}), tp {lay.tp}{pipe}, "
            f"micro-batch {lay.micro_batch_size} x {lay.microbatches}, activation checkpointing "
            f"{lay.activation_checkpointing}, {lay.precision}: {chosen.memory.total / 2 ** 30:.2f} GiB per rank, "
            f"{chosen.tokens_per_s_per_gpu:,.0f} tokens/s per rank predicted{' (compiled)' if compiled else ''}")
