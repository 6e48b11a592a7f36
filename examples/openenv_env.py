"""OpenEnv: agentroll episodes against an OpenEnv environment server, over its MCP tools.

Starts the example OpenEnv server shipped with agentroll (arithmetic questions; ``calc`` and
``submit`` tools; reward 1 for the right answer) on 127.0.0.1, then runs episodes on it with
a scripted mock policy that computes with ``calc`` and submits, slipping by one in about a
third of episodes.  Run: ``python examples/openenv_env.py`` (seconds; no GPU, no network).
"""

from __future__ import annotations

import asyncio
import json
import random
import re

from agentroll import GenerationRequest, MockBackend, RolloutConfig, RolloutEngine, Trajectory
from agentroll.integrations.openenv import OpenEnvEnvironment
from agentroll.integrations.openenv_example import create_example_app
from agentroll.integrations.openenv_server import serve_app
from agentroll.model.tokenizer import tiny_chat_tokenizer

NUM_EPISODES = 6
TOKENIZER = tiny_chat_tokenizer()


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def mock_policy(request: GenerationRequest) -> str:
    """A scripted 'model': ``calc`` the question, then ``submit`` the result."""
    text = TOKENIZER.decode(request.prompt_ids, skip_special_tokens=False)
    if request.turn_index == 0:
        return call("calc", expression=re.findall(r"What is (.+?)\?", text)[-1])
    value = float(re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)[-1])
    slip = random.Random(request.sampling.seed).random() < 1 / 3
    return call("submit", answer=value + slip)


async def run(url: str) -> list[Trajectory]:
    config = RolloutConfig(samples_per_task=NUM_EPISODES, concurrency=4, progress="off")
    async with OpenEnvEnvironment(url, timeout=10) as env:
        print("tools:", ", ".join(s.name for s in env.tool_specs))
        backend = MockBackend(mock_policy, tokenizer=TOKENIZER)
        async with RolloutEngine(backend, env, config, tokenizer=TOKENIZER) as engine:
            return [t async for t in engine.run()]


def main() -> None:
    with serve_app(create_example_app()) as url:
        print(f"example OpenEnv server at {url}")
        trajectories = asyncio.run(run(url))
    for t in trajectories:
        question = t.messages[0].content.split("?")[0] + "?"
        print(f"{t.id[:8]} {t.status:6s} turns={len(t.turns)} reward={t.reward:.1f}  {question}")
    mean = sum(t.reward for t in trajectories) / len(trajectories)
    print(f"episodes={len(trajectories)} mean_reward={mean:.3f}")


if __name__ == "__main__":
    main()
