"""report: figures from synthetic traces (written with MetricsWriter), every advice branch,
the key line's exact shape, plots written as PNGs, report.json/report.txt."""

from __future__ import annotations

import random
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest

from agentroll.errors import ConfigError
from agentroll.run.metrics import MetricsWriter, read_trace
from agentroll.run.plots import TimelineLane, timeline_lanes, write_plots
from agentroll.run.report import (
    Report,
    advice,
    build_report,
    main_report,
    render_table,
    reward_fifths,
)

T0 = 1_000.0
KEY_LINE = re.compile(
    r"report steps=\d+ reward_first_fifth=-?\d+\.\d{3} reward_last_fifth=-?\d+\.\d{3} "
    r"syncs=\d+ syncs_mid_generation=\d+ episodes_restarted=\d+ lost=\d+ "
    r"rollout_idle=\d+\.\d{2} trainer_idle=\d+\.\d{2}"
)


def make_run(
    run_dir: Path,
    *,
    rollout_idle: float = 0.05,
    trainer_idle: float = 0.05,
    duration: float = 100.0,
    rewards: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5),
    staleness: dict[str, int] | None = None,
    tokens: int = 1000,
    kv_lagged: int = 0,
    syncs: tuple[tuple[int, float], ...] = ((2, 0.5), (0, 0.5), (3, 0.5)),  # (mid_gen, seconds)
    counters: dict[str, float] | None = None,
    max_staleness: int = 2,
) -> Path:
    """A run from T0 to T0+duration: one worker and one trainer whose busy/idle spans give the
    requested idle fractions, one step record per reward, syncs and counters."""
    end = T0 + duration
    with MetricsWriter(run_dir, "worker", clock=lambda: T0) as w:
        w.event("run", event="start", max_staleness=max_staleness)
        split = end - rollout_idle * duration
        w.span_at("rollout.busy", T0, split)
        if rollout_idle:
            w.span_at("rollout.idle", split, end)
        for i, (mid, secs) in enumerate(syncs):
            t = T0 + 10 * (i + 1)
            w.span_at("sync", t, t + secs)
            w.event(
                "sync",
                t=t,
                version=i + 1,
                strategy="rolling",
                seconds=secs,
                pause_ms=[float(i + 1), float(10 * (i + 1))],
                mid_generation=mid,
                episodes_restarted=0,
            )
        for name, value in (counters if counters is not None else {"lost": 0}).items():
            w.counter(name, value)
    with MetricsWriter(run_dir, "trainer", clock=lambda: end) as tr:
        split = end - trainer_idle * duration
        if trainer_idle:
            tr.span_at("trainer.idle", T0, T0 + trainer_idle * duration)
        tr.span_at("trainer.busy", T0 + trainer_idle * duration, end)
        for i, r in enumerate(rewards):
            tr.event(
                "step",
                t=T0 + i,
                step=i,
                version=i,
                reward_mean=r,
                reward_std=0.1,
                trajectories=4,
                tokens=tokens // max(1, len(rewards)),
                staleness=staleness if staleness is not None else {"0": 3, "1": 1},
                kv_lagged_tokens=kv_lagged // max(1, len(rewards)),
            )
        tr.event("run", event="end")
    return run_dir


def test_reward_fifths_maths() -> None:
    assert reward_fifths([1.0, 2.0, 3.0, 4.0, 5.0]) == (1.0, 5.0)
    assert reward_fifths([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == (1.0, 7.0)  # 7 // 5 = 1 step
    assert reward_fifths([float(i) for i in range(10)]) == (0.5, 8.5)  # 2 steps each
    assert reward_fifths([0.7]) == (0.7, 0.7)
    assert reward_fifths([]) == (None, None)


@pytest.mark.parametrize(
    ("rewards", "first", "last", "rising"),
    [
        ((0.0, 0.1, 0.2, 0.3, 0.4), 0.0, 0.4, True),
        ((0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.25), 0.5, 0.25, False),
        ((0.3,), 0.3, 0.3, False),
    ],
)
def test_report_reward_fifths_from_trace(
    tmp_path: Path, rewards: tuple[float, ...], first: float, last: float, rising: bool
) -> None:
    report = build_report(make_run(tmp_path, rewards=rewards))
    assert report.steps == len(rewards)
    assert report.reward_first_fifth == pytest.approx(first)
    assert report.reward_last_fifth == pytest.approx(last)
    assert report.reward_rising is rising


def test_report_figures(tmp_path: Path) -> None:
    run = make_run(
        tmp_path,
        rollout_idle=0.4,
        trainer_idle=0.03,
        counters={"lost": 0, "episodes": 40, "dropped_stale": 2, "kept_stale": 1},
        staleness={"0": 2, "2": 2},
    )
    report = build_report(run)
    assert report.duration == pytest.approx(100.0)
    assert report.syncs == 3 and report.syncs_mid_generation == 2
    assert report.sync_seconds == pytest.approx(1.5)
    assert report.pause_ms_p50 == 3.0 and report.pause_ms_p99 == 30.0  # nearest rank of 6
    assert (report.lost, report.episodes, report.dropped_stale, report.kept_stale) == (0, 40, 2, 1)
    assert report.episodes_restarted == 0
    assert report.staleness == {0: 10, 2: 10} and report.staleness_mean == 1.0
    assert report.trajectories == 20 and report.max_staleness == 2
    assert report.rollout_idle_fraction == pytest.approx(0.4)
    assert report.rollout_busy_fraction == pytest.approx(0.6)
    assert report.trainer_idle_fraction == pytest.approx(0.03)
    assert report.trainer_busy_fraction == pytest.approx(0.97)
    assert report.tokens == 1000 and report.tokens_per_second == pytest.approx(10.0)
    assert set(report.components) == {"worker", "trainer"}


def test_key_line_shape(tmp_path: Path) -> None:
    report = build_report(make_run(tmp_path, rollout_idle=0.4, trainer_idle=0.03))
    line = report.lines()[0]
    assert KEY_LINE.fullmatch(line), line
    assert line == (
        "report steps=5 reward_first_fifth=0.100 reward_last_fifth=0.500 syncs=3 "
        "syncs_mid_generation=2 episodes_restarted=0 lost=0 rollout_idle=0.40 trainer_idle=0.03"
    )
    assert all("=" in ln for ln in report.lines())


def test_lost_is_unknown_without_a_counter(tmp_path: Path) -> None:
    report = build_report(make_run(tmp_path, counters={}))
    assert report.lost is None and report.episodes is None
    assert " lost=unknown " in report.key_line()
    assert not KEY_LINE.fullmatch(report.key_line())  # a note cannot quote an unmeasured lost=0


def test_episodes_restarted_counter_wins_over_sync_sum(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    with MetricsWriter(run, "fleet", clock=lambda: T0 + 50) as w:
        w.event("sync", version=9, seconds=0.1, mid_generation=1, episodes_restarted=3)
        w.event("sync", version=10, seconds=0.1, mid_generation=0, episodes_restarted=2)
    assert build_report(run).episodes_restarted == 5  # no counter: summed over syncs
    with MetricsWriter(run, "worker-restarts", clock=lambda: T0 + 60) as w:
        w.counter("episodes_restarted", 4)
    assert build_report(run).episodes_restarted == 4


def test_overlapping_spans_count_once_and_clip_to_run(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "worker", clock=lambda: T0) as w:
        w.event("run", t=T0, event="start")
        w.span_at("rollout.busy", T0 - 5, T0 + 4)  # clipped to the run start
        w.span_at("rollout.busy", T0 + 2, T0 + 6)  # overlaps the first
        w.span_at("rollout.idle", T0 + 6, T0 + 10)
        w.event("run", t=T0 + 10, event="end")
    report = build_report(tmp_path)
    assert report.rollout_busy_fraction == pytest.approx(0.6)
    assert report.rollout_idle_fraction == pytest.approx(0.4)
    assert report.trainer_idle_fraction is None


def test_shares_are_of_each_component_lifetime(tmp_path: Path) -> None:
    """A rollout worker that starts after a 50 s warm-up is not idle during the warm-up."""
    with MetricsWriter(tmp_path, "trainer", clock=lambda: T0) as w:
        w.event("run", t=T0, event="start")
        w.span_at("trainer.busy", T0, T0 + 90)
        w.span_at("trainer.idle", T0 + 90, T0 + 100)
        w.event("run", t=T0 + 100, event="end")
    with MetricsWriter(tmp_path, "worker", clock=lambda: T0) as w:
        w.span_at("rollout.busy", T0 + 50, T0 + 90)
        w.span_at("rollout.idle", T0 + 90, T0 + 100)
    report = build_report(tmp_path)
    assert report.rollout_idle_fraction == pytest.approx(0.2)  # 10 s of its 50 s
    assert report.trainer_idle_fraction == pytest.approx(0.1)


def test_torn_last_line_does_not_change_the_figures(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    before = build_report(run)
    path = run / "trainer.jsonl"
    path.write_bytes(path.read_bytes() + b'{"kind":"step","t":1.0,"step":99,"reward_me')
    after = build_report(run)
    assert after.skipped_lines == 1
    assert msgspec.structs.replace(after, skipped_lines=0) == before


def _advice_for(tmp_path: Path, **kw: object) -> list[str]:
    return advice(build_report(make_run(tmp_path, **kw)))  # type: ignore[arg-type]


def test_advice_trainer_bottleneck(tmp_path: Path) -> None:
    tip, tradeoff = _advice_for(tmp_path, rollout_idle=0.4, trainer_idle=0.03)
    assert tradeoff.startswith("sync every 1.7 steps, mean staleness 0.25")
    assert tip.startswith("rollout idle 40%, trainer idle 3%: the trainer is the bottleneck")
    assert "move capacity to the trainer" in tip


def test_advice_rollout_bottleneck(tmp_path: Path) -> None:
    tip = _advice_for(tmp_path, rollout_idle=0.02, trainer_idle=0.5)[0]
    assert tip.startswith("rollout idle 2%, trainer idle 50%: rollout is the bottleneck")
    assert "replicas" in tip and "larger batches" in tip


def test_advice_balanced(tmp_path: Path) -> None:
    tips = _advice_for(tmp_path, rollout_idle=0.05, trainer_idle=0.04)
    assert tips[0] == "rollout idle 5%, trainer idle 4%: rollout and training are balanced; " + (
        "no capacity to move"
    )
    assert tips[1].startswith("sync every 1.7 steps, mean staleness 0.25")  # trade-off note


def test_advice_both_idle_and_mild(tmp_path: Path) -> None:
    tips = _advice_for(tmp_path / "a", rollout_idle=0.5, trainer_idle=0.6)
    assert "both sides wait a lot" in tips[0]
    tips = _advice_for(tmp_path / "b", rollout_idle=0.2, trainer_idle=0.05)
    assert "no strong imbalance" in tips[0] and "the rollout waits more" in tips[0]


def test_advice_without_spans(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "trainer", clock=lambda: T0) as w:
        w.event("step", step=0, reward_mean=1.0)
        w.event("step", t=T0 + 1, step=1, reward_mean=1.0)
    tips = advice(build_report(tmp_path))
    assert tips[0].startswith("no rollout/trainer busy/idle spans")


def test_advice_staleness_near_bound_with_drops(tmp_path: Path) -> None:
    tips = _advice_for(
        tmp_path,
        staleness={"1": 1, "2": 3},  # mean 1.75 of bound 2
        counters={"lost": 0, "dropped_stale": 5},
    )
    (tip,) = [t for t in tips if t.startswith("staleness")]
    assert "staleness mean 1.75 against a bound of 2 with 5 of 25 trajectories" in tip
    assert "syncs are too rare relative to steps (1.7 steps per sync)" in tip
    # same staleness, no drops: no staleness advice
    tips = _advice_for(tmp_path / "b", staleness={"1": 1, "2": 3})
    assert not [t for t in tips if t.startswith("staleness")]


def test_advice_sync_fraction_high(tmp_path: Path) -> None:
    tips = _advice_for(tmp_path, syncs=((1, 5.0), (1, 5.0), (0, 5.0)))
    (tip,) = [t for t in tips if t.startswith("syncs took")]
    assert "15.0s, 15% of the wall time (3 syncs, 5.00s each)" in tip
    assert "rolling or background" in tip and "delta" in tip


def test_advice_kv_lagged_and_lost(tmp_path: Path) -> None:
    tips = _advice_for(tmp_path, tokens=1000, kv_lagged=300, counters={"lost": 2})
    assert any(t.startswith("30% of the tokens attended to KV from older weights") for t in tips)
    assert any(t.startswith("lost=2:") for t in tips)
    tips = _advice_for(tmp_path / "b", tokens=1000, kv_lagged=100)
    assert not any("older weights" in t for t in tips)


def test_render_table_has_every_figure(tmp_path: Path) -> None:
    from rich.console import Console

    report = build_report(make_run(tmp_path))
    console = Console(width=200, record=True)
    console.print(render_table(report))
    text = console.export_text()
    assert "sync pause_ms_p99" in text and "episodes lost" in text and "component worker" in text


def test_plots_are_pngs(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    paths = write_plots(read_trace(run), run)
    assert sorted(p.name for p in paths) == ["reward.png", "staleness.png", "timeline.png"]
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert not list(run.glob(".*tmp"))


def test_plots_skip_missing_data(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, "worker", clock=lambda: T0) as w:
        w.span_at("rollout.busy", T0, T0 + 1)
    assert [p.name for p in write_plots(read_trace(tmp_path), tmp_path)] == ["timeline.png"]


def test_main_report_writes_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path, rollout_idle=0.4, trainer_idle=0.03)
    assert main_report(run) == 0
    out = capsys.readouterr().out
    key = build_report(run).key_line()
    assert key in out.splitlines() and "advice: rollout idle 40%" in out
    payload = msgspec.json.decode((run / "report.json").read_bytes())
    assert payload["report"]["syncs_mid_generation"] == 2
    assert msgspec.convert(payload["report"], Report, strict=False) == build_report(run)
    assert payload["plots"] == ["reward.png", "timeline.png", "staleness.png"]
    text = (run / "report.txt").read_text().splitlines()
    assert text[0] == key and text[-2].startswith("advice rollout idle 40%")
    assert (run / "timeline.png").stat().st_size > 0
    # rerunning does not read its own outputs as trace
    assert main_report(run) == 0


def test_main_report_without_trace(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no metric trace"):
        main_report(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        main_report(tmp_path / "nope")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(ConfigError, match="no metric records"):
        build_report(tmp_path)


# -- the timeline agrees with the table ------------------------------------------------------


def make_sampled_run(run_dir: Path, busy: dict[str, float], duration: float = 150.0) -> Path:
    """Replicas timed as the service samples them (agentroll.run.service._sample_busy): every
    0.5 s a busy span then an idle span, the busy share drawn around ``busy[name]``; the
    last replica starts after a 30 s warm-up and has overlapping busy spans; a trainer."""
    rng = random.Random(7)
    names = sorted(busy)
    with MetricsWriter(run_dir, "worker", clock=lambda: T0) as w:
        w.event("run", event="start")
        for name in names:
            t = T0 + (30.0 if name == names[-1] else 0.0)
            while t + 0.5 <= T0 + duration:
                b = min(0.5, max(0.0, rng.gauss(0.5 * busy[name], 0.1)))
                w.span_at("rollout.busy", t, t + b, component=name)
                if name == names[-1]:  # counted once by the table, drawn once
                    w.span_at("rollout.busy", t, t + b / 2, component=name)
                w.span_at("rollout.idle", t + b, t + 0.5, component=name)
                t += 0.5
        for i in range(30):
            w.span_at("sync", T0 + 5 * i + 1, T0 + 5 * i + 1.2)
    with MetricsWriter(run_dir, "trainer", clock=lambda: T0) as tr:
        for i in range(int(duration // 4)):
            tr.span_at("trainer.idle", T0 + 4 * i, T0 + 4 * i + 1.5)
            tr.span_at("trainer.busy", T0 + 4 * i + 1.5, T0 + 4 * i + 4)
        tr.event("run", event="end", t=T0 + duration)
    return run_dir


def _drawn_seconds(lane: TimelineLane, name: str) -> float:
    return sum(width for _, width in lane.bars.get(name, []))


def test_timeline_lanes_draw_the_busy_fractions_of_the_table(tmp_path: Path) -> None:
    """Per lane, the busy time drawn over the lane's extent is the table's busy fraction,
    and the idle drawn (background not covered by busy) its idle fraction."""
    run = make_sampled_run(tmp_path, {"replica-0": 0.8, "replica-1": 0.45})
    trace = read_trace(run)
    report = build_report(run, trace)
    lanes = timeline_lanes(trace)
    phase = [lane for lane in lanes if lane.family in ("rollout", "trainer")]
    assert [(lane.component, lane.family) for lane in phase] == [
        ("replica-0", "rollout"),
        ("replica-1", "rollout"),
        ("trainer", "trainer"),
    ]
    assert [(lane.component, lane.family) for lane in lanes if lane not in phase] == [
        ("worker", "sync")
    ]
    for lane in phase:
        table = report.components[lane.component]
        assert table.busy_fraction is not None and table.idle_fraction is not None
        extent = lane.end - lane.start
        busy = _drawn_seconds(lane, f"{lane.family}.busy")
        idle = _drawn_seconds(lane, f"{lane.family}.idle") - busy
        assert busy / extent == pytest.approx(table.busy_fraction, abs=0.01)
        assert idle / extent == pytest.approx(table.idle_fraction, abs=0.01)
        for start, width in lane.bars[f"{lane.family}.busy"]:
            assert lane.start - 1e-9 <= start and start + width <= lane.end + 1e-9
    r0, r1 = (report.components[n].busy_fraction or 0.0 for n in ("replica-0", "replica-1"))
    assert r0 == pytest.approx(0.8, abs=0.05) and r1 == pytest.approx(0.45, abs=0.05)
    assert phase[1].start == pytest.approx(30.0)  # drawn from its first span, as measured


def _green_share_by_lane(png: Path) -> list[float]:
    """Mean position of each rollout lane's pixels between idle grey (0) and busy green
    (1), from the middle row of each band of such pixels, top to bottom."""
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    img = imread(png)[:, :, :3].astype(float)
    green, grey = np.array(to_rgb("tab:green")), np.array(to_rgb("lightgray"))
    axis = green - grey
    t = (img - grey) @ axis / (axis @ axis)
    off = np.abs(img - (grey + t[..., None] * axis)).sum(axis=2)
    on = (off < 0.06) & (t > -0.02) & (t < 1.02)
    rows = np.flatnonzero(on.sum(axis=1) > 0.5 * img.shape[1])
    bands = np.split(rows, np.flatnonzero(np.diff(rows) > 1) + 1)
    return [float(np.clip(t[y][on[y]], 0, 1).mean()) for y in (b[len(b) // 2] for b in bands)]


def test_timeline_png_shows_each_replica_as_busy_as_the_table(tmp_path: Path) -> None:
    """The demo's symptom: replicas 79% busy in the table drawn mostly idle (every 0.5 s
    window a pixel or two wide, the idle bars' outlines painted over the busy ones).  The
    PNG's green share of each lane is its busy fraction."""
    run = make_sampled_run(tmp_path, {"replica-0": 0.8, "replica-1": 0.45})
    report = build_report(run)
    write_plots(read_trace(run), run)
    shares = _green_share_by_lane(run / "timeline.png")
    expected = [report.components[n].busy_fraction for n in ("replica-1", "replica-0")]
    assert shares == [pytest.approx(e, abs=0.03) for e in expected]  # replica-0 is drawn lowest
