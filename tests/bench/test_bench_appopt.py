"""``agentroll bench appopt`` on small settings: the line's fields, the cache really served
calls, the verdict compares what the two sides saw, and bad options say what to do."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from agentroll.bench.appopt import AppOptBenchConfig, measure, run_side, verdict
from agentroll.errors import ConfigError

pytestmark = pytest.mark.bwrap


def test_the_line_has_its_fields_and_the_cache_served_calls() -> None:
    config = AppOptBenchConfig(episodes=16, samples=4, concurrency=4, pairs=5)
    line = asyncio.run(measure(config, "tool_cache", lambda _: None))
    fields = dict(kv.split("=") for kv in line.split())
    assert list(fields)[:5] == ["opt", "speedup", "tokens_saved", "hits", "verdict"]
    assert fields["opt"] == "tool_cache" and fields["verdict"] == "pass", line
    assert fields["pairs"] == "5" and fields["episodes"] == "16" and fields["tool_calls"] == "32"
    assert int(fields["hits"]) > 0 and fields["differ"] == "0" and fields["impure"] == "none"
    assert float(fields["ratio_min"]) <= float(fields["speedup"]) <= float(fields["ratio_max"])


def test_group_sharing_keeps_every_token_and_saves_the_groups_prefill() -> None:
    config = AppOptBenchConfig(episodes=16, samples=4, concurrency=8, pairs=5)
    line = asyncio.run(measure(config, "group_prefix_sharing", lambda _: None))
    fields = dict(kv.split("=") for kv in line.split())
    assert fields["verdict"] == "pass" and fields["differ"] == "0", line
    assert int(fields["tokens_saved"]) > 0 and fields["target"] == "0.750"
    assert float(fields["prefill_saved"]) >= 0.75


def test_prewarm_keeps_every_tool_result() -> None:
    config = AppOptBenchConfig(episodes=16, samples=4, concurrency=4, pairs=5)
    with_ = asyncio.run(run_side(config, opt="sandbox_prewarm", on=True))
    without = asyncio.run(run_side(config, opt="sandbox_prewarm", on=False))
    assert verdict(with_, without, opt="sandbox_prewarm") == (True, "differ=0 impure=none")
    # hits: every episode found its sandbox started (the tool cache is off here)
    assert with_.hits == 16 and without.hits == 0


def test_the_verdict_fails_when_the_sides_saw_different_tool_results() -> None:
    config = AppOptBenchConfig(episodes=8, samples=4, concurrency=4, pairs=5)
    with_ = asyncio.run(run_side(config, tool_cache=True))
    without = asyncio.run(run_side(config, tool_cache=False))
    assert verdict(with_, without) == (True, "differ=0 impure=none")
    task, sample, results, *rest = without.seen[0]
    changed = [(task, sample, ("something else",) + results[1:], *rest), *without.seen[1:]]
    assert verdict(with_, dataclasses.replace(without, seen=changed))[0] is False
    assert verdict(dataclasses.replace(with_, impure=("run_tests",)), without)[0] is False


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"opt": ("vibes",)}, "unknown optimisation"),
        ({"env": "calculator"}, "scripted agent of"),
        ({"env": "guess_number", "opt": ("group_prefix_sharing",)}, "use one of"),
        ({"pairs": 2}, "--pairs must be >= 5"),
        ({"episodes": 0}, "--episodes must be >= 1"),
    ],
)
def test_bad_options_say_what_to_do(bad: dict[str, object], says: str) -> None:
    kwargs = {("opts" if k == "opt" else k): v for k, v in bad.items()}
    with pytest.raises(ConfigError, match=says):
        AppOptBenchConfig(**kwargs)  # type: ignore[arg-type]


def test_early_cutoff_cuts_stragglers_of_decided_groups_and_keeps_the_rest() -> None:
    config = AppOptBenchConfig(episodes=32, samples=8, concurrency=8, pairs=5)
    with_ = asyncio.run(run_side(config, opt="early_group_cutoff", on=True))
    without = asyncio.run(run_side(config, opt="early_group_cutoff", on=False))
    ok, why = verdict(with_, without, opt="early_group_cutoff")
    assert ok and why == f"differ=0 cut={with_.cut}", why
    assert with_.cut > 0 and without.cut == 0
    assert with_.generated < without.generated  # the stragglers stopped generating
    assert len(with_.trajectories) == len(without.trajectories) == 32  # groups stay whole
