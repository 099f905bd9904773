"""Deterministic data: synthetic and token-file sources, rank slices, micro-batches, validation."""
import numpy as np
import pytest
import torch

from trainyard.engine.components.data import (SYNTHETIC_IDS, SyntheticSource, TokenFileSource, build_source, channel_dir, micro_batches,
                                   rank_rows)


def _synthetic(seed=0, rows=8, seq_len=16, vocab=100):
    return SyntheticSource(seed=seed, global_batch_size=rows, seq_len=seq_len, vocab_size=vocab)


def test_synthetic_is_a_pure_function_of_seed_and_step():
    a, b = _synthetic(), _synthetic()
    batch = a.global_batch(3)
    assert batch.shape == (8, 17) and batch.dtype == torch.long
    assert torch.equal(batch, b.global_batch(3))
    assert torch.equal(a.global_batch(5), b.global_batch(5))  # order of calls does not matter
    assert not torch.equal(batch, a.global_batch(4))
    assert not torch.equal(batch, _synthetic(seed=1).global_batch(3))
    assert 0 <= batch.min() and batch.max() < 100


def test_synthetic_rows_are_progressions():
    batch = _synthetic(vocab=1000).global_batch(1)
    assert batch.max() < SYNTHETIC_IDS  # only the first ids occur
    diffs = (batch[:, 1:] - batch[:, :-1]) % SYNTHETIC_IDS
    assert torch.all(diffs == diffs[:, :1])  # constant stride per row


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_rank_slices_concatenate_to_global_batch(world):
    batch = _synthetic().global_batch(2)
    parts = [rank_rows(batch, r, world) for r in range(world)]
    assert torch.equal(torch.cat(parts), batch)
    micro = [mb for part in parts for mb in micro_batches(part, 1)]
    assert torch.equal(torch.cat(micro), batch)


def test_uneven_splits_fail():
    batch = _synthetic(rows=6).global_batch(0)
    with pytest.raises(ValueError, match="4 ranks"):
        rank_rows(batch, 0, 4)
    with pytest.raises(ValueError, match="micro-batches of 4"):
        micro_batches(batch, 4)


def _write(path, name, tokens, dtype="<u2"):
    np.asarray(tokens, dtype=dtype).tofile(path / name)


def test_token_files_in_name_order_and_windows(tmp_path):
    # 0..99 split over files whose name order differs from their creation order
    _write(tmp_path, "b.bin", range(40, 100))
    _write(tmp_path, "a.bin", range(0, 40))
    (tmp_path / "notes.txt").write_text("ignored")
    src = TokenFileSource(path=str(tmp_path), seed=0, global_batch_size=16, seq_len=9, vocab_size=100)
    assert src.total == 100
    batch = src.global_batch(1)
    assert batch.shape == (16, 10) and batch.dtype == torch.long
    # the concatenation is 0..99, so every window is consecutive integers, also across files
    assert torch.all(batch[:, 1:] - batch[:, :-1] == 1)
    assert torch.equal(batch, src.global_batch(1))
    assert not torch.equal(batch, src.global_batch(2))


def test_token_files_uint32(tmp_path):
    _write(tmp_path, "x.bin", [70000, 70001, 70002, 70003], dtype="<u4")
    src = TokenFileSource(path=str(tmp_path), seed=0, global_batch_size=2, seq_len=3, vocab_size=70004,
                          token_dtype="uint32")
    assert src.global_batch(0).tolist() == [[70000, 70001, 70002, 70003]] * 2


def test_channel_via_environment(tmp_path):
    _write(tmp_path, "0.bin", range(50))
    env = {"SM_CHANNEL_TRAIN": str(tmp_path)}
    src = build_source("train", seed=0, global_batch_size=2, seq_len=4, vocab_size=50, env=env)
    assert isinstance(src, TokenFileSource)
    with pytest.raises(ValueError, match="SM_CHANNEL_VALIDATION"):
        channel_dir("validation", env)


def test_empty_channel(tmp_path):
    with pytest.raises(ValueError, match=r"no \*\.bin token files"):
        TokenFileSource(path=str(tmp_path), seed=0, global_batch_size=2, seq_len=4, vocab_size=50)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 0 tokens"):
        TokenFileSource(path=str(tmp_path), seed=0, global_batch_size=2, seq_len=4, vocab_size=50)
    with pytest.raises(ValueError, match="does not exist"):
        TokenFileSource(path=str(tmp_path / "missing"), seed=0, global_batch_size=2, seq_len=4, vocab_size=50)


def test_too_few_tokens(tmp_path):
    _write(tmp_path, "a.bin", range(4))
    with pytest.raises(ValueError, match="at least seq_len"):
        TokenFileSource(path=str(tmp_path), seed=0, global_batch_size=2, seq_len=4, vocab_size=50)


def test_token_out_of_vocabulary(tmp_path):
    _write(tmp_path, "a.bin", [1, 2, 3, 4, 5, 60, 7])
    with pytest.raises(ValueError, match=r"a\.bin: token id 60 >= vocab_size 50"):
        TokenFileSource(path=str(tmp_path), seed=0, global_batch_size=2, seq_len=4, vocab_size=50)


def test_file_size_not_a_multiple_of_dtype(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="not a multiple of 2"):
        TokenFileSource(path=str(tmp_path), seed=0, global_batch_size=2, seq_len=1, vocab_size=50)


def test_bad_token_dtype(tmp_path):
    with pytest.raises(ValueError, match="token_dtype"):
        TokenFileSource(path=str(tmp_path), seed=0, global_batch_size=2, seq_len=1, vocab_size=50, token_dtype="int8")
