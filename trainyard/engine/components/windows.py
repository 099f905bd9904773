"""Token windows: the sampling every file-backed data source shares.

A source holds one or more token arrays (memory-mapped files), taken as one concatenated stream of
`total` tokens. The global batch of step N is `global_batch_size` windows of seq_len + 1 tokens at
offsets drawn uniformly from [0, total - seq_len] by `step_generator(seed, N)`; a window may cross
from one array into the next. So the batch is a pure function of (seed, step) and of the stream,
whatever the number of processes that compute it.

`data.TokenFileSource` (token `.bin` files) and `text.TextSource` (tokenized text) both derive from
`TokenWindows`; this module imports neither, so that `data` can import `text`.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

# Arrays are scanned for their largest id in chunks of this many tokens (bounded memory).
_SCAN_CHUNK = 1 << 24


def step_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator that depends only on (seed, step)."""
    # crc32 gives 32 bits, all that the CPU generator (mt19937) takes from a seed.
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(f"trainyard-data/{seed}/{step}".encode()))


def check_shape(global_batch_size: int, seq_len: int) -> None:
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")


def max_token(tokens: np.ndarray) -> int:
    """The largest id in `tokens` (-1 when empty), read in bounded chunks."""
    return max((int(tokens[i:i + _SCAN_CHUNK].max()) for i in range(0, len(tokens), _SCAN_CHUNK)), default=-1)


class TokenWindows:
    """Windows of seq_len + 1 tokens at (seed, step)-determined offsets into concatenated token arrays."""

    def __init__(self, arrays: list[np.ndarray], *, seed: int, global_batch_size: int, seq_len: int,
                 where: str) -> None:
        """`where` names the data in the error raised when it holds fewer than seq_len + 1 tokens."""
        check_shape(global_batch_size, seq_len)
        self.seed, self.global_batch_size, self.seq_len = seed, global_batch_size, seq_len
        self.arrays = [a for a in arrays if len(a)]
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.total = int(self.starts[-1])
        if self.total < seq_len + 1:
            raise ValueError(f"{where} holds {self.total} tokens; at least seq_len + 1 = {seq_len + 1} are needed")

    def _window(self, offset: int, length: int) -> np.ndarray:
        """`length` tokens from global position `offset`, crossing array boundaries if needed."""
        out = np.empty(length, dtype=np.int64)
        done = 0
        i = int(np.searchsorted(self.starts, offset, side="right")) - 1
        while done < length:
            local = offset + done - int(self.starts[i])
            take = min(length - done, len(self.arrays[i]) - local)
            out[done:done + take] = self.arrays[i][local:local + take]
            done += take
            i += 1
        return out

    def global_batch(self, step: int) -> torch.Tensor:
        """LongTensor[global_batch_size, seq_len + 1] for `step`; a pure function of (seed, step)."""
        gen = step_generator(self.seed, step)
        n = self.seq_len + 1
        offsets = torch.randint(0, self.total - n + 1, (self.global_batch_size,), generator=gen)
        return torch.from_numpy(np.stack([self._window(int(o), n) for o in offsets]))
