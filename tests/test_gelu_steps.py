"""The bias + GELU steps benchmark's instrument, under Triton's interpreter (the timings need a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib import env
from course_lib.kernels import fusion

pytestmark = pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")


def _inputs(rows: int = 8, cols: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (3 * torch.randn(rows, cols, generator=gen)).to(torch.bfloat16), torch.randn(cols, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("tile", [None, (2, 16, 1)])
def test_each_mode_computes_what_it_keeps(tile):
    from benchmarks import gelu_steps as gs

    x, b = _inputs()
    z = x.float() + b.float()
    wants = {0: z, 1: z * torch.exp(-0.5 * z * z), 2: F.gelu(z), 3: F.gelu(z)}
    for math, want in wants.items():
        got = gs.math_forward(x, b, math, tile)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-5,
                                   msg=lambda m, math=math: f"mode {math} ({gs.MATH[math]}): {m}")


def test_bad_tiles_and_modes_are_refused():
    from benchmarks import gelu_steps as gs

    x, b = _inputs()
    with pytest.raises(ValueError, match="must divide"):
        gs.math_forward(x, b, 2, (3, 16, 1))
    with pytest.raises(ValueError, match="must divide"):
        gs.math_forward(x, b[:16], 2, (2, 16, 1))
    with pytest.raises(ValueError, match="math must be one of"):
        gs.math_forward(x, b, 4)


def test_steps_records_rates_and_errors(monkeypatch):
    from benchmarks import gelu_steps as gs

    timed = []

    def ms(fn):
        timed.append(fn)
        fn()
        return 0.5

    monkeypatch.setattr(gs, "TILES", [(2, 16, 1), (3, 16, 1)])  # the second divides nothing here: skipped
    record = gs.steps({"rows": 8, "cols": 32}, ms, device="cpu", compiled=False)
    rows = record["rows"]
    assert [r["group"] for r in rows] == ["reference"] + ["course"] * 2 + ["math"] * 4 + ["tile"] * 2
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]]
    assert len(timed) == len(rows)
    assert rows[0]["gbps"] == pytest.approx(2 * 8 * 32 * 2 / 0.5 / 1e6)
    assert record["course_tile"] == [*fusion._bias_gelu_blocks(8, 32), 4]

    # A kernel that computes the wrong thing is a row's error, and is not timed.
    monkeypatch.setattr(fusion, "bias_gelu", lambda x, b, fast_erf=False: x + b)
    timed.clear()
    record = gs.steps({"rows": 8, "cols": 32}, ms, device="cpu", compiled=False)
    failed = [r["label"] for r in record["rows"] if r["error"]]
    assert failed == ["bias_gelu, library erf", "bias_gelu(fast_erf=True)"]
    assert all("Mismatched" in r["error"] or "not close" in r["error"] for r in record["rows"] if r["error"])
    assert len(timed) == len(record["rows"]) - 2


def test_rounding_counts_ulps_and_misrounded_outputs():
    from benchmarks import gelu_steps as gs

    exact = torch.tensor([1.0, 1.0 + 2.0**-8, -3.0, 1e-8], dtype=torch.float64)
    rounded = exact.to(torch.bfloat16)
    assert gs.rounding(rounded, exact) == {"max_ulps": pytest.approx(0.5), "misrounded": 0.0}
    # 1 + 2**-8 is a tie (half an ulp at 1). One output a whole ulp off (2**-6 at 3): one in four misrounded.
    off = rounded.clone()
    off[2] = -3.0 - 2.0**-6
    got = gs.rounding(off, exact)
    assert got["max_ulps"] == pytest.approx(1.0) and got["misrounded"] == pytest.approx(0.25)
    # Below 1e-6 only the misrounded fraction counts: there fp32's 1 + erf has already lost every digit.
    tiny = rounded.clone()
    tiny[3] = 0.0
    assert gs.rounding(tiny, exact)["max_ulps"] == pytest.approx(0.5)


def test_exact_gelu_rows_record_their_rounding():
    from benchmarks import gelu_steps as gs

    record = gs.steps({"rows": 8, "cols": 32}, lambda fn: 0.5, device="cpu", compiled=False)
    with_rounding = {r["label"] for r in record["rows"] if "rounding" in r}
    assert with_rounding == {"bias_gelu, library erf", "bias_gelu(fast_erf=True)", gs.MATH[2], gs.MATH[3]}
    # The interpreter's fp32 -> bf16 store truncates (a GPU rounds to nearest): up to one ulp here,
    # half an ulp on a GPU (test_fusion's faithfully-rounded GPU test).
    assert all(r["rounding"]["max_ulps"] < 1.01 for r in record["rows"] if "rounding" in r)
