"""Metric traces of a run: timed phases, training steps, syncs and counters as JSONL.

Each component owns one ``MetricsWriter`` appending one JSON record per line to
``RUN_DIR/<component>.jsonl``; ``read_trace`` merges a run's files into a ``Trace``.
Invariants: a record is one ``write`` of one complete line, so a crash leaves at most one
torn line, which the reader skips; times are wall-clock seconds unless a clock is injected.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from agentroll.errors import ConfigError

Clock = Callable[[], float]
PhaseState = Literal["busy", "idle"]

#: span names other components write (``rollout.busy`` ... ``pause``)
SPAN_NAMES = ("rollout.busy", "rollout.idle", "trainer.busy", "trainer.idle", "sync", "pause")
#: record kinds ``read_trace`` understands; others are kept in ``Trace.other`` and ignored
KINDS = ("span", "step", "sync", "counter", "run")
_SPAN_KEYS = frozenset({"kind", "name", "component", "start", "end"})

# -- records --------------------------------------------------------------------------------


class SpanRecord(msgspec.Struct, kw_only=True):
    """An interval of one phase of one component; ``extra`` holds any other fields."""

    name: str
    component: str
    start: float
    end: float
    extra: dict[str, Any] = {}

    @property
    def seconds(self) -> float:
        return self.end - self.start


class StepRecord(msgspec.Struct, kw_only=True):
    """One trainer step; ``staleness`` maps trainer_version - min policy_version to counts."""

    step: int
    t: float = 0.0
    version: int = 0
    reward_mean: float = math.nan
    reward_std: float = math.nan
    trajectories: int = 0
    tokens: int = 0
    loss: float = math.nan
    clip_fraction: float = math.nan
    kl: float = math.nan
    staleness: dict[int, int] = {}
    kv_lagged_tokens: int = 0
    seconds: float = 0.0


class SyncRecord(msgspec.Struct, kw_only=True):
    """One weight sync; ``mid_generation`` counts generations in flight when it paused them."""

    t: float
    version: int = 0
    strategy: str = ""
    seconds: float = 0.0
    pause_ms: list[float] = []
    mid_generation: int = 0
    episodes_restarted: int = 0
    tokens_discarded: int = 0
    migrated: int = 0
    bytes: int = 0


class CounterRecord(msgspec.Struct, kw_only=True):
    """A cumulative counter of one writer (last value wins); ``source`` is the file it came from."""

    t: float
    name: str
    value: float
    source: str = ""


class RunRecord(msgspec.Struct, kw_only=True):
    """Run metadata (``event`` is ``start`` or ``end``); ``meta`` holds the other fields."""

    t: float
    event: str
    meta: dict[str, Any] = {}


# -- writing --------------------------------------------------------------------------------


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    raise NotImplementedError(f"cannot write {type(obj).__name__} to a metric trace")


class MetricsWriter:
    """Appends metric records to ``RUN_DIR/<component>.jsonl``; one per process/component.

    Args: ``run_dir`` (created if missing); ``component`` (file name and the default component
    of spans, e.g. ``worker-0``, ``trainer``); ``clock`` (wall-clock seconds, injectable);
    ``flush_every`` (records buffered before a flush; 1 = every record reaches the OS at once).
    Thread-safe; a context manager that closes the file.  Raises ``ConfigError`` on a bad
    component name or ``flush_every``.

    A writer reopening a file that ends in a torn line first ends that line.  Times are
    ``time.time`` seconds unless a clock is injected.  ``PhaseClock`` turns busy/idle
    transitions into spans; ``agentroll.run.report`` reads the merged ``Trace``.
    """

    def __init__(
        self,
        run_dir: str | Path,
        component: str,
        *,
        clock: Clock = time.time,
        flush_every: int = 1,
    ) -> None:
        if not component or "/" in component or "\\" in component or component.startswith("."):
            raise ConfigError(
                f"component {component!r} must be a plain file name such as 'worker-0'"
            )
        if flush_every < 1:
            raise ConfigError(f"flush_every must be >= 1 (got {flush_every})")
        self.component = component
        self.clock = clock
        self.flush_every = flush_every
        self.path = Path(run_dir) / f"{component}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
        self._lock = threading.Lock()
        self._pending = 0
        self._file = open(self.path, "ab")  # noqa: SIM115 - owned until close()
        if self._file.tell() > 0 and not _ends_with_newline(self.path):
            self._file.write(b"\n")  # end the line a crashed writer left torn

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a JSON object with a ``kind``) as one line."""
        line = self._encoder.encode(record) + b"\n"
        with self._lock:
            if self._file.closed:
                raise RuntimeError(f"MetricsWriter for {self.path} is closed")
            self._file.write(line)
            self._pending += 1
            if self._pending >= self.flush_every:
                self._file.flush()
                self._pending = 0

    def event(self, kind: str, **fields: Any) -> None:
        """Append ``{"kind": kind, "t": now, **fields}`` (a ``t`` in ``fields`` wins)."""
        self.write({"kind": kind, "t": self.clock(), **fields})

    def counter(self, name: str, value: float) -> None:
        """Append the current value of a cumulative counter (e.g. ``lost``, ``episodes``)."""
        self.event("counter", name=name, value=value)

    def span_at(
        self, name: str, start: float, end: float, *, component: str | None = None, **extra: Any
    ) -> None:
        """Append a span ``[start, end]`` (wall-clock seconds) of phase ``name``.

        Raises ``ValueError`` when ``end < start`` or ``extra`` reuses a span key.
        """
        if end < start:
            raise ValueError(f"span {name!r} ends before it starts ({end} < {start})")
        clash = _SPAN_KEYS.intersection(extra)
        if clash:
            raise ValueError(f"span fields {sorted(clash)} are reserved; rename them")
        self.write(
            {
                "kind": "span",
                "name": name,
                "component": component or self.component,
                "start": start,
                "end": end,
                **extra,
            }
        )

    @contextlib.contextmanager
    def span(self, name: str, *, component: str | None = None, **extra: Any) -> Iterator[None]:
        """Time the block as a span of phase ``name``; the span is written even when the block
        raises or is cancelled (the time was spent), and the exception propagates."""
        start = self.clock()
        try:
            yield
        finally:
            self.span_at(name, start, max(start, self.clock()), component=component, **extra)

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                self._pending = 0

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


class _Hold:
    """One holder of the busy state; leaving it (or ``with``) releases the hold."""

    def __init__(self, clock: PhaseClock, epoch: int) -> None:
        self._clock = clock
        self._epoch = epoch
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._clock._release(self._epoch)

    def __enter__(self) -> _Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PhaseClock:
    """Busy/idle state machine of one component's loop (pure: no I/O but the optional writer).

    ``busy()`` takes a hold and enters ``busy``; the component stays busy while any hold is
    open (so concurrent ``with clock.busy():`` blocks nest), and goes ``idle`` when the last
    one is released.  ``idle()`` goes idle at once and voids every open hold.  Each finished
    state is written as a span ``<phase>.<state>`` (e.g. ``rollout.busy``) when a writer is
    given; ``seconds``/``fraction`` include the open state up to now.  ``close()`` ends the
    clock; a transition after it raises ``RuntimeError``.
    """

    def __init__(
        self,
        phase: str,
        *,
        component: str | None = None,
        writer: MetricsWriter | None = None,
        clock: Clock = time.time,
        state: PhaseState = "idle",
    ) -> None:
        if not phase or "." in phase:
            raise ConfigError(f"phase {phase!r} must be a name without dots, e.g. 'rollout'")
        self.phase = phase
        self.component = component or (writer.component if writer else phase)
        self.writer = writer
        self.clock = clock
        self.state: PhaseState | None = state
        self.started = self._since = clock()
        self.totals: dict[str, float] = {"busy": 0.0, "idle": 0.0}
        self._holds = 0
        self._epoch = 0

    def busy(self) -> _Hold:
        """Enter (or stay) busy; returns a hold to release or use as a context manager."""
        self._check_open()
        self._holds += 1
        self._enter("busy")
        return _Hold(self, self._epoch)

    def idle(self) -> None:
        """Go idle now, whatever holds are open (they become no-ops)."""
        self._check_open()
        self._holds = 0
        self._epoch += 1
        self._enter("idle")

    def close(self) -> None:
        """End the current state (its span is written); idempotent."""
        if self.state is not None:
            self._end_state(self.clock())
            self.state = None

    def seconds(self, state: PhaseState) -> float:
        """Seconds spent in ``state`` so far, including the open one."""
        total = self.totals[state]
        if self.state == state:
            total += max(0.0, self.clock() - self._since)
        return total

    def fraction(self, state: PhaseState) -> float:
        """Share of the time since construction spent in ``state`` (0 before any time passed)."""
        busy, idle = self.seconds("busy"), self.seconds("idle")
        return (busy if state == "busy" else idle) / (busy + idle) if busy + idle > 0 else 0.0

    def _release(self, epoch: int) -> None:
        if epoch != self._epoch or self.state is None:
            return  # voided by idle() or close()
        self._holds -= 1
        if self._holds == 0:
            self._enter("idle")

    def _check_open(self) -> None:
        if self.state is None:
            raise RuntimeError(f"PhaseClock {self.phase!r} of {self.component!r} is closed")

    def _enter(self, state: PhaseState) -> None:
        if state == self.state:
            return
        now = self.clock()
        self._end_state(now)
        self.state = state
        self._since = now

    def _end_state(self, now: float) -> None:
        assert self.state is not None
        end = max(now, self._since)
        self.totals[self.state] += end - self._since
        if self.writer is not None and end > self._since:
            self.writer.span_at(
                f"{self.phase}.{self.state}", self._since, end, component=self.component
            )


# -- reading --------------------------------------------------------------------------------


@dataclass
class Trace:
    """Every record of one run, merged from its JSONL files and sorted by time."""

    spans: list[SpanRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    syncs: list[SyncRecord] = field(default_factory=list)
    counters: list[CounterRecord] = field(default_factory=list)
    runs: list[RunRecord] = field(default_factory=list)
    other: list[dict[str, Any]] = field(default_factory=list)  # unknown kinds, ignored
    sources: list[str] = field(default_factory=list)
    skipped_lines: int = 0  # torn or malformed lines

    @property
    def is_empty(self) -> bool:
        return not (self.spans or self.steps or self.syncs or self.counters or self.runs)

    def counter(self, name: str) -> float | None:
        """A counter's value: the last value of each writer, summed over writers; ``None``
        when no writer recorded it."""
        last: dict[str, float] = {}
        for c in self.counters:  # sorted by time, so the last one of a source wins
            if c.name == name:
                last[c.source] = c.value
        return sum(last.values()) if last else None

    def bounds(self) -> tuple[float, float] | None:
        """The run's wall-clock window: run start/end events, else the extreme timestamps."""
        times = [s.start for s in self.spans] + [s.end for s in self.spans]
        times += [r.t for r in self.steps if r.t] + [r.t for r in self.syncs]
        times += [c.t for c in self.counters] + [r.t for r in self.runs]
        if not times:
            return None
        starts = [r.t for r in self.runs if r.event == "start"]
        ends = [r.t for r in self.runs if r.event == "end"]
        return (min(starts) if starts else min(times), max(ends) if ends else max(times))

    def run_meta(self) -> dict[str, Any]:
        """Metadata of the run events merged in time order (later keys win)."""
        meta: dict[str, Any] = {}
        for r in self.runs:
            meta.update(r.meta)
        return meta


def trace_files(run_dir: str | Path) -> list[Path]:
    """The metric files of a run directory (``*.jsonl``), sorted by name."""
    return sorted(p for p in Path(run_dir).glob("*.jsonl") if p.is_file())


def read_trace(paths: str | Path | Iterable[str | Path]) -> Trace:
    """Read and merge metric files: a run directory (all its ``*.jsonl``) or a list of files.

    Lines that are torn (a crash mid-write) or do not validate as their kind are skipped and
    counted in ``skipped_lines``; unknown kinds go to ``Trace.other``.  Raises ``ConfigError``
    when a named file or directory does not exist.
    """
    if isinstance(paths, (str, Path)):
        root = Path(paths)
        if not root.exists():
            raise ConfigError(f"{root} does not exist; pass a run directory or a .jsonl file")
        files = trace_files(root) if root.is_dir() else [root]
    else:
        files = [Path(p) for p in paths]
    trace = Trace()
    for path in files:
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise ConfigError(f"metric file {path} does not exist") from exc
        trace.sources.append(str(path))
        for line in data.splitlines():
            if line.strip():
                _add_line(trace, line, str(path))
    trace.spans.sort(key=lambda s: (s.start, s.end))
    trace.steps.sort(key=lambda s: (s.step, s.t))
    trace.syncs.sort(key=lambda s: s.t)
    trace.counters.sort(key=lambda c: c.t)
    trace.runs.sort(key=lambda r: r.t)
    return trace


def _add_line(trace: Trace, line: bytes, source: str) -> None:
    try:
        raw = msgspec.json.decode(line)
    except msgspec.DecodeError:
        trace.skipped_lines += 1  # torn by a crash
        return
    if not isinstance(raw, dict) or not isinstance(raw.get("kind"), str):
        trace.skipped_lines += 1
        return
    kind = raw.pop("kind")
    # NaN is written as null in JSON: drop nulls so the field's default (NaN) applies
    raw = {k: v for k, v in raw.items() if v is not None}
    try:
        if kind == "span":
            extra = {k: v for k, v in raw.items() if k not in _SPAN_KEYS}
            trace.spans.append(msgspec.convert({**raw, "extra": extra}, SpanRecord))
        elif kind == "step":
            trace.steps.append(msgspec.convert(raw, StepRecord, strict=False))
        elif kind == "sync":
            trace.syncs.append(msgspec.convert(raw, SyncRecord))
        elif kind == "counter":
            trace.counters.append(msgspec.convert({**raw, "source": source}, CounterRecord))
        elif kind == "run":
            meta = {k: v for k, v in raw.items() if k not in ("t", "event")}
            trace.runs.append(msgspec.convert({**raw, "meta": meta}, RunRecord))
        else:
            trace.other.append({"kind": kind, **raw})
    except msgspec.ValidationError:
        trace.skipped_lines += 1
