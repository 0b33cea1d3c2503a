"""Unit tests of course_lib.token_data (token files, windows, shards, resumable position) and its grading checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib import token_data as td
from course_lib.exercises import data_pipelines as dpx


def test_token_dtype_and_file_round_trip(tmp_path: Path) -> None:
    assert td.token_dtype(50_257) is np.uint16 and td.token_dtype(2**16) is np.uint16
    assert td.token_dtype(128_256) is np.uint32
    with pytest.raises(ValueError):
        td.token_dtype(0)
    ids = np.array([0, 65_535, 7, 3])
    path = tmp_path / "t.bin"
    assert td.write_tokens(path, ids, np.uint16) == 8 and path.stat().st_size == 8
    tokens = td.open_tokens(path, np.uint16)
    assert isinstance(tokens, np.memmap) and tokens.tolist() == ids.tolist()
    with pytest.raises(ValueError):
        td.write_tokens(path, [70_000], np.uint16)


def test_windows_are_shifted_pairs_cut_at_multiples_of_seq_len() -> None:
    tokens = np.arange(41, dtype=np.uint16)  # 40 // 8 = 5 windows
    loader = td.TokenBatches(tokens, seq_len=8, batch_size=5)
    assert len(loader) == 1
    x, y = next(iter(loader))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (5, 8)
    assert sorted(x[:, 0].tolist()) == [0, 8, 16, 24, 32]
    assert torch.equal(y, x + 1)
    assert td.TokenBatches(np.arange(40, dtype=np.uint16), 8, 1).windows == 4  # the 5th window would run past the end


def test_ranks_share_one_permutation_disjointly_and_equally() -> None:
    tokens = np.arange(1 + 10 * 101, dtype=np.uint32)  # 101 windows: 33 per rank for 3 ranks, 2 left over
    seen = []
    for rank in range(3):
        loader = td.TokenBatches(tokens, 10, 4, rank=rank, world_size=3, seed=5)
        assert len(loader) == 8
        windows = [w for x, _ in loader for w in (x[:, 0] // 10).tolist()]
        assert len(windows) == 32
        seen += windows
    assert len(set(seen)) == len(seen) == 96
    with pytest.raises(ValueError):
        td.TokenBatches(tokens, 10, 4, rank=3, world_size=3)


def test_epochs_advance_per_iteration_and_orders_follow_seed_and_epoch() -> None:
    tokens = np.arange(1 + 4 * 64, dtype=np.uint16)
    a, b = td.TokenBatches(tokens, 4, 8, seed=1), td.TokenBatches(tokens, 4, 8, seed=1)
    first = [x[:, 0].tolist() for x, _ in a]
    assert first == [x[:, 0].tolist() for x, _ in b]
    second = [x[:, 0].tolist() for x, _ in a]
    assert second != first and a.epoch == 1
    assert sorted(sum(first, [])) == sorted(sum(second, []))
    assert [x[:, 0].tolist() for x, _ in td.TokenBatches(tokens, 4, 8, seed=2)] != first


@pytest.mark.parametrize("after", [0, 3, 8, 11])
def test_a_saved_state_continues_exactly(after: int) -> None:
    tokens = np.arange(1 + 4 * 64, dtype=np.uint16)  # 64 windows, 8 batches of 8 per epoch

    def take(loader: td.TokenBatches, count: int) -> list[list[int]]:
        out: list[list[int]] = []
        while len(out) < count:
            for x, _ in loader:
                out.append(x[:, 0].tolist())
                if len(out) == count:
                    break
        return out

    want = take(td.TokenBatches(tokens, 4, 8, seed=3), after + 10)
    run = td.TokenBatches(tokens, 4, 8, seed=3)
    take(run, after)
    fresh = td.TokenBatches(tokens, 4, 8, seed=3)
    fresh.load_state_dict(json.loads(json.dumps(run.state_dict())))
    assert take(fresh, 10) == want[after:]
    with pytest.raises(ValueError):
        td.TokenBatches(tokens, 4, 8, seed=4).load_state_dict(run.state_dict())


def test_grading_checks_accept_the_reference_and_catch_overlap() -> None:
    tokens = dpx.unique_tokens(1201, seed=0)
    dpx.check_epochs(td.TokenBatches, tokens, 16, 4, 3, 0)
    dpx.check_resume(td.TokenBatches, tokens, 16, 4, 3, 1, 0, after=3)

    class PerRankSeed(td.TokenBatches):
        def share(self, epoch: int) -> np.ndarray:
            order = np.random.default_rng((self.seed + self.rank, epoch)).permutation(self.windows)
            return order[self.rank:self.per_rank * self.world_size:self.world_size]

    with pytest.raises(AssertionError, match="read by rank"):
        dpx.check_epochs(PerRankSeed, tokens, 16, 4, 3, 0)


def test_memmap_growth_tells_windows_from_a_full_copy() -> None:
    growth = dpx.memmap_growth(td.TokenBatches, megabytes=64)
    if growth is None:
        pytest.skip("no /proc/self/statm here")

    class CopiesAll(td.TokenBatches):
        def __init__(self, tokens: np.ndarray, *args: int, **kwargs: int) -> None:
            super().__init__(np.array(tokens, dtype=np.int64), *args, **kwargs)

    assert growth < 0.5 < dpx.memmap_growth(CopiesAll, megabytes=64)
