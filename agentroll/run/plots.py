"""The report's PNG plots (reward, timeline, staleness) of a run's metric trace.

Invariant: plots read the trace only; matplotlib is imported inside write_plots (Agg backend).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from agentroll.run.metrics import SpanRecord, Trace
from agentroll.run.spans import _phase_spans, _staleness, _steps, _union, capacity_moves

if TYPE_CHECKING:
    from matplotlib.path import Path as MplPath


_COLORS = {
    "rollout.busy": "tab:green",
    "rollout.idle": "lightgray",
    "trainer.busy": "tab:blue",
    "trainer.idle": "lightsteelblue",
    "sync": "tab:red",
    "pause": "tab:orange",
}


#: span names drawn as events (a lane of their own per component, with an outline so that a
#: sync shorter than a pixel still shows)
_EVENTS = ("sync", "pause")


class TimelineLane(msgspec.Struct, kw_only=True, frozen=True):
    """One row of ``timeline.png``: a component's phase (``rollout``, ``trainer``) or events
    (``sync``, ``pause``).  ``bars`` maps a span name to the ``(start, width)`` bars drawn in
    its colour, in seconds since the run's start, in drawing order (a later name covers an
    earlier one).  A phase lane spans the component's lifetime ``[start, end]``, as the
    table's shares do: ``<phase>.idle`` is the time measured either way (the background) and
    ``<phase>.busy`` the busy time over it, so the green share of the lane is the table's
    busy fraction."""

    component: str
    family: str
    start: float
    end: float
    bars: dict[str, list[tuple[float, float]]]


def _bars(intervals: Iterable[tuple[float, float]], origin: float) -> list[tuple[float, float]]:
    return [(start - origin, end - start) for start, end in intervals]


def timeline_lanes(trace: Trace) -> list[TimelineLane]:
    """The rows ``write_plots`` draws in ``timeline.png``, sorted by (component, family):
    the same busy and idle intervals ``build_report`` measures, plus sync and pause events.
    Empty when the trace has no spans to draw."""
    bounds = trace.bounds()
    if bounds is None:
        return []
    lo, hi = bounds
    lanes: list[TimelineLane] = []
    for p in _phase_spans(trace, lo, hi):
        measured = _union(p.busy + p.idle, p.start, p.end)  # busy or idle: the background
        if not measured:
            continue
        lanes.append(
            TimelineLane(
                component=p.component,
                family=p.phase,
                start=p.start - lo,
                end=p.end - lo,
                bars={f"{p.phase}.idle": _bars(measured, lo), f"{p.phase}.busy": _bars(p.busy, lo)},
            )
        )
    for name in _EVENTS:
        by_component: dict[str, list[SpanRecord]] = {}
        for s in trace.spans:
            if s.name == name:
                by_component.setdefault(s.component, []).append(s)
        for comp, mine in by_component.items():
            bars = _bars(_union(((s.start, s.end) for s in mine), lo, hi), lo)
            if bars:
                lanes.append(
                    TimelineLane(
                        component=comp, family=name, start=0.0, end=hi - lo, bars={name: bars}
                    )
                )
    return sorted(lanes, key=lambda lane: (lane.component, lane.family))


def write_plots(trace: Trace, run_dir: str | Path) -> list[Path]:
    """Write ``reward.png`` (reward_mean per step, rolling mean), ``timeline.png`` (one bar row
    per component and phase over wall time; each autoscale move a dashed line labelled with
    the rollout replicas and trainer threads after it, ``2r/1t``) and ``staleness.png`` (histogram summed over
    steps) into ``run_dir``; a plot without data is not written.  Returns the paths written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, PathPatch

    root = Path(run_dir)
    written: list[Path] = []

    def save(fig: Figure, name: str) -> None:
        FigureCanvasAgg(fig)
        fig.tight_layout()
        path = root / name
        tmp = root / f".{name}.tmp"
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
        written.append(path)

    steps = [s for s in _steps(trace) if math.isfinite(s.reward_mean)]
    if steps:
        fig = Figure(figsize=(8, 4))
        ax = fig.add_subplot()
        xs = [s.step for s in steps]
        ys = [s.reward_mean for s in steps]
        window = max(1, len(ys) // 10)
        rolling = []
        for i in range(len(ys)):
            recent = ys[max(0, i - window + 1) : i + 1]
            rolling.append(sum(recent) / len(recent))
        ax.plot(xs, ys, ".", alpha=0.5, label="reward_mean")
        ax.plot(xs, rolling, "-", label=f"rolling mean ({window} steps)")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.legend()
        save(fig, "reward.png")

    lanes = timeline_lanes(trace)
    if lanes:
        fig = Figure(figsize=(10, 1 + 0.5 * len(lanes)))
        ax = fig.add_subplot()
        ax.set_yticks(range(len(lanes)), [f"{lane.component} {lane.family}" for lane in lanes])
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        duration = max(lane.end for lane in lanes)
        ax.set_xlim(0.0, duration if duration > 0 else 1.0)
        ax.set_xlabel("seconds since run start")
        names = {name for lane in lanes for name, bars in lane.bars.items() if bars}
        ax.legend(
            handles=[Patch(color=c, label=n) for n, c in _COLORS.items() if n in names],
            loc="upper left",
            bbox_to_anchor=(1, 1),
            fontsize="small",
        )
        for i, lane in enumerate(lanes):
            for name, bars in lane.bars.items():
                if not bars:
                    continue
                if name in _EVENTS:
                    ax.broken_barh(bars, (i - 0.4, 0.8), color=_COLORS[name])
                    continue
                # A phase's bars are one path without an outline, not snapped to whole
                # pixels: a stroke widens each bar by about a pixel (at a pixel or two per
                # bar, the idle outlines painted busy lanes idle), snapping widens thin bars,
                # and separate shapes meeting inside a pixel leave a seam; so a pixel's
                # colour is the busy share of its time.
                ax.add_patch(
                    PathPatch(
                        _bars_path(bars, i - 0.4, 0.8),
                        facecolor=_COLORS[name],
                        linewidth=0.0,
                        snap=False,
                    )
                )
        # autoscale moves: a dashed line at each, labelled with the capacity it left
        lo = (trace.bounds() or (0.0, 0.0))[0]
        for move in capacity_moves(trace):
            x = move.t - lo
            ax.axvline(x, color="black" if not move.error else "tab:red", ls="--", lw=0.8)
            label = f"{move.replicas_after}r/{move.threads_after}t" if not move.error else "failed"
            ax.annotate(
                label,
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -10),
                textcoords="offset points",
                fontsize="x-small",
            )
        save(fig, "timeline.png")

    hist = _staleness(_steps(trace))
    if hist:
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        ages = sorted(hist)
        ax.bar(ages, [hist[a] for a in ages])
        ax.set_xticks(ages)
        ax.set_xlabel("staleness at hand-out (trainer version - min policy version)")
        ax.set_ylabel("trajectories")
        save(fig, "staleness.png")
    return written


def _bars_path(bars: list[tuple[float, float]], y: float, height: float) -> MplPath:
    """One matplotlib ``Path`` of the ``(start, width)`` rectangles from ``y`` to ``y + height``
    (closed subpaths: matplotlib does not simplify them away)."""
    import numpy as np
    from matplotlib.path import Path as MplPath

    x = np.asarray(bars, dtype=float).reshape(-1, 2)
    x0, x1 = x[:, 0], x[:, 0] + x[:, 1]
    y0, y1 = np.full_like(x0, y), np.full_like(x0, y + height)
    verts = np.stack([x0, y0, x1, y0, x1, y1, x0, y1, x0, y0], axis=1).reshape(-1, 2)
    codes = np.tile(
        [MplPath.MOVETO, MplPath.LINETO, MplPath.LINETO, MplPath.LINETO, MplPath.CLOSEPOLY],
        len(x),
    )
    return MplPath(verts, codes)
