"""The built-in Llama-style `Transformer` as a registered spec: blocks `layers.*`, Megatron-style TP with
sequence parallelism and a vocab-parallel loss (`tp_plan.py`), pipeline stages cut from `layers` with the
embedding first and the final norm and head last (its forward skips what a stage lacks), weights seeded by
parameter name (`model.init_weights`); context parallelism by ring attention on zig-zag chunks (`cp.py`); a
mixture of experts' balance group and expert parallelism (`moe.py`)."""
from __future__ import annotations

from torch import nn

from trainyard.parallel.shapes import from_config
from trainyard.engine.models.llama.cp import apply_cp
from trainyard.engine.models.llama.model import Transformer, init_weights
from trainyard.engine.models.llama.moe import apply_moe
from trainyard.engine.models.llama.tp_plan import apply_tp, loss_context
from trainyard.engine.protocols import ModelSpec, StageSplit


def _check_tp(model: Transformer, tp: int) -> None:
    from_config(model.config).check_tp(tp)


def spec_for(model: nn.Module) -> ModelSpec | None:
    if not isinstance(model, Transformer):
        return None
    return ModelSpec(name="llama", blocks=lambda m: list(m.layers.values()), apply_tp=apply_tp, check_tp=_check_tp,
                     apply_cp=apply_cp, apply_moe=apply_moe,
                     stages=StageSplit(blocks="layers", first=("tok_embeddings",), last=("norm", "output"),
                                       context_parallel=True),
                     init_sharded=init_weights, loss_context=loss_context)
