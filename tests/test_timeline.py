"""course_lib.support.timeline: spans on a shared clock, merged across ranks, drawn as a Gantt chart."""

from __future__ import annotations

import pickle
import threading

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.support.timeline import Span, Timeline, plot_gantt  # noqa: E402


def test_spans_are_named_tuples_and_add_checks_order() -> None:
    tl = Timeline()
    tl.add("rank 0", "F", 3, 1.0, 2.5)
    (span,) = tl.spans
    lane, kind, label, start, end = span
    assert (lane, kind, label, start, end) == ("rank 0", "F", "3", 1.0, 2.5) and span.end == 2.5
    with pytest.raises(ValueError, match="ends before it starts"):
        tl.add("rank 0", "F", 0, 2.0, 1.0)


def test_span_context_records_the_body() -> None:
    tl = Timeline()
    with tl.span("host", "work", "a"):
        pass
    [s] = tl.of("host", "work")
    assert s.label == "a" and s.end >= s.start


def test_busy_counts_overlaps_once_and_idle_fraction() -> None:
    tl = Timeline([Span("a", "x", "", 0.0, 2.0), Span("a", "x", "", 1.0, 3.0), Span("a", "y", "", 5.0, 6.0),
                   Span("b", "x", "", 0.0, 10.0)])
    assert tl.busy("a", "x") == 3.0 and tl.busy("a") == 4.0
    assert tl.idle_fraction("a") == pytest.approx(0.6) and tl.idle_fraction("b") == 0.0
    assert tl.lanes() == ["a", "b"] and (tl.start, tl.end) == (0.0, 10.0)
    assert Timeline().idle_fraction("a") == 0.0


def test_merged_and_pickled_timelines_keep_their_spans() -> None:
    a, b = Timeline([Span("rank 0", "F", "0", 0.0, 1.0)]), Timeline([Span("rank 1", "B", "0", 1.0, 2.0)])
    both = pickle.loads(pickle.dumps(Timeline.merged([a, b])))
    assert both.lanes() == ["rank 0", "rank 1"] and both.end == 2.0


def test_add_from_many_threads_loses_nothing() -> None:
    tl = Timeline()

    def worker(i: int) -> None:
        for k in range(500):
            tl.add(f"t{i}", "x", k, 0.0, 1.0)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tl.spans) == 2000


def test_plot_gantt_draws_one_bar_per_span_in_the_given_lanes() -> None:
    tl = Timeline([Span("stage 0", "F", "0", 0.0, 1.0), Span("stage 1", "F", "0", 1.0, 2.0),
                   Span("stage 1", "B", "0", 2.0, 4.0), Span("stage 1", "wait", "", 4.0, 5.0)])
    fig, ax = plt.subplots()
    plot_gantt(ax, tl, "t", colors={"F": "blue", "B": "orange"}, names={"F": "forward"}, idle_legend=True)
    assert len(ax.patches) == 3  # "wait" has no colour given: not drawn
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "B", "idle"]
    assert ax.get_title() == "t" and ax.get_xlabel() == "time (ms)"
    plt.close(fig)
