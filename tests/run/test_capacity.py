"""Capacity that moves during a separate-pools run on the tiny model: replicas join at the
fleet's version and leave with their calls migrated, the trainer's thread count follows, every
move and window is recorded, nothing restarts and no trajectory is lost."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from agentroll.backends.torch import TorchBackend
from agentroll.fleet import FleetBackend
from agentroll.fleet.replica import LocalReplica
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.run.autoscale import Capacity, Decision, Direction
from agentroll.run.capacity import CapacityMover
from agentroll.run.placement import PlacementConfig, run_placement
from agentroll.testing import LONG_TAIL_STOP_IDS, LongTail
from agentroll.types import SamplingParams, Trajectory
from agentroll.weights.exporter import WeightExporter


class Scripted:
    """A controller that makes the given moves, one per window, in order."""

    def __init__(self, capacity: Capacity, moves: list[tuple[Direction, Capacity]]) -> None:
        self.capacity, self.moves, self.window = capacity, list(moves), 0
        self.seen: list[tuple[float, float]] = []

    def observe(self, rollout_idle: float, trainer_idle: float) -> Decision | None:
        self.window += 1
        self.seen.append((rollout_idle, trainer_idle))
        if not self.moves:
            return None
        direction, after = self.moves.pop(0)
        d = Decision(
            window=self.window,
            direction=direction,
            before=self.capacity,
            after=after,
            rollout_idle=rollout_idle,
            trainer_idle=trainer_idle,
            reason="scripted",
        )
        self.capacity = after
        return d


def _replica(model: Path, i: int) -> LocalReplica:
    return LocalReplica(TorchBackend(model, kv_cache_mb=16), name=f"rep-{i}")


async def test_moves_are_carried_out_between_steps(tiny_model: Path) -> None:
    live: dict[str, torch.Tensor] = {}
    holder: list[WeightExporter] = []
    threads_seen: list[int] = []

    def train(batch: list[Trajectory], base: int) -> Any:
        threads_seen.append(torch.get_num_threads())
        for t in live.values():
            t.mul_(1.0001)
        return holder[0].export()

    script = Scripted(
        Capacity(1, 2),
        [
            ("to_rollout", Capacity(2, 1)),
            ("to_rollout", Capacity(3, 1)),
            ("to_trainer", Capacity(2, 2)),
        ],
    )
    fleet = FleetBackend([_replica(tiny_model, 0)])
    env = LongTail(long_turns=6, every=4)
    config = RolloutConfig(
        concurrency=8,
        samples_per_task=2,
        sampling=SamplingParams(
            temperature=1.0, max_tokens=96, stop_token_ids=LONG_TAIL_STOP_IDS, ignore_eos=True
        ),
        progress="off",
    )
    moves: list[Any] = []
    async with fleet, RolloutEngine(fleet, env, config) as engine:
        first = fleet.replicas["rep-0"]
        assert isinstance(first, LocalReplica) and isinstance(first.backend, TorchBackend)
        live.update(
            {n: t.detach().clone() for n, t in first.backend.engine.runner.state_dict().items()}
        )
        exporter = WeightExporter(lambda: live)  # version 0: what the replica serves
        holder.append(exporter)
        mover = CapacityMover(
            fleet,
            script,  # type: ignore[arg-type]
            lambda i: _replica(tiny_model, i),
            exporter.full,
            trainer_threads=2,
        )
        stats = await run_placement(
            engine,
            train,
            env.tasks(),
            steps=8,
            batch_groups=4,
            config=PlacementConfig(mode="separate", window_steps=2, max_staleness=8),
            capacity=mover,
            on_move=moves.append,
        )
        names = sorted(fleet.replicas)
        versions = {r.version for r in fleet.replicas.values()}
    assert stats.steps == 8 and stats.failed == 0 and stats.restarted == 0
    assert [m.error for m in stats.moves] == ["", "", ""] and moves == stats.moves
    assert [(m.replicas_before, m.replicas_after) for m in stats.moves] == [(1, 2), (2, 3), (3, 2)]
    assert len(names) == 2 and versions == {exporter.version}
    # windows are measured with the capacity that ran them; the first before any move
    assert [w.replicas for w in stats.windows[:4]] == [1, 2, 3, 2]
    assert all(0.0 <= w.rollout_idle <= 1.0 and 0.0 <= w.trainer_idle <= 1.0 for w in stats.windows)
    assert len(script.seen) == 3
    # the trainer ran with the threads of the capacity at each step (steps 0-2 at 2 threads)
    assert threads_seen[:2] == [2, 2] and 1 in threads_seen and threads_seen[-1] == 2
    assert 0.0 <= stats.rollout_idle <= 1.0 and stats.rollout_capacity_s > 0


async def test_a_move_that_fails_leaves_the_capacity_as_it_was(tiny_model: Path) -> None:
    fleet = FleetBackend([_replica(tiny_model, 0)])
    script = Scripted(Capacity(1, 1), [("to_rollout", Capacity(2, 1))])
    async with fleet:

        def broken(i: int) -> LocalReplica:
            return LocalReplica(TorchBackend(tiny_model / "missing"), name=f"bad-{i}")

        mover = CapacityMover(fleet, script, broken, lambda: None)  # type: ignore[arg-type,return-value]
        await mover.begin_window()
        await asyncio.sleep(0.01)
        move = await mover.step(1)
        assert move is not None and move.error and list(fleet.replicas) == ["rep-0"]
        assert script.capacity == Capacity(1, 1)


@pytest.mark.slow
def test_an_autoscaled_recipe_moves_capacity_and_reports_it(
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
name = "autoscale"
steps = 8
timeout = 300.0
[environment]
name = "calculator"
kwargs = {{ num_tasks = 64, max_operand = 9, traces = "{repo}/examples/data/calculator_traces.jsonl" }}
[placement]
mode = "separate"
autoscale = true
autoscale_band = 0.0
window_steps = 1
max_replicas = 3
cores = 2
"""
        + small_fleet_toml
    )
    run_dir = tmp_path / "run"
    assert main(["run", str(recipe), "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    line = re.search(r"^report steps=(\d+) ", out, re.M)
    assert line is not None and line.group(1) == "8", out
    records = [json.loads(x) for x in (run_dir / "in-process.jsonl").read_text().splitlines()]
    moves = [r for r in records if r["kind"] == "autoscale"]
    # band 0: two windows asking the same way move it (the tiny trainer is the slow side here)
    assert moves and not any(m["error"] for m in moves), moves
    for m in moves:
        assert abs(m["replicas_after"] - m["replicas_before"]) == 1
        assert 1 <= m["replicas_after"] <= 3 and m["threads_after"] >= 1
    steps = [r for r in records if r["kind"] == "step"]
    assert [s["step"] for s in steps] == list(range(8))
    spans = {(r["name"], r.get("component")) for r in records if r["kind"] == "span"}
    assert any(n == "trainer.busy" for n, _ in spans)
    assert any(n == "rollout.busy" and c.startswith("rollout-") for n, c in spans if c)
    report = json.loads((run_dir / "report.json").read_text())
    assert len(report["report"]["moves"]) == len(moves)
    advice = (run_dir / "report.txt").read_text()
    assert "autoscale moved capacity" in advice
    assert (run_dir / "timeline.png").is_file()
