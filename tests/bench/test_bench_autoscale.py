"""``agentroll bench autoscale`` end to end on small settings: a line per mode with every
field, the paired ratio line, and what must hold whatever the speed."""

from __future__ import annotations

from typing import Any

from agentroll.bench.autoscale import KEYS, end_imbalance, format_lines, run_autoscale_bench
from agentroll.run.capacity import Window


async def test_bench_autoscale_lines() -> None:
    medians, ratios = await run_autoscale_bench(
        steps=6, pairs=5, hidden=128, layers=2, verbose=False
    )
    lines = format_lines(medians, ratios)
    assert [line.split()[0] for line in lines[:2]] == [
        "mode=separate_fixed",
        "mode=separate_autoscale",
    ]
    for line in lines[:2]:
        fields = dict(kv.split("=") for kv in line.split())
        assert set(fields) >= set(KEYS)
        assert fields["restarted"] == "0" and fields["lost"] == "0"
    fixed = next(m for m in medians if m["mode"] == "separate_fixed")
    assert fixed["moves"] == 0 and fixed["replicas_end"] == 2  # nothing moves it
    assert ratios["pairs"] == 5 and lines[2].startswith("imbalance_end_ratio=")


def _w(ri: float, ti: float) -> Any:
    return Window(
        step=0,
        end=0.0,
        seconds=1.0,
        rollout_idle=ri,
        trainer_idle=ti,
        replicas=1,
        trainer_threads=1,
    )


def test_end_imbalance_is_the_last_quarter_without_the_start_up() -> None:
    ws = [_w(1.0, 0.0)] + [_w(0.5, 0.1)] * 6 + [_w(0.2, 0.1)] * 2
    assert abs(end_imbalance(ws) - 0.1) < 1e-9  # the last 2 of the 8 after the first
    assert end_imbalance([_w(0.3, 0.1)]) == abs(0.3 - 0.1)
