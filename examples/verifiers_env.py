"""A verifiers environment run by agentroll: its own rollout and rubric, agentroll's tokens.

The environment is a verifiers ``ToolEnv`` defined here (an ``add`` tool, a three-row
dataset, a rubric that checks the answer); agentroll runs its rollouts through the gateway,
so the tokens are the ones the backend sampled and verifiers' reward is on each trajectory.
A scripted mock stands in for the model.  Run: ``python examples/verifiers_env.py``
(a few seconds, no GPU, no network; needs ``pip install 'agentroll[verifiers]'``).
"""

from __future__ import annotations

import asyncio
import json
import re

import verifiers as vf
from datasets import Dataset

from agentroll import GenerationRequest, MockBackend, RolloutConfig, RolloutEngine, Trajectory
from agentroll.integrations.verifiers import VerifiersEnvironment
from agentroll.model.tokenizer import tiny_chat_tokenizer

TOKENIZER = tiny_chat_tokenizer()
QUESTIONS = [("2 + 3", "5"), ("10 + 32", "42"), ("7 + 1", "8")]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def correct_answer(completion: list, answer: str) -> float:
    """1 when the final reply ends with the answer."""
    return float(str(completion[-1].content or "").strip().endswith(answer))


def load_environment() -> vf.Environment:
    """What a verifiers environment package exposes; here, defined in the file."""
    dataset = Dataset.from_list([{"question": f"What is {q}?", "answer": a} for q, a in QUESTIONS])
    rubric = vf.Rubric(funcs=[correct_answer])
    return vf.ToolEnv(dataset=dataset, tools=[add], rubric=rubric, max_turns=4)


def mock_policy(request: GenerationRequest) -> str:
    """A scripted 'model': call ``add`` on the question, then answer with its result; it
    slips by one when the episode's seed is odd, so rewards vary within a group."""
    text = TOKENIZER.decode(request.prompt_ids, skip_special_tokens=False)
    if request.turn_index == 0:
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1]
        call = {"name": "add", "arguments": {"a": int(a), "b": int(b)}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    result = int(re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)[-1])
    return f"The answer is {result + (request.sampling.seed or 0) % 2}"


async def run() -> list[Trajectory]:
    env = VerifiersEnvironment(load_environment())
    backend = MockBackend(mock_policy, tokenizer=TOKENIZER)
    config = RolloutConfig(samples_per_task=2, concurrency=8, progress="off")
    async with backend, RolloutEngine(backend, env, config, tokenizer=TOKENIZER) as engine:
        return [t async for t in engine.run()]


def main() -> None:
    trajectories = asyncio.run(run())
    for t in sorted(trajectories, key=lambda t: (t.task_id, t.sample_index)):
        print(
            f"row {t.task_id} sample {t.sample_index}: status={t.status} reward={t.reward} "
            f"turns={len(t.turns)} sampled_tokens={t.num_generated} rewards={t.rewards}"
        )
    failed = sum(t.status == "failed" for t in trajectories)
    mean = sum(t.reward for t in trajectories) / len(trajectories)
    print(f"episodes={len(trajectories)} failed={failed} mean reward={mean:.3f}")


if __name__ == "__main__":
    main()
