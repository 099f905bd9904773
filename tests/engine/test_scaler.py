"""float16 with dynamic loss scaling (components/scaler.py, te.scaler, te.optimizer_step, the built-in trainer's
dtype float16): the scaler's rules with injected infs, its state in checkpoints, the engine's steps that scale,
unscale and skip, and (slow) two ranks of which only one holds the inf, in spawned processes against an
unsharded oracle (scaler_worker.py)."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainyard.engine.components.scaler import GradScaler
from tests.engine.launch import run_on_two_hosts

WORKER = os.path.join(os.path.dirname(__file__), "scaler_worker.py")


def linear_and_scaler(**kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1), GradScaler(model.parameters, **kwargs)


def backward(model, scaler, *, poison: bool = False):
    loss = model(torch.ones(2, 4)).square().mean()
    scaler.scale(loss).backward()
    if poison:  # an overflow in one gradient element
        model.weight.grad[1, 2] = math.inf
    return loss


def test_an_inf_skips_the_step_halves_the_scale_and_the_next_clean_step_applies():
    model, opt, scaler = linear_and_scaler(init_scale=2.0 ** 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    backward(model, scaler, poison=True)
    assert scaler.step(opt) is False
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 9 and scaler.skipped_steps == 1 and scaler.growth_tracker == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # weights unchanged
    assert not opt.state  # the optimizer never stepped: no moments
    opt.zero_grad()

    backward(model, scaler)
    want = model.weight.grad / 2.0 ** 9  # the true gradient: the scaled one over the scale
    assert scaler.unscale_() is False
    torch.testing.assert_close(model.weight.grad, want)
    assert scaler.step(opt) is True
    scaler.update()
    assert not torch.equal(before["weight"], model.weight) and scaler.get_scale() == 2.0 ** 9
    assert scaler.growth_tracker == 1


def test_nan_counts_as_inf_and_unscale_runs_once_per_step():
    model, opt, scaler = linear_and_scaler(init_scale=8.0)
    backward(model, scaler)
    model.bias.grad[0] = math.nan
    assert scaler.unscale_() is True and scaler.unscale_() is True  # the verdict, not a second division
    assert scaler.step(opt) is False
    scaler.update()
    assert scaler.get_scale() == 4.0


def test_the_scale_grows_after_growth_interval_clean_steps():
    model, opt, scaler = linear_and_scaler(init_scale=4.0, growth_interval=3)
    scales = []
    for step in range(8):
        backward(model, scaler, poison=step == 4)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    # 3 clean steps: x2; the inf at step 4 halves it and restarts the count; 3 clean steps (5, 6, 7): x2
    assert scales == [4.0, 4.0, 8.0, 8.0, 4.0, 4.0, 4.0, 8.0]


def test_a_disabled_scaler_is_a_pass_through():
    model, opt, scaler = linear_and_scaler(enabled=False)
    loss = model(torch.ones(2, 4)).sum()
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    loss.backward()
    grad = model.weight.grad.clone()
    assert scaler.unscale_() is False and torch.equal(grad, model.weight.grad)
    assert scaler.step(opt) is True
    scaler.update()


def test_misuse_is_refused_naming_the_fix():
    model, opt, scaler = linear_and_scaler()
    with pytest.raises(RuntimeError, match="no inf/nan check"):
        scaler.update()
    backward(model, scaler)
    scaler.unscale_()
    with pytest.raises(RuntimeError, match="te.optimizer_step"):  # a new step's loss before the last one ended
        scaler.scale(torch.ones(()))
    for bad in ({"init_scale": 0}, {"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"growth_interval": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GradScaler(model.parameters, **bad)


def test_state_dict_round_trips_as_tensors():
    _, _, scaler = linear_and_scaler(init_scale=2.0 ** 13)
    scaler.growth_tracker, scaler.skipped_steps = 7, 2
    state = scaler.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    other = GradScaler(list)
    other.load_state_dict(state)
    assert (other.get_scale(), other.growth_tracker, other.skipped_steps) == (2.0 ** 13, 7, 2)


# --- through the engine's API, one process --------------------------------------------------------------------

VOCAB = 64


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.stack = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                   for _ in range(2))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for block in self.stack:
            h = h + block(h)
        return self.head(h)


def loss_fn(output, targets):
    return F.cross_entropy(output.float().flatten(0, 1), targets.flatten())


def fp16_model(precision="fp16", **kwargs):
    import trainyard.engine as te

    torch.manual_seed(3)
    return te.transform(MLP(), mixed_precision=precision, **kwargs)


def data(step: int = 0):
    g = torch.Generator().manual_seed(step)
    rows = torch.randint(0, VOCAB, (4, 17), generator=g)
    return rows[:, :-1], rows[:, 1:]


def test_fp16_transform_scales_the_backward_and_unscales_before_clipping(engine):
    import trainyard.engine as te

    assert not te.scaler(fp16_model("bf16")).enabled and not te.scaler(fp16_model(torch.float32)).enabled
    norms, losses = [], []
    for scale in (1.0, 2.0 ** 14):  # the same model and data: unscaled gradients agree, whatever the scale
        model = fp16_model()
        scaler = te.scaler(model)
        assert scaler.enabled and next(model.parameters()).dtype == torch.float32  # fp32 master weights
        scaler.load_state_dict({"scale": torch.tensor(scale), "growth_tracker": torch.tensor(0),
                                "skipped_steps": torch.tensor(0)})
        losses.append(te.forward_backward(model, *data(), loss_fn, microbatches=2))
        norms.append(te.clip_grad_norm_(model, math.inf))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and 3 < losses[0] < 5  # the loss is not scaled
    assert norms[0] == pytest.approx(norms[1], rel=1e-2)


def test_accumulate_loop_with_te_scaler_skips_an_overflow_and_trains(engine):
    import trainyard.engine as te

    model = fp16_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = te.scaler(model)
    weights = lambda: {k: v.full_tensor().clone() for k, v in model.state_dict().items()}  # noqa: E731
    losses = []
    for step in range(1, 9):
        x, y = data(step % 2)
        loss = 0.0
        for i, (xb, yb) in enumerate(zip(x.chunk(2), y.chunk(2))):
            with te.accumulate(model, i, 2):
                part = loss_fn(model(xb), yb) / 2
                scaler.scale(part).backward()
            loss += part.item()
        if step == 3:  # an overflow in one gradient
            next(model.parameters()).grad.to_local()[0, 0] = math.inf
            before = weights()
        te.clip_grad_norm_(model, 1.0)
        stepped = te.optimizer_step(model, opt)
        opt.zero_grad()
        assert stepped == (step != 3)
        if step == 3:
            assert all(torch.equal(before[k], v) for k, v in weights().items())
            assert scaler.get_scale() == 2.0 ** 15
        losses.append(loss)
    assert scaler.skipped_steps == 1
    assert losses[-1] < losses[0] - 0.5


def test_checkpoint_saves_and_resumes_the_loss_scale(engine, tmp_path, capsys):
    import trainyard.engine as te

    model = fp16_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = te.scaler(model)
    for poisoned in (True, True, False):  # two overflows and a clean step: scale 2^14, tracker 1
        te.forward_backward(model, *data(), loss_fn)
        if poisoned:
            next(model.parameters()).grad.to_local()[0, 0] = math.nan
        te.optimizer_step(model, opt)
        opt.zero_grad()
    assert (scaler.get_scale(), scaler.growth_tracker, scaler.skipped_steps) == (2.0 ** 14, 1, 2)
    te.save_checkpoint(model, opt, 3, uri=str(tmp_path / "fp16"), blocking=True)

    resumed = fp16_model()
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    assert te.scaler(resumed).get_scale() == 2.0 ** 16
    assert te.load_checkpoint(resumed, opt2, uri=str(tmp_path / "fp16")) == 3
    got = te.scaler(resumed)
    assert (got.get_scale(), got.growth_tracker, got.skipped_steps) == (2.0 ** 14, 1, 2)

    # a bf16 run's checkpoint holds no scaler: a float16 run resumes from it with a fresh scale, and says so
    bf16 = fp16_model("bf16")
    opt3 = torch.optim.AdamW(bf16.parameters(), lr=1e-3)
    te.forward_backward(bf16, *data(), loss_fn)
    te.optimizer_step(bf16, opt3)
    te.save_checkpoint(bf16, opt3, 4, uri=str(tmp_path / "bf16"), blocking=True)
    capsys.readouterr()
    fresh = fp16_model()
    assert te.load_checkpoint(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), uri=str(tmp_path / "bf16")) == 4
    assert te.scaler(fresh).get_scale() == 2.0 ** 16
    assert "holds no loss-scaler state" in capsys.readouterr().out


def test_fp16_with_compressed_replica_sync_is_refused(engine):
    import trainyard.engine as te

    with pytest.raises(ValueError, match="float16 with mics.replica_compression 'int8'.*set replica_compression to null"):
        te.transform(MLP(), mixed_precision="fp16", distribution={"mics": {"replica_compression": "int8"}})


def test_builtin_trainer_float16_skips_overflowing_steps_and_learns(engine, tmp_path, monkeypatch, capsys):
    """A tiny float16 job on CPU: the scale starts at 2^24, where the fp16 gradients overflow for real; each
    overflowing step is skipped (weights, optimizer and LR schedule untouched) and halves the scale, the rest
    train and the loss falls."""
    from trainyard.engine.config import TrainConfig
    from trainyard.engine.trainer import Trainer

    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(tmp_path))
    trainer = Trainer(TrainConfig(model="tiny", dtype="float16", steps=14, seq_len=32, global_batch_size=8,
                                  micro_batch_size=2, warmup_steps=2, save_model=False))
    trainer.scaler.load_state_dict({"scale": torch.tensor(2.0 ** 24), "growth_tracker": torch.tensor(0),
                                    "skipped_steps": torch.tensor(0)})
    steps = []
    trainer.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    assert trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in rows if r["skipped"]]
    # where fp16 overflows depends on the data too: the first steps at least, later ones perhaps
    assert skipped[:2] == [1, 2] and len(skipped) < 10, skipped
    assert len(steps) == 14 - len(skipped)  # the optimizer stepped on the others only
    for r, nxt in zip(rows, rows[1:]):
        assert nxt["loss_scale"] == r["loss_scale"] / (2 if r["skipped"] else 1)  # growth_interval is 2000
        if r["skipped"]:
            assert nxt["lr"] == r["lr"]  # the schedule did not advance over a skipped step
    applied = [r for r in rows if not r["skipped"]]
    assert applied[-1]["loss"] < applied[0]["loss"] - 0.5
    out = capsys.readouterr().out
    assert f"step 1/14 skipped: inf/nan gradients at loss scale {2 ** 24}, now {2 ** 23}" in out
    assert "dtype float16" in out


def test_builtin_trainer_float16_stops_a_diverged_run_instead_of_skipping_every_step(engine, tmp_path, monkeypatch,
                                                                                      capsys):
    """lr 50 blows the weights up at the first step; every later step's loss is nan and is skipped. Once the
    scale falls below 1 the trainer fails naming the divergence and the fixes (before, the job skipped every
    step to the end and reported success)."""
    from trainyard.engine.config import TrainConfig
    from trainyard.engine.trainer import MIN_LOSS_SCALE, Trainer

    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(tmp_path))
    trainer = Trainer(TrainConfig(model="tiny", dtype="float16", steps=40, seq_len=32, global_batch_size=8,
                                  micro_batch_size=2, warmup_steps=1, lr=50.0, save_model=False))
    trainer.scaler.load_state_dict({"scale": torch.tensor(8.0), "growth_tracker": torch.tensor(0),
                                    "skipped_steps": torch.tensor(0)})
    with pytest.raises(RuntimeError, match=r"dtype float16: the loss scale fell below 1 at step \d+ .*the run "
                                           r"diverged; lower lr .*or use dtype bfloat16 or float32"):
        trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] < 40 and rows[-1]["skipped"] and rows[-1]["loss_scale"] == MIN_LOSS_SCALE  # its row too
    assert "the loss itself is not finite" in capsys.readouterr().out


# --- two processes: the inf on one rank's shard only ------------------------------------------------------------

@pytest.mark.slow
def test_an_inf_on_one_ranks_shard_skips_the_step_on_every_rank(tmp_path):
    """MiCS over 2 ranks, tensor parallelism 2 and a 2-stage pipeline, fp16 with the built-in model: step 2's
    gradient gets an inf on one rank's local shard only; both ranks skip it and halve the scale, and the weights
    after 3 steps moved as an unsharded fp32 oracle's that took steps 1 and 3 only."""
    cases = [{"distribution": {}, "poison_rank": 1},
             {"distribution": {"tensor_parallel_degree": 2}, "poison_rank": 1},
             {"distribution": {"pipeline_parallel_degree": 2}, "poison_rank": 0}]
    results = run_on_two_hosts(WORKER, cases, tmp_path, processes_per_host=2, hosts=1)
    for case, result in zip(cases, results):
        assert result["stepped"] == [[True, False, True]] * 2, (case, result)  # rank 0 and rank 1 agree
        assert result["scales"] == [[2.0 ** 16, 2.0 ** 16, 2.0 ** 15]] * 2, (case, result)  # at the start of each step
        assert result["update_rel_err"] < 0.05, (case, result)  # fp16 against fp32, same two updates
        assert result["update_rel_err_if_applied"] > 0.2, (case, result)  # what applying step 2 would have given
