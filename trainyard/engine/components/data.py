"""Deterministic training data: the global batch of a step is a pure function of (seed, step).

Every data-parallel rank computes the same global batch and keeps its contiguous slice of rows, so
the same seed and global batch size give the same training data whatever the number of processes,
and a resumed run sees exactly the batches an uninterrupted run would have seen.

Sources:
- `synthetic`: arithmetic progressions modulo SYNTHETIC_IDS (random start and stride per row);
  learnable within ten steps, needs no files.
- token files: a directory of `*.bin` files of little-endian token ids (uint16 or uint32),
  concatenated in file-name order and memory-mapped; each row is a window at a random offset
  (`windows.TokenWindows`, the sampling shared with text).
- text: a directory of `.jsonl` / `.txt` / `.parquet` files and no `*.bin` files, tokenized once with a
  model's tokenizer.json into a cached token array, then sampled like token files (`text.TextSource`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from trainyard.engine.components.formats import TOKEN_DTYPES
from trainyard.engine.components.text import TEXT_SUFFIXES, TextSource, default_cache_dir, text_files
from trainyard.engine.components.windows import TokenWindows, check_shape, max_token, step_generator

# Synthetic strides are drawn from 1..MAX_STRIDE: small enough that a tiny model learns the rule
# quickly, large enough that a bigram table alone cannot predict the next token.
MAX_STRIDE = 16
# Synthetic rows use only the first SYNTHETIC_IDS token ids, so the loss falls within a few steps (from
# ln(vocab) towards ln(64) as the model learns which ids occur) before the stride rule is learnt.
SYNTHETIC_IDS = 64


class Source(Protocol):
    def global_batch(self, step: int) -> torch.Tensor:
        """LongTensor[global_batch_size, seq_len + 1] for `step`; a pure function of (seed, step)."""
        ...


@dataclass(kw_only=True, slots=True)
class SyntheticSource:
    """Each row: (start + i * stride) mod min(vocab_size, SYNTHETIC_IDS) for i in 0..seq_len."""

    seed: int
    """Seed of the data stream."""
    global_batch_size: int
    """Rows per step, over all ranks."""
    seq_len: int
    """Tokens per training sequence; rows have seq_len + 1 tokens (inputs and shifted targets)."""
    vocab_size: int
    """Token ids are in [0, vocab_size)."""

    def __post_init__(self) -> None:
        check_shape(self.global_batch_size, self.seq_len)
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")

    def global_batch(self, step: int) -> torch.Tensor:
        gen = step_generator(self.seed, step)
        rows = self.global_batch_size
        ids = min(self.vocab_size, SYNTHETIC_IDS)
        start = torch.randint(0, ids, (rows, 1), generator=gen)
        stride = torch.randint(1, MAX_STRIDE + 1, (rows, 1), generator=gen)
        pos = torch.arange(self.seq_len + 1).unsqueeze(0)
        return (start + pos * stride) % ids


class TokenFileSource(TokenWindows):
    """Windows of seq_len + 1 tokens from the concatenation of a directory's `*.bin` files."""

    def __init__(self, *, path: str, seed: int, global_batch_size: int, seq_len: int, vocab_size: int,
                 token_dtype: str = "uint16") -> None:
        check_shape(global_batch_size, seq_len)
        if token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"token_dtype must be one of {sorted(TOKEN_DTYPES)}, got {token_dtype!r}")
        dtype = np.dtype(TOKEN_DTYPES[token_dtype])
        if not os.path.isdir(path):
            raise ValueError(f"token directory {path} does not exist or is not a directory")
        names = sorted(n for n in os.listdir(path) if n.endswith(".bin"))
        if not names:
            raise ValueError(f"no *.bin token files in {path}")
        files: list[np.ndarray] = []
        for name in names:
            file = os.path.join(path, name)
            size = os.path.getsize(file)
            if size % dtype.itemsize:
                raise ValueError(
                    f"{file}: size {size} bytes is not a multiple of {dtype.itemsize} "
                    f"(token_dtype {token_dtype}); wrong token_dtype or truncated file"
                )
            if size == 0:
                continue
            tokens = np.memmap(file, dtype=dtype, mode="r")
            top = max_token(tokens)
            if top >= vocab_size:
                raise ValueError(
                    f"{file}: token id {top} >= vocab_size {vocab_size}; the files do not match the "
                    f"model's vocabulary (or token_dtype {token_dtype} is wrong)"
                )
            files.append(tokens)
        super().__init__(files, seed=seed, global_batch_size=global_batch_size, seq_len=seq_len,
                         where=f"{path} ({len(names)} *.bin file(s))")


def channel_dir(channel: str, env: dict | None = None) -> str:
    """The directory of SageMaker channel `channel`: $SM_CHANNEL_<NAME>."""
    env = os.environ if env is None else env
    var = "SM_CHANNEL_" + channel.upper().replace("-", "_")
    path = env.get(var)
    if not path:
        raise ValueError(f"dataset {channel!r}: environment variable {var} is not set (no such input channel)")
    return path


def build_source(dataset: str, *, seed: int, global_batch_size: int, seq_len: int, vocab_size: int,
                 token_dtype: str = "uint16", env: dict | None = None, tokenizer_path: str | None = None) -> Source:
    """`synthetic`, or the name of an input channel holding token files or text files.

    A channel with `*.bin` files is read as token files; one with no `*.bin` file but text files
    (.jsonl/.txt/.parquet, recursively) is tokenized with `tokenizer_path` (a tokenizer.json, or a model
    directory holding one), which it then requires.
    """
    if dataset == "synthetic":
        return SyntheticSource(seed=seed, global_batch_size=global_batch_size, seq_len=seq_len, vocab_size=vocab_size)
    path = channel_dir(dataset, env)
    has_bin = os.path.isdir(path) and any(n.endswith(".bin") for n in os.listdir(path))
    texts = [] if has_bin or not os.path.isdir(path) else text_files(path)
    if texts:
        if tokenizer_path is None:
            raise ValueError(
                f"dataset {dataset!r}: {path} holds {len(texts)} text file(s) ({', '.join(TEXT_SUFFIXES)}) and no "
                f"*.bin token files; tokenizing them needs a tokenizer: pass a model directory with tokenizer.json "
                f"(tokenizer_path)"
            )
        return TextSource(path=path, tokenizer_path=tokenizer_path, seed=seed, global_batch_size=global_batch_size,
                          seq_len=seq_len, vocab_size=vocab_size, cache_dir=default_cache_dir(env))
    return TokenFileSource(path=path, seed=seed, global_batch_size=global_batch_size, seq_len=seq_len,
                           vocab_size=vocab_size, token_dtype=token_dtype)


def rank_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This data-parallel rank's contiguous slice of the global batch's rows."""
    rows = batch.shape[0]
    if rows % world_size:
        raise ValueError(f"global batch of {rows} rows does not split over {world_size} ranks (the data-parallel "
                         f"degree); use a multiple of {world_size} rows")
    per = rows // world_size
    return batch[rank * per:(rank + 1) * per]


def micro_batches(rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """Split a rank's rows into micro-batches of micro_batch_size rows."""
    if rows.shape[0] % micro_batch_size:
        raise ValueError(f"{rows.shape[0]} rows do not split into micro-batches of {micro_batch_size}")
    return list(rows.split(micro_batch_size))
