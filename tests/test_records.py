"""The committed GPU records: they load without a GPU, say which run they come from, and hold what the chapters render."""

from __future__ import annotations

import pytest

from course_lib.support.records import RESULTS, load_record


def test_a_record_says_which_run_it_is() -> None:
    record = load_record("figures_h200.json")
    line = record.provenance
    assert "H200" in line and record.data["date"][:10] in line and "torch" in line and "figures_h200.json" in line
    assert record.data["l2_bytes"] == 62914560, "the H200's L2 as the device reported it"


def test_the_figures_record_holds_what_chapters_00_and_03_render() -> None:
    record = load_record("figures_h200.json")
    sweep = record.section("copy_sweep")
    n = len(sweep["sizes_bytes"])
    assert all(len(sweep[k]) == n for k in ("flushed_bytes_per_s", "warm_bytes_per_s", "graph_bytes_per_s"))
    timers = record.section("timers")["rows"]
    assert {"naive event pair", "profiling.benchmark", "triton do_bench"} <= set(timers[0])
    for row in timers:  # the course's timer agrees with do_bench (the gpu tier checks it live)
        assert abs(row["profiling.benchmark"] / row["triton do_bench"] - 1) < 0.15, row


def test_missing_records_and_sections_are_named() -> None:
    with pytest.raises(FileNotFoundError, match="no GPU record nothing.json"):
        load_record("nothing.json")
    with pytest.raises(KeyError, match="has no section 'nope'.*copy_sweep"):
        load_record("figures_h200.json").section("nope")
    assert RESULTS.is_dir()
