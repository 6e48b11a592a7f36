"""Early group cut-off: once enough of a group's samples finished with one reward, its
stragglers (running or not started) stop, take that reward and are never trained on; a
group with mixed rewards or a failure runs to the end."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment, EpisodeState, tool
from agentroll.errors import ConfigError
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.types import Task, Trajectory

CALL = '<tool_call>\n{"name": "work", "arguments": {}}\n</tool_call>'


class Stragglers(Environment):
    """Samples 0 and 1 work briefly, the others for ``slow`` seconds; the reward is
    ``reward_of(sample index)``."""

    system_prompt = "Work, then answer."
    max_turns = 3

    def __init__(self, slow: float = 30.0, reward_of: Any = lambda i: 1.0) -> None:
        self.slow, self.reward_of = slow, reward_of
        self.started: list[int] = []

    @tool
    async def work(self, state: EpisodeState) -> str:
        """Do the work."""
        self.started.append(state.sample_index)
        await asyncio.sleep(0.01 if state.sample_index < 2 else self.slow)
        return "done"

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        return float(self.reward_of(state.sample_index))


async def run(
    env: Environment, tok: ChatTokenizer, *, groups: bool = False, **cfg: Any
) -> tuple[list[Trajectory], RolloutEngine, float]:
    config = RolloutConfig(**{"progress": "off", "samples_per_task": 4, **cfg})
    tasks = [Task(id="t0", data={"prompt": "go"})]
    start = time.perf_counter()
    async with RolloutEngine(
        MockBackend([CALL, "ok"], tokenizer=tok), env, config, tokenizer=tok
    ) as e:
        if groups:
            out = [t async for g in e.run_groups(tasks) for t in g]
        else:
            out = [t async for t in e.run(tasks)]
    return sorted(out, key=lambda t: t.sample_index), e, time.perf_counter() - start


@pytest.mark.parametrize("groups", [False, True], ids=["run", "run_groups"])
async def test_running_stragglers_of_a_decided_group_are_cut(
    tok: ChatTokenizer, groups: bool
) -> None:
    trajs, engine, seconds = await run(Stragglers(), tok, groups=groups, group_cutoff=0.5)
    assert seconds < 10  # the stragglers' 30 s of work were cut short
    assert [t.status for t in trajs] == ["ok", "ok", "cut", "cut"]
    assert [t.reward for t in trajs] == [1.0] * 4
    assert trajs[2].rewards == {"group_cutoff": 1.0} and trajs[2].stop_reason == "group_cutoff"
    assert all(not t.loss_mask.any() for t in trajs[2:]) and trajs[0].loss_mask.any()
    assert trajs[2].error is None and engine.stats["groups_cut"] == 1


async def test_samples_not_started_yet_end_at_once(tok: ChatTokenizer) -> None:
    env = Stragglers()
    trajs, _, _ = await run(env, tok, group_cutoff=0.5, concurrency=1)
    assert [t.status for t in trajs] == ["ok", "ok", "cut", "cut"]
    assert sorted(env.started) == [0, 1]  # the cut ones never worked
    assert all(not t.turns for t in trajs[2:])


@pytest.mark.parametrize(
    "reward_of",
    [lambda i: float(i % 2), lambda i: 1 / 0 if i == 1 else 1.0],
    ids=["mixed", "failed"],
)
async def test_a_group_with_mixed_rewards_or_a_failure_runs_to_the_end(
    tok: ChatTokenizer, reward_of: Any
) -> None:
    env = Stragglers(slow=0.3, reward_of=reward_of)
    trajs, engine, _ = await run(env, tok, group_cutoff=0.5)
    assert "cut" not in [t.status for t in trajs] and engine.stats["groups_cut"] == 0
    assert sorted(env.started) == [0, 1, 2, 3]


async def test_off_by_default(tok: ChatTokenizer) -> None:
    trajs, engine, _ = await run(Stragglers(slow=0.3), tok)
    assert [t.status for t in trajs] == ["ok"] * 4 and engine.stats["groups_cut"] == 0


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5])
def test_a_bad_share_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="group_cutoff"):
        RolloutConfig(group_cutoff=bad)
