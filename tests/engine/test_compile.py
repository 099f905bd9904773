"""`transform(model, compile=True)` (the built-in trainer's `compile` hyperparameter): each block's forward goes
through torch.compile and the model trains to the losses of eager mode (one process, fp32, 3 steps, 1e-5
relative: inductor fuses the elementwise work and rounds differently)."""
import pytest
import torch
from torch._dynamo.utils import counters

import trainyard.engine as te
from trainyard.engine.models.llama.model import MODEL_CONFIGS, build_model

pytestmark = pytest.mark.slow  # inductor compiles a block on CPU: ~25 s here


def _losses(compile_on: bool) -> list[float]:
    cfg = MODEL_CONFIGS["tiny"]
    with torch.device("meta"):
        model = build_model(cfg)
    model = te.transform(model, seed=3, compile=compile_on)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        loss = te.lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_compiled_blocks_train_to_the_eager_losses(engine):
    torch._dynamo.reset()
    counters.clear()
    want = _losses(False)
    assert not counters["stats"]["unique_graphs"]  # eager: nothing compiled
    got = _losses(True)
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks' forward went through dynamo
    assert got == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0]
    torch._dynamo.reset()
