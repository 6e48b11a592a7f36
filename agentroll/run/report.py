"""``agentroll report RUN_DIR``: the figures of a run's metric trace, plots and tuning advice.

``build_report`` reduces a ``Trace`` (agentroll.run.metrics) to a ``Report``; ``advice``
says what the numbers imply; ``write_plots`` draws PNGs; ``main_report`` prints and writes
everything.  Invariants: a figure nobody measured is ``None`` and printed ``unknown``, never
a made-up 0; the timeline draws the intervals the busy/idle shares come from.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from agentroll.errors import ConfigError
from agentroll.run.metrics import Trace, read_trace, trace_files
from agentroll.run.plots import write_plots
from agentroll.run.spans import (
    CapacityMove,
    _phase_spans,
    _staleness,
    _steps,
    _union_seconds,
    capacity_moves,
)

if TYPE_CHECKING:
    from rich.table import Table

#: an idle fraction at or above this is "high" (that side waits for the other)
IDLE_HIGH = 0.30
#: an idle fraction below this is "low" (that side is saturated)
IDLE_LOW = 0.10
#: mean staleness at or above this share of max_staleness is "near the bound"
STALENESS_NEAR_BOUND = 0.75
#: dropped_stale / (dropped_stale + trajectories trained) at or above this is "many drops"
DROPPED_HIGH = 0.05
#: sync seconds at or above this share of the run's wall time is "a large fraction"
SYNC_FRACTION_HIGH = 0.10
#: kv_lagged_tokens / tokens at or above this is "high"
KV_LAGGED_HIGH = 0.20

PLOT_NAMES = ("reward.png", "timeline.png", "staleness.png")


class ComponentTime(msgspec.Struct, kw_only=True):
    """Busy/idle seconds of one component's phase and their share of its lifetime (from its
    first span to its last, within the run)."""

    phase: str  # "rollout" or "trainer"
    busy_seconds: float
    idle_seconds: float
    busy_fraction: float | None
    idle_fraction: float | None


class Report(msgspec.Struct, kw_only=True):
    """The figures of one run; ``None`` means "not in the trace" (printed ``unknown``)."""

    run_dir: str
    steps: int
    duration: float
    reward_first_fifth: float | None
    reward_last_fifth: float | None
    reward_rising: bool
    syncs: int
    syncs_mid_generation: int
    sync_seconds: float
    sync_fraction: float | None
    pause_ms_p50: float | None
    pause_ms_p99: float | None
    episodes: int | None
    episodes_failed: int | None
    episodes_restarted: int
    lost: int | None
    dropped_stale: int | None
    kept_stale: int | None
    admission_wait_seconds: float | None
    trajectories: int
    staleness: dict[int, int]
    staleness_mean: float | None
    max_staleness: int | None
    rollout_busy_fraction: float | None
    rollout_idle_fraction: float | None
    trainer_busy_fraction: float | None
    trainer_idle_fraction: float | None
    components: dict[str, ComponentTime]
    tokens: int
    tokens_per_second: float | None
    kv_lagged_tokens: int
    kv_lagged_fraction: float | None
    skipped_lines: int
    placement: str = "separate"  # colocated: rollout and training take turns on one process
    autoscale: bool = False  # the run moved capacity by itself (placement.autoscale)
    moves: list[CapacityMove] = []  # what it moved, in time order

    def key_line(self) -> str:
        """The one line a note quotes (shape fixed; unmeasured figures print ``unknown``)."""
        return (
            f"report steps={self.steps} reward_first_fifth={_f(self.reward_first_fifth, 3)} "
            f"reward_last_fifth={_f(self.reward_last_fifth, 3)} syncs={self.syncs} "
            f"syncs_mid_generation={self.syncs_mid_generation} "
            f"episodes_restarted={self.episodes_restarted} lost={_f(self.lost)} "
            f"rollout_idle={_f(self.rollout_idle_fraction, 2)} "
            f"trainer_idle={_f(self.trainer_idle_fraction, 2)}"
        )

    def sections(self) -> list[tuple[str, list[tuple[str, str]]]]:
        """The figures by topic: ``[(topic, [(key, value), ...]), ...]`` (one per component)."""
        hist = ",".join(f"{k}:{v}" for k, v in sorted(self.staleness.items())) or "none"
        out: list[tuple[str, list[tuple[str, str]]]] = [
            (
                "reward",
                [
                    ("steps", str(self.steps)),
                    ("first_fifth", _f(self.reward_first_fifth, 3)),
                    ("last_fifth", _f(self.reward_last_fifth, 3)),
                    ("rising", str(self.reward_rising).lower()),
                ],
            ),
            (
                "time",
                [
                    ("duration", f"{self.duration:.1f}s"),
                    ("rollout_busy", _f(self.rollout_busy_fraction, 2)),
                    ("rollout_idle", _f(self.rollout_idle_fraction, 2)),
                    ("trainer_busy", _f(self.trainer_busy_fraction, 2)),
                    ("trainer_idle", _f(self.trainer_idle_fraction, 2)),
                    ("sync_seconds", f"{self.sync_seconds:.2f}"),
                    ("sync_fraction", _f(self.sync_fraction, 3)),
                ],
            ),
            (
                "sync",
                [
                    ("syncs", str(self.syncs)),
                    ("mid_generation", str(self.syncs_mid_generation)),
                    ("pause_ms_p50", _f(self.pause_ms_p50, 1)),
                    ("pause_ms_p99", _f(self.pause_ms_p99, 1)),
                    ("episodes_restarted", str(self.episodes_restarted)),
                ],
            ),
            (
                "episodes",
                [
                    ("episodes", _f(self.episodes)),
                    ("failed", _f(self.episodes_failed)),
                    ("lost", _f(self.lost)),
                    ("dropped_stale", _f(self.dropped_stale)),
                    ("kept_stale", _f(self.kept_stale)),
                    ("admission_wait_seconds", _f(self.admission_wait_seconds, 2)),
                ],
            ),
            (
                "staleness",
                [
                    ("trajectories", str(self.trajectories)),
                    ("mean", _f(self.staleness_mean, 2)),
                    ("max_staleness", _f(self.max_staleness)),
                    ("histogram", hist),
                ],
            ),
            (
                "throughput",
                [
                    ("tokens", str(self.tokens)),
                    ("tokens_per_second", _f(self.tokens_per_second, 1)),
                    ("kv_lagged_tokens", str(self.kv_lagged_tokens)),
                    ("kv_lagged_fraction", _f(self.kv_lagged_fraction, 3)),
                ],
            ),
        ]
        for name, c in sorted(self.components.items()):
            out.append(
                (
                    f"component {name}",
                    [
                        ("phase", c.phase),
                        ("busy", _f(c.busy_fraction, 2)),
                        ("idle", _f(c.idle_fraction, 2)),
                        ("busy_seconds", f"{c.busy_seconds:.1f}"),
                        ("idle_seconds", f"{c.idle_seconds:.1f}"),
                    ],
                )
            )
        if self.skipped_lines:
            out.append(("trace", [("skipped_lines", str(self.skipped_lines))]))
        return out

    def lines(self) -> list[str]:
        """``key=value`` lines: the key line first, then one line per topic and component
        (a component line reads ``component name=<component> phase=...``)."""
        out = [self.key_line()]
        for topic, pairs in self.sections():
            head, _, name = topic.partition(" ")
            prefix = f"{head} name={name} " if name else f"{head} "
            out.append(prefix + " ".join(f"{k}={v}" for k, v in pairs))
        return out


def _f(value: float | None, digits: int | None = None) -> str:
    if value is None:
        return "unknown"
    if digits is None:
        return str(int(value))
    return f"{value:.{digits}f}"


# -- figures --------------------------------------------------------------------------------


def reward_fifths(rewards: list[float]) -> tuple[float | None, float | None]:
    """Mean of the first and of the last fifth of ``rewards`` (``n // 5`` values, at least one
    each; with fewer than 5 values both fifths are one value).  ``(None, None)`` when empty."""
    if not rewards:
        return None, None
    k = max(1, len(rewards) // 5)
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (a value that occurred); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _as_int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def build_report(run_dir: str | Path, trace: Trace | None = None) -> Report:
    """Reduce a run directory's metric trace to a ``Report``.

    Args: ``run_dir``; ``trace`` (already read, else ``read_trace(run_dir)``).
    Raises ``ConfigError`` when the directory does not exist or holds no metric records.

    A figure nobody measured stays ``None`` (e.g. ``lost`` without a ``lost`` counter).
    ``write_plots`` draws reward, timeline and staleness PNGs with matplotlib's Agg canvas,
    imported lazily, no pyplot state; the timeline draws ``timeline_lanes``.
    """
    if trace is None:
        trace = _read_run_dir(run_dir)
    bounds = trace.bounds()
    if trace.is_empty or bounds is None:
        raise ConfigError(
            f"{run_dir} holds no metric records (*.jsonl files written by MetricsWriter); "
            "pass the run directory of a run that recorded metrics"
        )
    lo, hi = bounds
    duration = max(0.0, hi - lo)
    steps = _steps(trace)
    rewards = [s.reward_mean for s in steps if math.isfinite(s.reward_mean)]
    first, last = reward_fifths(rewards)

    staleness = _staleness(steps)
    trajectories = sum(staleness.values())
    tokens = sum(s.tokens for s in steps)
    kv_lagged = sum(s.kv_lagged_tokens for s in steps)

    components: dict[str, ComponentTime] = {}
    for p in _phase_spans(trace, lo, hi):
        life = max(0.0, p.end - p.start)
        busy, idle = (sum(end - start for start, end in iv) for iv in (p.busy, p.idle))
        key = p.component if p.component not in components else f"{p.component}/{p.phase}"
        components[key] = ComponentTime(
            phase=p.phase,
            busy_seconds=busy,
            idle_seconds=idle,
            busy_fraction=busy / life if life > 0 else None,
            idle_fraction=idle / life if life > 0 else None,
        )

    def phase_mean(phase: str, attr: str) -> float | None:
        vals = [getattr(c, attr) for c in components.values() if c.phase == phase]
        return _mean([v for v in vals if v is not None])

    if trace.syncs:
        sync_seconds = sum(s.seconds for s in trace.syncs)
    else:
        sync_seconds = _union_seconds((s for s in trace.spans if s.name == "sync"), lo, hi)
    pause_ms = [p for s in trace.syncs for p in s.pause_ms]
    restarted = trace.counter("episodes_restarted")
    max_staleness = trace.run_meta().get("max_staleness")
    return Report(
        run_dir=str(run_dir),
        steps=len(steps),
        duration=duration,
        reward_first_fifth=first,
        reward_last_fifth=last,
        reward_rising=len(rewards) >= 2 and last is not None and first is not None and last > first,
        syncs=len(trace.syncs),
        syncs_mid_generation=sum(1 for s in trace.syncs if s.mid_generation > 0),
        sync_seconds=sync_seconds,
        sync_fraction=sync_seconds / duration if duration > 0 else None,
        pause_ms_p50=percentile(pause_ms, 50),
        pause_ms_p99=percentile(pause_ms, 99),
        episodes=_as_int(trace.counter("episodes")),
        episodes_failed=_as_int(trace.counter("episodes_failed")),
        episodes_restarted=int(restarted)
        if restarted is not None
        else sum(s.episodes_restarted for s in trace.syncs),
        lost=_as_int(trace.counter("lost")),
        dropped_stale=_as_int(trace.counter("dropped_stale")),
        kept_stale=_as_int(trace.counter("kept_stale")),
        admission_wait_seconds=trace.counter("admission_wait_seconds"),
        trajectories=trajectories,
        staleness=staleness,
        staleness_mean=sum(a * n for a, n in staleness.items()) / trajectories
        if trajectories
        else None,
        max_staleness=max_staleness if isinstance(max_staleness, int) else None,
        placement=str(trace.run_meta().get("placement") or "separate"),
        autoscale=bool(trace.run_meta().get("autoscale", False)),
        moves=capacity_moves(trace),
        rollout_busy_fraction=phase_mean("rollout", "busy_fraction"),
        rollout_idle_fraction=phase_mean("rollout", "idle_fraction"),
        trainer_busy_fraction=phase_mean("trainer", "busy_fraction"),
        trainer_idle_fraction=phase_mean("trainer", "idle_fraction"),
        components=components,
        tokens=tokens,
        tokens_per_second=tokens / duration if duration > 0 else None,
        kv_lagged_tokens=kv_lagged,
        kv_lagged_fraction=kv_lagged / tokens if tokens else None,
        skipped_lines=trace.skipped_lines,
    )


def _read_run_dir(run_dir: str | Path) -> Trace:
    root = Path(run_dir)
    if not root.is_dir():
        raise ConfigError(f"run directory {root} does not exist; pass the RUN_DIR of a run")
    if not trace_files(root):
        raise ConfigError(
            f"{root} has no metric trace (no *.jsonl files); pass the run directory a run "
            "wrote its metrics to (worker.jsonl, trainer.jsonl, ...)"
        )
    return read_trace(root)


# -- advice ---------------------------------------------------------------------------------


def advice(report: Report) -> list[str]:
    """What the numbers imply, one sentence per finding, each quoting the numbers it rests on.

    Rules (thresholds are the module constants): rollout vs trainer idle balance; staleness
    near the bound with many drops; sync time share of the wall clock; KV-lagged token share;
    lost trajectories.  Always returns at least one line.
    """
    out: list[str] = []
    done = [m for m in report.moves if not m.error]
    if done:
        last = done[-1]
        out.append(
            f"autoscale moved capacity {len(done)} time(s): "
            + "; ".join(m.describe() for m in done)
            + f"; it ended with {last.replicas_after} rollout replica(s) and "
            f"{last.threads_after} trainer thread(s)"
        )
    elif report.autoscale:
        out.append(
            "autoscale made no move: the idle fractions stayed within placement.autoscale_band "
            "for the windows it measured, or the capacity was at its bounds"
        )
    failed = [m for m in report.moves if m.error]
    if failed:
        out.append(
            f"autoscale could not make {len(failed)} move(s), the capacity stayed as it was: "
            + "; ".join(m.describe() for m in failed)
        )
    ri, ti = report.rollout_idle_fraction, report.trainer_idle_fraction
    if ri is None or ti is None:
        missing = [n for n, v in (("rollout", ri), ("trainer", ti)) if v is None]
        out.append(
            f"no {'/'.join(missing)} busy/idle spans in the trace: cannot judge the balance "
            "of rollout and training; time both loops with metrics.PhaseClock"
        )
    else:
        nums = f"rollout idle {ri:.0%}, trainer idle {ti:.0%}"
        if report.placement == "colocated":
            out.append(
                f"{nums}: colocated, rollout and training take turns on the same cores, so "
                "each idles while the other works; what is neither is phase switches (see "
                "wake_ms in colocated.jsonl) and the tail of each rollout phase (turn on "
                "placement.partial_rollouts); separate pools run both at once"
            )
        elif report.autoscale and ri >= IDLE_HIGH and ti < IDLE_LOW:
            out.append(
                f"{nums}: the trainer is still the bottleneck with what autoscale could move; "
                "this machine has no more capacity to hand it (raise placement.cores or "
                "trainer devices, or raise max_staleness so rollouts can run further ahead)"
            )
        elif report.autoscale and ti >= IDLE_HIGH and ri < IDLE_LOW:
            out.append(
                f"{nums}: rollout is still the bottleneck with what autoscale could move; "
                "raise placement.max_replicas or rollout.concurrency, or add devices"
            )
        elif ri >= IDLE_HIGH and ti < IDLE_LOW:
            out.append(
                f"{nums}: the trainer is the bottleneck; move capacity to the trainer (more "
                "trainer devices, fewer rollout replicas) or raise max_staleness so rollouts "
                "can run further ahead"
            )
        elif ti >= IDLE_HIGH and ri < IDLE_LOW:
            out.append(
                f"{nums}: rollout is the bottleneck; add rollout capacity (more replicas or "
                "concurrency, devices moved from the trainer) or train on larger batches per step"
            )
        elif ri < IDLE_LOW and ti < IDLE_LOW:
            out.append(f"{nums}: rollout and training are balanced; no capacity to move")
        elif ri >= IDLE_HIGH and ti >= IDLE_HIGH:
            out.append(
                f"{nums}: both sides wait a lot; the time goes elsewhere (syncs, pauses, "
                "admission waits, sandbox start-up); look at the timeline"
            )
        else:
            side = "rollout" if ri > ti else "trainer"
            out.append(
                f"{nums}: no strong imbalance (high >= {IDLE_HIGH:.0%}, low < {IDLE_LOW:.0%}); "
                f"the {side} waits more, so capacity could shift slightly away from it"
            )

    bound = report.max_staleness
    if bound is None and report.staleness:
        bound = max(report.staleness)  # no recorded bound: the largest staleness seen
    dropped = report.dropped_stale or 0
    offered = dropped + report.trajectories
    steps_per_sync = report.steps / report.syncs if report.syncs else None
    if (
        report.staleness_mean is not None
        and bound
        and report.staleness_mean >= STALENESS_NEAR_BOUND * bound
        and offered
        and dropped / offered >= DROPPED_HIGH
    ):
        interval = f"{steps_per_sync:.1f} steps per sync" if steps_per_sync else "no sync recorded"
        out.append(
            f"staleness mean {report.staleness_mean:.2f} against a bound of {bound} with "
            f"{dropped} of {offered} trajectories dropped as stale ({dropped / offered:.0%}): "
            f"syncs are too rare relative to steps ({interval}) or max_staleness is too "
            "tight; sync more often or raise max_staleness"
        )
    if report.sync_fraction is not None and report.sync_fraction >= SYNC_FRACTION_HIGH:
        each = f", {report.sync_seconds / report.syncs:.2f}s each" if report.syncs else ""
        stale = (
            f"; syncing less often raises staleness (mean now {report.staleness_mean:.2f})"
            if report.staleness_mean is not None
            else ""
        )
        out.append(
            f"syncs took {report.sync_seconds:.1f}s, {report.sync_fraction:.0%} of the wall "
            f"time ({report.syncs} syncs{each}): sync less often, use the rolling or "
            f"background strategy, or send delta updates{stale}"
        )
    if report.kv_lagged_fraction is not None and report.kv_lagged_fraction >= KV_LAGGED_HIGH:
        out.append(
            f"{report.kv_lagged_fraction:.0%} of the tokens attended to KV from older weights "
            f"(kv_lagged_tokens={report.kv_lagged_tokens} of {report.tokens}): consider the "
            "recompute resume policy, or fewer generations in flight at a sync"
        )
    if report.lost:
        out.append(
            f"lost={report.lost}: finished trajectories never reached the trainer; check the "
            "spool directory and the trainer's acks"
        )
    sync_advised = any(t.startswith(("staleness mean", "syncs took")) for t in out)
    if not sync_advised and report.syncs and report.staleness_mean is not None:
        # no sync problem found: still state the trade-off the sync interval sets
        out.append(
            f"sync every {report.steps / report.syncs:.1f} steps, mean staleness "
            f"{report.staleness_mean:.2f}: syncing less often buys throughput at the price of "
            "more off-policy data; more often, the reverse"
        )
    return out


# -- output ---------------------------------------------------------------------------------


def render_table(report: Report) -> Table:
    """A two-column rich Table (figure, value) of the report."""
    from rich.table import Table

    table = Table(title=f"agentroll report {report.run_dir}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for topic, pairs in report.sections():
        for key, value in pairs:
            table.add_row(f"{topic} {key}", value)
    return table


def main_report(run_dir: str | Path) -> int:
    """``agentroll report RUN_DIR``: print the table, key line and advice; write the plots,
    ``report.json`` (figures and advice) and ``report.txt`` (lines and advice) into the run
    directory.  Returns 0.  Raises ``ConfigError`` when the directory holds no metric trace.
    """
    from rich.console import Console

    root = Path(run_dir)
    trace = _read_run_dir(root)
    report = build_report(root, trace)
    tips = advice(report)
    console = Console()
    console.print(render_table(report))
    for tip in tips:
        console.print(f"advice: {tip}", markup=False, highlight=False)
    plots = write_plots(trace, root)
    payload: dict[str, Any] = {"report": report, "advice": tips, "plots": [p.name for p in plots]}
    _write_atomic(root / "report.json", msgspec.json.format(msgspec.json.encode(payload)))
    text = "\n".join(report.lines() + [f"advice {tip}" for tip in tips]) + "\n"
    _write_atomic(root / "report.txt", text.encode())
    print(report.key_line(), flush=True)
    return 0


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
