"""``agentroll bench pause`` on a small run: it completes, loses nothing and prints the line
the issue specifies."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from agentroll.bench.pause import format_line, run_pause_bench

LINE = re.compile(
    r"strategy=(\w+) policy=(\w+) episodes_restarted=\d+ tokens_discarded=\d+ "
    r"tokens_recomputed=\d+ pause_p50_ms=[\d.]+ pause_p99_ms=[\d.]+ "
    r"busy_fraction_during_sync=[\d.]+ lost=\d+"
)


async def small_run(model: Path, strategy: str, policy: str) -> dict[str, Any]:
    return await run_pause_bench(
        replicas=2,
        episodes=12,
        syncs=2,
        strategy=strategy,
        policy=policy,  # type: ignore[arg-type]
        model=model,
        max_tokens=64,
        seed=4,  # syncs at 13% and 24% of the run's tokens: generations are surely in flight
        verbose=False,
    )


async def test_small_rolling_run(tiny_model: Path) -> None:
    r = await small_run(tiny_model, "rolling", "keep")
    assert r["syncs"] == 2 and r["lost"] == 0 and r["failed_updates"] == 0
    assert r["syncs_under_load"] == 2 and r["tokens_recomputed"] == 0  # keep moves the KV
    assert r["tokens_discarded"] == 0 and r["episodes_restarted"] == 0
    assert 0 < r["busy_fraction_during_sync"] <= 1
    m = LINE.fullmatch(format_line(r))
    assert m is not None and m.groups() == ("rolling", "keep")


async def test_restart_reports_what_it_throws_away(tiny_model: Path) -> None:
    r = await small_run(tiny_model, "pause", "restart")
    assert r["lost"] == 0 and r["tokens_discarded"] > 0 and r["episodes_restarted"] > 0


async def test_every_sync_runs_while_the_fleet_generates(tiny_model: Path) -> None:
    """Six episodes of 16 tokens are over long before six rolling syncs are: the run admits
    more episodes until the last sync is done, so none of them times an idle fleet."""
    r = await run_pause_bench(
        replicas=2,
        episodes=6,
        syncs=5,
        strategy="rolling",
        policy="keep",
        model=tiny_model,
        max_tokens=16,
        seed=1,
        verbose=False,
    )
    assert r["syncs"] == r["syncs_under_load"] == 5
    assert r["episodes_run"] > 6 and r["lost"] == 0
    assert r["busy_fraction_during_sync"] > 0
