"""Sandbox pre-warm: the next groups' sandboxes are started ahead of their episodes, each
goes to one episode, expired or failed ones are never handed out, and none is left open
however the run ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment, EpisodeState, tool
from agentroll.errors import ConfigError
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.sandbox.base import Sandbox, SandboxConfig
from agentroll.testing import FakeSandbox
from agentroll.types import Task, Trajectory

CALL = '<tool_call>\n{"name": "touch", "arguments": {}}\n</tool_call>'


class Boxes(FakeSandbox):
    made: list[Boxes] = []

    def __init__(self) -> None:
        super().__init__()
        self.started = False
        Boxes.made.append(self)

    async def start(self) -> None:
        await asyncio.sleep(0.01)
        self.started = True


class Boxed(Environment):
    system_prompt = "Touch."
    max_turns = 3
    sandbox_config = SandboxConfig()

    @tool
    async def touch(self, sandbox: Sandbox) -> str:
        """Use the sandbox."""
        assert isinstance(sandbox, Boxes) and sandbox.started and not sandbox.closed
        await asyncio.sleep(0.05)
        return "ok"

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        return 1.0


@pytest.fixture(autouse=True)
def boxes(monkeypatch: pytest.MonkeyPatch) -> list[Boxes]:
    Boxes.made = []
    monkeypatch.setattr("agentroll.rollout.episode_loop.open_sandbox", lambda cfg, **kw: Boxes())
    monkeypatch.setattr("agentroll.rollout.prewarm.open_sandbox", lambda cfg, **kw: Boxes())
    return Boxes.made


def engine(tok: ChatTokenizer, **cfg: Any) -> RolloutEngine:
    config = RolloutConfig(**{"progress": "off", "samples_per_task": 4, "concurrency": 2, **cfg})
    return RolloutEngine(MockBackend([CALL, "done"], tokenizer=tok), Boxed(), config, tokenizer=tok)


TASKS = [Task(id=f"t{i}", data={"prompt": f"q{i}"}) for i in range(2)]


async def test_each_episode_takes_a_started_sandbox_and_one_group_stays_ahead(
    tok: ChatTokenizer, boxes: list[Boxes]
) -> None:
    async with engine(tok, prewarm_sandboxes=True) as e:
        trajs = [t async for t in e.run(TASKS)]
        assert e._warm is not None and e._warm.counters["taken"] == 8
        assert e.stats["prewarmed_sandboxes"] == 8
        # the forecast: the next group's four are started while nothing runs
        await asyncio.sleep(0.05)
        ahead = boxes[8:]
        assert len(ahead) == 4 and all(b.started and not b.closed for b in ahead)
        # a second run (the next step) finds them started
        more = [t async for t in e.run(TASKS[:1])]
    assert [t.status for t in trajs + more] == ["ok"] * 12
    assert len(boxes) == 16  # twelve taken, four ahead when the engine closed
    assert all(b.closed for b in boxes)


async def test_without_prewarm_each_episode_opens_its_own(
    tok: ChatTokenizer, boxes: list[Boxes]
) -> None:
    async with engine(tok) as e:
        trajs = [t async for t in e.run(TASKS)]
    assert len(trajs) == len(boxes) == 8 and all(b.closed for b in boxes)


async def test_leaving_early_closes_the_sandboxes_nobody_took(
    tok: ChatTokenizer, boxes: list[Boxes]
) -> None:
    async with engine(tok, prewarm_sandboxes=True) as e:
        async for _ in e.run(TASKS):
            break
    await asyncio.sleep(0)
    assert boxes and all(b.closed for b in boxes)


async def test_a_cut_sample_takes_no_sandbox(tok: ChatTokenizer, boxes: list[Boxes]) -> None:
    async with engine(tok, prewarm_sandboxes=True, group_cutoff=0.5, concurrency=1) as e:
        trajs = [t async for t in e.run(TASKS[:1])]
        assert e._warm is not None and e._warm.counters["taken"] == 2
    assert [t.status for t in trajs] == ["ok", "ok", "cut", "cut"]
    assert len(boxes) == 6 and all(b.closed for b in boxes)  # four ahead, two replacements


async def test_more_groups_ahead_start_more_sandboxes(
    tok: ChatTokenizer, boxes: list[Boxes]
) -> None:
    async with engine(tok, prewarm_sandboxes=True, prewarm_groups=3):
        await asyncio.sleep(0.05)
        assert len(boxes) == 12 and all(b.started for b in boxes)
    assert all(b.closed for b in boxes)


def test_prewarm_groups_out_of_range_is_a_clear_error(tok: ChatTokenizer) -> None:
    with pytest.raises(ConfigError, match="prewarm_groups=0"):
        engine(tok, prewarm_sandboxes=True, prewarm_groups=0)
