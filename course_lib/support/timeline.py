"""Spans of work on a shared clock, and their Gantt chart.

A ``Timeline`` collects ``Span(lane, kind, label, start, end)`` records in seconds of
``time.perf_counter``: the lane is the row of the chart (a rank, a worker, "accelerator"), the kind
its colour (``"compute"``, ``"F"``, ``"all-reduce"``), the label the text drawn on the bar (a
micro-batch, a bucket). Every process of one machine reads the same clock, so timelines recorded in
different ranks can be merged (``Timeline.merged``) and drawn on one axis (``plot_gantt``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["Span", "Timeline", "plot_gantt"]


class Span(NamedTuple):
    """One piece of work: on ``lane``, of ``kind``, labelled ``label``, from ``start`` to ``end`` seconds."""

    lane: str
    kind: str
    label: str
    start: float
    end: float


class Timeline:
    """Spans recorded in one process; ``add`` may be called from any thread (communication callbacks do)."""

    def __init__(self, spans: Iterable[Span] = ()) -> None:
        self.spans: list[Span] = [Span(*s) for s in spans]
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"spans": list(self.spans)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.spans, self._lock = [Span(*s) for s in state["spans"]], threading.Lock()

    @staticmethod
    def now() -> float:
        """The current time on the shared clock, in seconds."""
        return time.perf_counter()

    def add(self, lane: str, kind: str, label: Any, start: float, end: float) -> None:
        """Record one span; ValueError if it ends before it starts."""
        if end < start:
            raise ValueError(f"span {kind!r} on {lane!r} ends before it starts: {start} > {end}")
        with self._lock:
            self.spans.append(Span(str(lane), str(kind), str(label), float(start), float(end)))

    @contextlib.contextmanager
    def span(self, lane: str, kind: str, label: Any = "") -> Iterator[None]:
        """Record the time the ``with`` body takes as one span."""
        start = self.now()
        try:
            yield
        finally:
            self.add(lane, kind, label, start, self.now())

    @classmethod
    def merged(cls, timelines: Iterable[Timeline]) -> Timeline:
        """One timeline holding the spans of all of ``timelines`` (e.g. one per rank)."""
        return cls(s for t in timelines for s in t.spans)

    @property
    def start(self) -> float:
        """When the first span starts (0 when there is none)."""
        return min((s.start for s in self.spans), default=0.0)

    @property
    def end(self) -> float:
        """When the last span ends (0 when there is none)."""
        return max((s.end for s in self.spans), default=0.0)

    def lanes(self) -> list[str]:
        """The lanes, in the order their first span was added."""
        return list(dict.fromkeys(s.lane for s in self.spans))

    def of(self, lane: str | None = None, kind: str | None = None) -> list[Span]:
        """The spans on ``lane`` and of ``kind`` (either may be None: any)."""
        return [s for s in self.spans if (lane is None or s.lane == lane) and (kind is None or s.kind == kind)]

    def busy(self, lane: str | None = None, kind: str | None = None) -> float:
        """Seconds covered by the spans on ``lane`` of ``kind``, overlapping spans counted once."""
        total, reach = 0.0, float("-inf")
        for s in sorted(self.of(lane, kind), key=lambda s: s.start):
            if s.end > reach:
                total += s.end - max(s.start, reach)
                reach = s.end
        return total

    def idle_fraction(self, lane: str, kind: str | None = None) -> float:
        """Fraction of the whole timeline's length during which ``lane`` did no ``kind`` work."""
        length = self.end - self.start
        return 0.0 if length <= 0 else 1.0 - self.busy(lane, kind) / length


_PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


def plot_gantt(
    ax: Any,
    timeline: Timeline | Iterable[Span],
    title: str = "",
    *,
    lanes: Sequence[str] | None = None,
    colors: Mapping[str, str] | None = None,
    names: Mapping[str, str] | None = None,
    label_kinds: Iterable[str] | None = None,
    origin: float | None = None,
    unit: float = 1e3,
    idle_legend: bool = False,
) -> Any:
    """Draw ``timeline`` as a Gantt chart on matplotlib axes ``ax``: one row per lane, first lane at the top.

    ``colors`` maps a kind to its colour (kinds not in it take the next colour of a fixed palette;
    with ``colors`` given, only its kinds are drawn); ``names`` gives a kind its legend text;
    ``label_kinds`` the kinds whose label is written on the bar when the bar is wide enough (all by
    default). Time is in seconds since ``origin`` (the first span's start by default) times
    ``unit`` (1e3: milliseconds). ``idle_legend`` adds a white "idle" entry: the gaps.
    """
    tl = timeline if isinstance(timeline, Timeline) else Timeline(timeline)
    order = list(lanes) if lanes is not None else tl.lanes()
    t0 = tl.start if origin is None else origin
    width = max(tl.end - t0, 1e-12)
    palette = dict(colors or {})
    kinds = list(dict.fromkeys(s.kind for s in tl.spans if colors is None or s.kind in palette))
    for kind in kinds:
        palette.setdefault(kind, _PALETTE[len(palette) % len(_PALETTE)])
    labelled = None if label_kinds is None else set(label_kinds)
    for row, lane in enumerate(order):
        for s in tl.of(lane):
            if s.kind not in kinds:
                continue
            ax.barh(row, (s.end - s.start) * unit, left=(s.start - t0) * unit, height=0.8,
                    color=palette[s.kind], edgecolor="white", linewidth=0.5)
            if s.label and (labelled is None or s.kind in labelled) and (s.end - s.start) > 0.03 * width:
                ax.text((s.start + s.end - 2 * t0) / 2 * unit, row, s.label, ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(len(order)), order)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlabel("time (ms)" if unit == 1e3 else f"time (x{unit:g} s)")
    from matplotlib.patches import Patch  # matplotlib only where a chart is drawn

    handles = [Patch(color=palette[k], label=(names or {}).get(k, k)) for k in kinds]
    if idle_legend:
        handles.append(Patch(facecolor="white", edgecolor="gray", label="idle"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    if title:
        ax.set_title(title)
    return ax
