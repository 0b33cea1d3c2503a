"""LLM-style training data: one flat array of token ids on disk, read in windows, sharded by rank, resumable.

A corpus is tokenized once; the token ids of all its documents, one after the other, are written to
one binary file (``write_tokens``), as uint16 when the vocabulary fits in 16 bits and uint32 when
it does not (``token_dtype``). Training maps the file into memory (``open_tokens``, a read-only
``numpy.memmap``) and reads only the windows it needs: ``TokenBatches`` cuts the stream into
windows of ``seq_len + 1`` tokens (input = the first ``seq_len``, target = the last ``seq_len``),
shuffles them per epoch with a seeded permutation that every rank computes alike, gives each
rank a disjoint and equal share, and keeps its position (epoch, step) in a ``state_dict`` so that
a restarted run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["token_dtype", "write_tokens", "open_tokens", "TokenBatches"]


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """The smallest unsigned integer type that holds every token id of a vocabulary: uint16 up to 65,536 entries, else uint32."""
    if not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in 1..2**32, got {vocab_size}")
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def write_tokens(path: str | os.PathLike, tokens: Sequence[int] | np.ndarray, dtype: Any) -> int:
    """Write ``tokens`` to ``path`` as one flat binary array of ``dtype`` (no header); return the bytes written."""
    array = np.asarray(tokens)
    info = np.iinfo(dtype)
    if array.size and (array.min() < info.min or array.max() > info.max):
        raise ValueError(f"token ids {array.min()}..{array.max()} do not fit {np.dtype(dtype).name}")
    array.astype(dtype).tofile(path)
    return array.size * np.dtype(dtype).itemsize


def open_tokens(path: str | os.PathLike, dtype: Any) -> np.memmap:
    """The token file at ``path`` as a read-only memory map: nothing is read until a slice of it is used."""
    return np.memmap(path, dtype=dtype, mode="r")


class TokenBatches:
    """Batches of ``(input, target)`` windows of a flat token array, for one rank of ``world_size``; resumable.

    Window ``j`` (``0 <= j < (len(tokens) - 1) // seq_len``) holds tokens ``j * seq_len`` to
    ``j * seq_len + seq_len`` inclusive: its input is the first ``seq_len`` of them and its target
    the last ``seq_len`` (each position's next token). Epoch ``e`` orders the windows by
    ``default_rng((seed, e)).permutation``, the same on every rank; rank ``r`` takes every
    ``world_size``-th window from position ``r`` of the first ``world_size * (n // world_size)``,
    so the ranks' shares are disjoint and equal, and cuts its share into ``len(self)`` full
    batches. Each iteration yields the rest of the current epoch as int64 tensors
    ``(batch_size, seq_len)``; the next iteration starts the next epoch. ``state_dict`` (plain
    ints) taken at any point and ``load_state_dict`` on a fresh object continue exactly there.
    ``tokens`` may be a ``numpy.memmap``: only the windows of each batch are read.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ValueError("seq_len and batch_size must be positive")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.windows = max(len(tokens) - 1, 0) // seq_len
        self.per_rank = self.windows // world_size
        self.epoch, self.step = 0, 0  # the epoch being read, and the batches of it handed out so far

    def __len__(self) -> int:
        return self.per_rank // self.batch_size

    def share(self, epoch: int) -> np.ndarray:
        """The indices of the windows this rank reads in ``epoch``, in order."""
        order = np.random.default_rng((self.seed, epoch)).permutation(self.windows)
        return order[self.rank:self.per_rank * self.world_size:self.world_size]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.step >= len(self):  # the last epoch was read to its end: this iteration is the next one
            self.epoch, self.step = self.epoch + 1, 0
        share = self.share(self.epoch)
        while self.step < len(self):
            picked = share[self.step * self.batch_size:(self.step + 1) * self.batch_size]
            windows = np.stack([self.tokens[j * self.seq_len:(j + 1) * self.seq_len + 1] for j in picked])
            rows = torch.from_numpy(windows.astype(np.int64))
            self.step += 1  # counted before it is handed out: a state taken now says this batch was seen
            yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        """Where the reading stands: enough to continue exactly here."""
        return {"seed": self.seed, "epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (from ``state_dict`` of a loader built with the same arguments)."""
        if int(state["seed"]) != self.seed:
            raise ValueError(f"the state is of seed {state['seed']}, this loader's is {self.seed}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
