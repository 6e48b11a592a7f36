"""``agentroll bench placement`` end to end on small settings: one line per mode with every
field, the paired ratio line, and the properties the figures must have whatever the speed."""

from __future__ import annotations

from agentroll.bench.placement import format_lines, run_placement_bench


async def test_bench_placement_lines() -> None:
    medians, ratios = await run_placement_bench(steps=3, pairs=5, verbose=False, kv_cache_mb=16)
    lines = format_lines(medians, ratios)
    assert [line.split()[0] for line in lines[:3]] == [
        "mode=separate",
        "mode=colocated_wait",
        "mode=colocated_partial",
    ]
    for line in lines[:3]:
        fields = dict(kv.split("=") for kv in line.split())
        assert set(fields) >= {
            "steps_per_s",
            "tokens_per_s",
            "tail_wait_s",
            "rollout_idle",
            "trainer_idle",
            "sleep_freed_mb",
            "wake_ms",
            "restarted",
            "lost",
        }
        assert fields["restarted"] == "0" and fields["lost"] == "0"
    by_mode = {m["mode"]: m for m in medians}
    assert by_mode["separate"]["sleep_freed_mb"] == 0.0  # it never sleeps
    assert by_mode["colocated_partial"]["tail_wait_s"] <= by_mode["colocated_wait"]["tail_wait_s"]
    assert by_mode["colocated_partial"]["sleep_freed_mb"] > 0
    assert ratios["pairs"] == 5 and "speedup_partial_vs_wait" in lines[3]
