"""The committed GPU records: they load without a GPU, say which run they come from, and hold what the chapters render."""

from __future__ import annotations

import pytest

from course_lib.support.records import RESULTS, load_record, suite_rows


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


def test_suite_rows_show_every_rate_of_the_named_rows() -> None:
    record = load_record("h200.json")
    lines = suite_rows(record, ["bias_gelu", "add"])
    rows = {row["name"]: row for row in record.data["results"]}
    assert lines[0].startswith("bias_gelu, 8192 x 8192 bfloat16")
    assert sum(line.startswith(("bias_gelu", "add")) for line in lines) == 2
    assert len(lines) == 2 + sum(2 + len(rows[n]["context"]) for n in ("bias_gelu", "add"))
    ours = rows["bias_gelu"]["ours"]
    assert f"{ours:9,.1f} GB/s  {ours / record.data['copy_gbps']:4.0%} of copy" in lines[1]
    with pytest.raises(KeyError, match="no row nope"):
        suite_rows(record, ["add", "nope"])
