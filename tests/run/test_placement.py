"""The colocated and separate placements on the tiny model: provenance across phase
switches, partial rollouts against waiting for the longest trajectory, a trainer that never
delivers, and configuration errors."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentroll.backends.mock import MockBackend
from agentroll.backends.torch import TorchBackend
from agentroll.errors import ConfigError
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.run.placement import PlacementConfig, run_placement
from agentroll.testing import LONG_TAIL_STOP_IDS, LongTail
from agentroll.types import SamplingParams, Trajectory
from agentroll.validate.placement import check_colocated_provenance
from agentroll.weights.exporter import WeightExporter


async def test_check_colocated_provenance(tiny_model: Path) -> None:
    r = await check_colocated_provenance(tiny_model)
    assert r.passed, r.line()


def _config() -> RolloutConfig:
    return RolloutConfig(
        concurrency=8,
        samples_per_task=2,
        sampling=SamplingParams(
            temperature=1.0, max_tokens=96, stop_token_ids=LONG_TAIL_STOP_IDS, ignore_eos=True
        ),
        progress="off",
    )


async def _run(
    tiny_model: Path, placement: PlacementConfig, train: Any = None, steps: int = 4
) -> Any:
    async with TorchBackend(tiny_model, kv_cache_mb=16) as backend:
        live = {n: t.detach().clone() for n, t in backend.engine.runner.state_dict().items()}
        exporter = WeightExporter(lambda: live)

        def default_train(batch: list[Trajectory], base: int) -> Any:
            for t in live.values():
                t.mul_(1.0001)
            return exporter.export()

        env = LongTail(long_turns=8, every=4)
        async with RolloutEngine(backend, env, _config()) as engine:
            return await run_placement(
                engine,
                train or default_train,
                env.tasks(),
                steps=steps,
                batch_groups=4,
                config=placement,
            ), backend.policy_version


async def test_partial_rollouts_remove_the_tail_wait(tiny_model: Path) -> None:
    wait, _ = await _run(tiny_model, PlacementConfig(mode="colocated", partial_rollouts=False))
    partial, version = await _run(tiny_model, PlacementConfig(mode="colocated"))
    assert version == 4 and len(partial.switches) == 4
    assert wait.tail_wait_s > 0 and partial.tail_wait_s <= 0.2 * wait.tail_wait_s
    # waiting: every switch finds no episode in flight; partial: stragglers are parked
    assert all(s.parked == 0 for s in wait.switches)
    assert sum(s.parked for s in partial.switches) > 0
    assert partial.restarted == 0 and partial.failed == 0 and wait.failed == 0


async def test_separate_pools_sync_after_each_step(tiny_model: Path) -> None:
    stats, version = await _run(tiny_model, PlacementConfig(mode="separate"))
    assert stats.steps == 4 and version == 4 and not stats.switches
    assert stats.trainer_busy_s > 0


async def test_a_trainer_that_never_delivers_wakes_on_the_last_good_weights(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    running, most = 0, 0
    guard = threading.Lock()

    def hung(batch: list[Trajectory], base: int) -> Any:
        import time

        nonlocal running, most
        with guard:
            running += 1
            most = max(most, running)
        time.sleep(0.5)  # longer than wake_timeout: the trainer died or hangs
        with guard:
            running -= 1
        raise RuntimeError("never delivered")

    config = PlacementConfig(mode="colocated", sleep_level=2, wake_timeout=0.2)
    stats, version = await _run(tiny_model, config, train=hung, steps=2)
    assert version == 0 and [s.fallback for s in stats.switches] == [True, True]
    await asyncio.sleep(1.2)  # the late steps finish in their threads
    assert most == 1  # the second step waited for the one past its timeout
    assert "last good weights" in caplog.text
    assert stats.failed == 0


async def test_colocated_needs_a_backend_that_sleeps(tok: Any) -> None:
    backend = MockBackend(lambda req: "hi", tokenizer=tok)
    env = LongTail()
    async with RolloutEngine(backend, env, RolloutConfig(progress="off")) as engine:
        with pytest.raises(ConfigError, match="needs a backend that can sleep"):
            await run_placement(
                engine,
                lambda b, v: None,
                env.tasks(),
                steps=1,
                batch_groups=1,
                config=PlacementConfig(mode="colocated"),
            )


def test_placement_config_says_what_to_change() -> None:
    with pytest.raises(ConfigError, match="mode"):
        PlacementConfig(mode="mixed")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="sleep_level"):
        PlacementConfig(sleep_level=3)
    with pytest.raises(ConfigError, match="wake_timeout"):
        PlacementConfig(wake_timeout=0)


@pytest.mark.slow
def test_a_colocated_recipe_runs_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], small_fleet_toml: str
) -> None:
    import json
    import re

    from agentroll.cli import main

    repo = Path(__file__).resolve().parents[2]
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f"""
[run]
name = "colocated"
steps = 3
timeout = 300.0
[environment]
name = "calculator"
kwargs = {{ num_tasks = 64, max_operand = 9, traces = "{repo}/examples/data/calculator_traces.jsonl" }}
[placement]
mode = "colocated"
sleep_level = 2
"""
        + small_fleet_toml
    )
    run_dir = tmp_path / "run"
    assert main(["run", str(recipe), "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    line = re.search(r"^report steps=(\d+) ", out, re.M)
    assert line is not None and line.group(1) == "3", out
    records = [json.loads(x) for x in (run_dir / "colocated.jsonl").read_text().splitlines()]
    switches = [r for r in records if r["kind"] == "switch"]
    assert [s["version"] for s in switches] == [1, 2, 3] and not any(
        s["fallback"] for s in switches
    )
    steps = [r for r in records if r["kind"] == "step"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(int(k) <= 1 for s in steps for k in s["staleness"])  # buffer.max_staleness
    assert "colocated, rollout and training take turns" in (run_dir / "report.txt").read_text()
