"""Deterministic training data: the global batch of a step is a pure function of (seed, step).

Every data-parallel rank computes the same global batch and keeps its contiguous slice of rows, so
the same seed and global batch size give the same training data whatever the number of processes,
and a resumed run sees exactly the batches an uninterrupted run would have seen.

Sources:
- `synthetic`: arithmetic progressions modulo SYNTHETIC_IDS (random start and stride per row);
  learnable within ten steps, needs no files.
- token files: a directory of `*.bin` files of little-endian token ids (uint16 or uint32),
  concatenated in file-name order and memory-mapped; each row is a window at a random offset.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# Synthetic strides are drawn from 1..MAX_STRIDE: small enough that a tiny model learns the rule
# quickly, large enough that a bigram table alone cannot predict the next token.
MAX_STRIDE = 16
# Synthetic rows use only the first SYNTHETIC_IDS token ids, so the loss falls within a few steps (from
# ln(vocab) towards ln(64) as the model learns which ids occur) before the stride rule is learnt.
SYNTHETIC_IDS = 64
# Token files are scanned for their largest id in chunks of this many tokens (bounded memory).
_SCAN_CHUNK = 1 << 24


def step_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator that depends only on (seed, step)."""
    # crc32 gives 32 bits, all that the CPU generator (mt19937) takes from a seed.
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(f"trainyard-data/{seed}/{step}".encode()))


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
        _check_shape(self.global_batch_size, self.seq_len)
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


class TokenFileSource:
    """Windows of seq_len + 1 tokens from the concatenation of a directory's `*.bin` files."""

    def __init__(self, *, path: str, seed: int, global_batch_size: int, seq_len: int, vocab_size: int,
                 token_dtype: str = "uint16") -> None:
        _check_shape(global_batch_size, seq_len)
        if token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"token_dtype must be one of {sorted(TOKEN_DTYPES)}, got {token_dtype!r}")
        self.seed, self.global_batch_size, self.seq_len = seed, global_batch_size, seq_len
        dtype = TOKEN_DTYPES[token_dtype]
        if not os.path.isdir(path):
            raise ValueError(f"token directory {path} does not exist or is not a directory")
        names = sorted(n for n in os.listdir(path) if n.endswith(".bin"))
        if not names:
            raise ValueError(f"no *.bin token files in {path}")
        self.files: list[np.ndarray] = []
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
            top = max(int(tokens[i:i + _SCAN_CHUNK].max()) for i in range(0, len(tokens), _SCAN_CHUNK))
            if top >= vocab_size:
                raise ValueError(
                    f"{file}: token id {top} >= vocab_size {vocab_size}; the files do not match the "
                    f"model's vocabulary (or token_dtype {token_dtype} is wrong)"
                )
            self.files.append(tokens)
        self.starts = np.cumsum([0] + [len(f) for f in self.files])
        self.total = int(self.starts[-1])
        if self.total < seq_len + 1:
            raise ValueError(
                f"{path} holds {self.total} tokens in {len(names)} file(s); at least seq_len + 1 = "
                f"{seq_len + 1} are needed"
            )

    def _window(self, offset: int, length: int) -> np.ndarray:
        """`length` tokens from global position `offset`, crossing file boundaries if needed."""
        out = np.empty(length, dtype=np.int64)
        done = 0
        i = int(np.searchsorted(self.starts, offset, side="right")) - 1
        while done < length:
            local = offset + done - int(self.starts[i])
            take = min(length - done, len(self.files[i]) - local)
            out[done:done + take] = self.files[i][local:local + take]
            done += take
            i += 1
        return out

    def global_batch(self, step: int) -> torch.Tensor:
        gen = step_generator(self.seed, step)
        n = self.seq_len + 1
        offsets = torch.randint(0, self.total - n + 1, (self.global_batch_size,), generator=gen)
        return torch.from_numpy(np.stack([self._window(int(o), n) for o in offsets]))


def _check_shape(global_batch_size: int, seq_len: int) -> None:
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")


def channel_dir(channel: str, env: dict | None = None) -> str:
    """The directory of SageMaker channel `channel`: $SM_CHANNEL_<NAME>."""
    env = os.environ if env is None else env
    var = "SM_CHANNEL_" + channel.upper().replace("-", "_")
    path = env.get(var)
    if not path:
        raise ValueError(f"dataset {channel!r}: environment variable {var} is not set (no such input channel)")
    return path


def build_source(dataset: str, *, seed: int, global_batch_size: int, seq_len: int, vocab_size: int,
                 token_dtype: str = "uint16", env: dict | None = None) -> Source:
    """`synthetic`, or the name of an input channel holding token files."""
    if dataset == "synthetic":
        return SyntheticSource(seed=seed, global_batch_size=global_batch_size, seq_len=seq_len, vocab_size=vocab_size)
    return TokenFileSource(path=channel_dir(dataset, env), seed=seed, global_batch_size=global_batch_size,
                           seq_len=seq_len, vocab_size=vocab_size, token_dtype=token_dtype)


def rank_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This data-parallel rank's contiguous slice of the global batch's rows."""
    rows = batch.shape[0]
    if rows % world_size:
        raise ValueError(f"global batch of {rows} rows does not split over {world_size} ranks")
    per = rows // world_size
    return batch[rank * per:(rank + 1) * per]


def micro_batches(rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """Split a rank's rows into micro-batches of micro_batch_size rows."""
    if rows.shape[0] % micro_batch_size:
        raise ValueError(f"{rows.shape[0]} rows do not split into micro-batches of {micro_batch_size}")
    return list(rows.split(micro_batch_size))
