"""Checkpoint layout, commit marker, retention, and a save/load round trip (local and S3)."""
import pytest
import torch

from trainyard.engine import checkpoint as ckpt
from trainyard.engine.model import Transformer, ModelConfig, init_weights
from trainyard.engine.optim import build_optimizer, build_scheduler


def _fake_step(uri: str, step: int, committed: bool) -> None:
    """A step prefix with a shard file, and the commit marker when committed."""
    import fsspec

    base = ckpt.step_uri(uri, step)
    with fsspec.open(f"{base}/__0_0.distcp", "wb") as f:
        f.write(b"shard")
    if committed:
        with fsspec.open(f"{base}/.metadata", "wb") as f:
            f.write(b"meta")


@pytest.fixture(params=["local", "s3"])
def uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run/ckpt"


def test_step_uri_and_types():
    assert ckpt.step_uri("s3://b/p/", 100) == "s3://b/p/step-00000100"
    from pathlib import Path

    with pytest.raises(ValueError, match="str"):
        ckpt.step_uri(Path("/tmp/x"), 1)


def test_latest_ignores_uncommitted_and_unrelated(uri):
    assert ckpt.latest_committed_step(uri) is None  # nothing there yet
    _fake_step(uri, 2, committed=True)
    _fake_step(uri, 4, committed=True)
    _fake_step(uri, 6, committed=False)  # an interrupted save
    import fsspec

    with fsspec.open(f"{uri}/step-latest/x", "wb") as f:  # not a step prefix
        f.write(b"x")
    assert ckpt.list_steps(uri) == {2: True, 4: True, 6: False}
    assert ckpt.latest_committed_step(uri) == 4


def test_purge_keeps_last_two_and_the_protected_step(uri):
    for step in (1, 2, 3, 4):
        _fake_step(uri, step, committed=True)
    _fake_step(uri, 0, committed=False)  # older interrupted save: garbage
    _fake_step(uri, 5, committed=False)  # newer interrupted save: left alone
    assert ckpt.purge(uri, keep_last=2) == [0, 1, 2]
    assert ckpt.list_steps(uri) == {3: True, 4: True, 5: False}
    # the step just written is never deleted, even when it is not among the newest
    assert ckpt.purge(uri, keep_last=1, protect=3) == []
    assert ckpt.purge(uri, keep_last=1) == [3]


def test_validate_uri_requires_existing_bucket(s3_endpoint):
    with pytest.raises(ValueError, match="bucket 'no-such-bucket' does not exist"):
        ckpt.validate_uri("s3://no-such-bucket/ck")
    with pytest.raises(ValueError, match="names no bucket"):
        ckpt.validate_uri("s3:///ck")


def _setup(seed: int):
    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=24, max_seq_len=16)
    model = Transformer(cfg)
    init_weights(model, seed)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    sched = build_scheduler(opt, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    return model, opt, sched


def _train(model, opt, sched, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 32, (2, 9), generator=gen)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_and_load_round_trip(uri):
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 3)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(uri, step, model, opt, sched, keep_last=2)
    assert ckpt.list_steps(uri) == {2: True, 3: True}

    fresh, fresh_opt, fresh_sched = _setup(seed=1)
    assert ckpt.load_checkpoint(uri, 3, fresh, fresh_opt, fresh_sched) == 3
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh_sched.last_epoch == 3
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    state_a, state_b = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(state_a[i]["exp_avg_sq"], state_b[i]["exp_avg_sq"]) for i in state_a)
    # the same next step from both
    _train(model, opt, sched, 1, seed=5)
    _train(fresh, fresh_opt, fresh_sched, 1, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
