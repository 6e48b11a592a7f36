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


class CapacityMove(msgspec.Struct, kw_only=True, frozen=True):
    """One ``autoscale`` record: when (wall-clock ``t``), at which step, the capacity
    before and after, the idle fractions that asked for it, and an error if it failed."""

    t: float
    step: int
    direction: str
    replicas_before: int
    replicas_after: int
    threads_before: int
    threads_after: int
    rollout_idle: float
    trainer_idle: float
    error: str = ""

    def describe(self) -> str:
        """``step 6: rollout replicas 2 -> 1, trainer threads 1 -> 2 (rollout idle 45%,
        trainer idle 5%)``."""
        what = []
        if self.replicas_after != self.replicas_before:
            what.append(f"rollout replicas {self.replicas_before} -> {self.replicas_after}")
        if self.threads_after != self.threads_before:
            what.append(f"trainer threads {self.threads_before} -> {self.threads_after}")
        idle = f"rollout idle {self.rollout_idle:.0%}, trainer idle {self.trainer_idle:.0%}"
        failed = f", failed: {self.error}" if self.error else ""
        return f"step {self.step}: {', '.join(what) or 'no change'} ({idle}{failed})"


def capacity_moves(trace: Trace) -> list[CapacityMove]:
    """The trace's ``autoscale`` records in time order (malformed ones are skipped)."""
    out = []
    for raw in trace.other:
        if raw.get("kind") != "autoscale":
            continue
        fields = {k: v for k, v in raw.items() if k in CapacityMove.__struct_fields__}
        try:
            out.append(msgspec.convert(fields, CapacityMove))
        except msgspec.ValidationError:
            continue
    return sorted(out, key=lambda m: m.t)
