"""MetricsWriter / PhaseClock / read_trace: records round-trip, nothing written is lost, torn
lines are skipped, phase spans tile the clock's lifetime exactly."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import msgspec
import pytest

from agentroll.errors import ConfigError
from agentroll.run.metrics import MetricsWriter, PhaseClock, read_trace


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def test_records_round_trip(tmp_path: Path) -> None:
    clock = FakeClock()
    with MetricsWriter(tmp_path, "trainer", clock=clock) as w:
        w.span_at("trainer.busy", 1000.0, 1002.5, step=3)
        w.event(
            "step",
            step=1,
            version=2,
            reward_mean=0.25,
            reward_std=0.5,
            trajectories=8,
            tokens=800,
            loss=math.nan,
            staleness={"0": 6, "1": 2},
            kv_lagged_tokens=40,
        )
        w.event(
            "sync",
            version=2,
            strategy="rolling",
            seconds=0.5,
            pause_ms=[3.0, 4.5],
            mid_generation=5,
        )
        w.counter("lost", 0)
        w.event("run", event="start", max_staleness=2, seed=7)
    trace = read_trace(tmp_path)
    (span,) = trace.spans
    assert (span.name, span.component, span.start, span.end) == (
        "trainer.busy",
        "trainer",
        1000.0,
        1002.5,
    )
    assert span.extra == {"step": 3}
    (step,) = trace.steps
    assert step.staleness == {0: 6, 1: 2}
    assert step.reward_mean == 0.25 and step.tokens == 800 and step.t == 1000.0
    assert math.isnan(step.loss)  # NaN is written as null and read back as NaN
    (sync,) = trace.syncs
    assert sync.pause_ms == [3.0, 4.5] and sync.mid_generation == 5 and sync.strategy == "rolling"
    assert trace.counter("lost") == 0 and trace.counter("episodes") is None
    assert trace.run_meta() == {"max_staleness": 2, "seed": 7}
    assert trace.skipped_lines == 0


def test_span_context_uses_clock_and_survives_exceptions(tmp_path: Path) -> None:
    clock = FakeClock(10.0)
    w = MetricsWriter(tmp_path, "worker", clock=clock)
    with w.span("sync", version=4):
        clock.advance(1.5)
    with pytest.raises(KeyError), w.span("pause", component="replica-1"):
        clock.advance(0.25)
        raise KeyError("boom")
    w.close()
    spans = read_trace(tmp_path / "worker.jsonl").spans
    assert [(s.name, s.component, s.start, s.end) for s in spans] == [
        ("sync", "worker", 10.0, 11.5),
        ("pause", "replica-1", 11.5, 11.75),
    ]
    assert spans[0].extra == {"version": 4}


def test_span_validation(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "w") as w:
        with pytest.raises(ValueError, match="ends before"):
            w.span_at("sync", 2.0, 1.0)
        with pytest.raises(ValueError, match="reserved"):
            w.span_at("sync", 1.0, 2.0, kind="x")
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(ConfigError):
            MetricsWriter(tmp_path, bad)
    with pytest.raises(ConfigError, match="flush_every"):
        MetricsWriter(tmp_path, "w", flush_every=0)


def test_torn_last_line_is_skipped_and_a_new_writer_ends_it(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "worker", clock=FakeClock()) as w:
        for i in range(3):
            w.counter("episodes", i + 1)
    path = tmp_path / "worker.jsonl"
    path.write_bytes(path.read_bytes() + b'{"kind":"counter","t":1000.0,"name":"epi')  # crash
    trace = read_trace(tmp_path)
    assert trace.skipped_lines == 1 and trace.counter("episodes") == 3
    # a restarted writer appends after the torn fragment without gluing onto it
    with MetricsWriter(tmp_path, "worker", clock=FakeClock(2000.0)) as w:
        w.counter("episodes", 7)
    trace = read_trace(tmp_path)
    assert trace.skipped_lines == 1 and trace.counter("episodes") == 7
    assert len(trace.counters) == 4


def test_unknown_kinds_are_kept_and_invalid_records_skipped(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "x", clock=FakeClock()) as w:
        w.event("gpu", util=0.5)
        w.write({"kind": "step", "step": "not a number"})
        w.write({"no_kind": 1})
        w.event("step", step=0, reward_mean=1.0)
    trace = read_trace(tmp_path)
    assert trace.other == [{"kind": "gpu", "t": 1000.0, "util": 0.5}]
    assert [s.step for s in trace.steps] == [0]
    assert trace.skipped_lines == 2


def test_flush_every_batches_and_close_flushes(tmp_path: Path) -> None:
    w = MetricsWriter(tmp_path, "w", clock=FakeClock(), flush_every=3)
    w.counter("a", 1)
    w.counter("a", 2)
    assert (tmp_path / "w.jsonl").read_bytes() == b""
    w.counter("a", 3)
    assert len((tmp_path / "w.jsonl").read_bytes().splitlines()) == 3
    w.counter("a", 4)
    w.close()
    assert read_trace(tmp_path).counter("a") == 4
    with pytest.raises(RuntimeError, match="closed"):
        w.counter("a", 5)


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    w = MetricsWriter(tmp_path, "w", flush_every=7)
    per_thread = 500

    def work(k: int) -> None:
        for i in range(per_thread):
            w.span_at("rollout.busy", float(i), float(i + 1), thread=k, i=i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    trace = read_trace(tmp_path)
    assert trace.skipped_lines == 0
    seen = {(s.extra["thread"], s.extra["i"]) for s in trace.spans}
    assert seen == {(k, i) for k in range(4) for i in range(per_thread)}


def test_read_trace_merges_files_in_time_order(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "worker-0", clock=FakeClock(5.0)) as a:
        a.span_at("rollout.busy", 5.0, 6.0)
        a.counter("episodes", 10)
    with MetricsWriter(tmp_path, "worker-1", clock=FakeClock(1.0)) as b:
        b.span_at("rollout.busy", 1.0, 2.0)
        b.counter("episodes", 4)
        b.counter("episodes", 6)
    (tmp_path / "notes.txt").write_text("not a trace")
    trace = read_trace(tmp_path)
    assert [s.component for s in trace.spans] == ["worker-1", "worker-0"]
    assert trace.counter("episodes") == 16  # last value per writer, summed over writers
    assert trace.bounds() == (1.0, 6.0)
    assert len(trace.sources) == 2
    only = read_trace([tmp_path / "worker-0.jsonl"])
    assert only.counter("episodes") == 10
    with pytest.raises(ConfigError):
        read_trace(tmp_path / "missing")


def test_phase_clock_spans_tile_its_lifetime(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    w = MetricsWriter(tmp_path, "worker", clock=clock)
    pc = PhaseClock("rollout", writer=w, clock=clock)
    clock.advance(2)  # idle 100-102
    pc.busy()
    clock.advance(3)  # busy 102-105
    assert pc.seconds("busy") == 3 and pc.state == "busy"
    pc.idle()
    clock.advance(1)  # idle 105-106
    with pc.busy():
        clock.advance(4)  # busy 106-110
    clock.advance(0.5)  # idle 110-110.5
    pc.close()
    pc.close()
    w.close()
    spans = [(s.name, s.start, s.end) for s in read_trace(tmp_path).spans]
    assert spans == [
        ("rollout.idle", 100.0, 102.0),
        ("rollout.busy", 102.0, 105.0),
        ("rollout.idle", 105.0, 106.0),
        ("rollout.busy", 106.0, 110.0),
        ("rollout.idle", 110.0, 110.5),
    ]
    assert pc.totals == {"busy": 7.0, "idle": 3.5}
    assert pc.fraction("busy") == pytest.approx(7 / 10.5)
    with pytest.raises(RuntimeError, match="closed"):
        pc.busy()


def test_phase_clock_overlapping_holds_and_idle_voids_them() -> None:
    clock = FakeClock(0.0)
    pc = PhaseClock("trainer", clock=clock)
    a = pc.busy()
    clock.advance(1)
    b = pc.busy()
    clock.advance(1)
    a.release()
    assert pc.state == "busy"  # b still holds
    clock.advance(1)
    b.release()
    b.release()  # idempotent
    assert pc.state == "idle" and pc.seconds("busy") == 3
    c = pc.busy()
    clock.advance(2)
    pc.idle()
    d = pc.busy()
    clock.advance(1)
    c.release()  # voided by idle(): must not end d's busy time
    assert pc.state == "busy"
    d.release()
    assert pc.state == "idle" and pc.seconds("busy") == 6 and pc.seconds("idle") == 0
    with pytest.raises(ConfigError):
        PhaseClock("rollout.busy")


def test_writer_encodes_numpy_scalars(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    with MetricsWriter(tmp_path, "w", clock=FakeClock()) as w:
        w.event("step", step=np.int64(3), reward_mean=np.float32(0.5), tokens=np.int32(9))
    (step,) = read_trace(tmp_path).steps
    assert (step.step, step.reward_mean, step.tokens) == (3, 0.5, 9)
    line = (tmp_path / "w.jsonl").read_bytes()
    assert msgspec.json.decode(line)["kind"] == "step"
