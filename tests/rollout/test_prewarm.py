"""Sandbox pre-warm: a group's sandboxes start when it is admitted, each sample's episode
takes its own, and none is left open however the run ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment, EpisodeState, tool
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
    return Boxes.made


def engine(tok: ChatTokenizer, **cfg: Any) -> RolloutEngine:
    config = RolloutConfig(**{"progress": "off", "samples_per_task": 4, "concurrency": 2, **cfg})
    return RolloutEngine(MockBackend([CALL, "done"], tokenizer=tok), Boxed(), config, tokenizer=tok)


TASKS = [Task(id=f"t{i}", data={"prompt": f"q{i}"}) for i in range(2)]


async def test_each_sample_takes_the_sandbox_started_for_it(
    tok: ChatTokenizer, boxes: list[Boxes]
) -> None:
    async with engine(tok, prewarm_sandboxes=True) as e:
        trajs = [t async for t in e.run(TASKS)]
    assert [t.status for t in trajs] == ["ok"] * 8
    assert len(boxes) == 8  # one per sample, none opened twice
    assert all(b.started and b.closed for b in boxes)


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


async def test_a_cut_sample_closes_its_prewarmed_sandbox(
    tok: ChatTokenizer, boxes: list[Boxes]
) -> None:
    async with engine(tok, prewarm_sandboxes=True, group_cutoff=0.5, concurrency=1) as e:
        trajs = [t async for t in e.run(TASKS[:1])]
    assert [t.status for t in trajs] == ["ok", "ok", "cut", "cut"]
    assert len(boxes) == 4 and all(b.closed for b in boxes)
