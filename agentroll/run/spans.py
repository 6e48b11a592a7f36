"""Time spans of a run's metric trace: unions, per-phase busy/idle spans, staleness, steps.

Pure functions of a Trace (no I/O), shared by the report and its plots.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from agentroll.run.metrics import SpanRecord, StepRecord, Trace

if TYPE_CHECKING:
    pass


def _union(
    intervals: Iterable[tuple[float, float]], lo: float, hi: float
) -> list[tuple[float, float]]:
    """The time ``(start, end)`` intervals cover, clipped to ``[lo, hi]``, as sorted disjoint
    intervals (overlapping or touching ones joined)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        start, end = max(a, lo), min(b, hi)
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _union_seconds(spans: Iterable[SpanRecord], lo: float, hi: float) -> float:
    """Seconds covered by the spans (overlaps counted once), clipped to ``[lo, hi]``."""
    return sum(end - start for start, end in _union(((s.start, s.end) for s in spans), lo, hi))


class _PhaseSpans(msgspec.Struct, kw_only=True):
    """One component's busy and idle time in one phase, over its lifetime ``[start, end]``
    (first to last span, within the run): what the table and the timeline both show."""

    component: str
    phase: str
    start: float
    end: float
    busy: list[tuple[float, float]]
    idle: list[tuple[float, float]]


def _phase_spans(trace: Trace, lo: float, hi: float) -> list[_PhaseSpans]:
    """Per phase (rollout, then trainer) and component (sorted): its ``_PhaseSpans``."""
    out: list[_PhaseSpans] = []
    for phase in ("rollout", "trainer"):
        prefix = phase + "."
        by_component: dict[str, list[SpanRecord]] = {}
        for s in trace.spans:
            if s.name.startswith(prefix):
                by_component.setdefault(s.component, []).append(s)
        for comp in sorted(by_component):
            mine = by_component[comp]
            # a component's shares are of its own lifetime (first to last span): a worker
            # that starts after a warm-up is not "idle" during the warm-up
            c_lo = max(lo, min(s.start for s in mine))
            c_hi = min(hi, max(s.end for s in mine))
            busy, idle = (
                _union(((s.start, s.end) for s in mine if s.name == prefix + st), c_lo, c_hi)
                for st in ("busy", "idle")
            )
            out.append(
                _PhaseSpans(component=comp, phase=phase, start=c_lo, end=c_hi, busy=busy, idle=idle)
            )
    return out


def _staleness(steps: Iterable[StepRecord]) -> dict[int, int]:
    hist: dict[int, int] = {}
    for s in steps:
        for age, n in s.staleness.items():
            hist[age] = hist.get(age, 0) + n
    return dict(sorted(hist.items()))


def _steps(trace: Trace) -> list[StepRecord]:
    by_step: dict[int, StepRecord] = {}
    for s in trace.steps:  # sorted by (step, t): a step logged twice keeps its last record
        by_step[s.step] = s
    return [by_step[k] for k in sorted(by_step)]
