"""Quickstart: calculator episodes against a scripted mock policy, summarised in a table.

The mock stands in for a model: on its first turn it reads the question out of the decoded
prompt and calls the ``calc`` tool; on its second it reads the tool's result and answers,
slipping by one in about a fifth of episodes (seeded by the request) so that rewards vary.
Run: ``python examples/quickstart.py`` (a few seconds, no GPU, no network).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

from rich.console import Console
from rich.table import Table

from agentroll import (
    GenerationRequest,
    MockBackend,
    RolloutConfig,
    RolloutEngine,
    Trajectory,
    load_environment,
)
from agentroll.model.tokenizer import tiny_chat_tokenizer  # the project-made tokenizer

NUM_TASKS = 32
SAMPLES_PER_TASK = 2
SLIP_RATE = 0.2
TOKENIZER = tiny_chat_tokenizer()


def mock_policy(request: GenerationRequest) -> str:
    """A scripted 'model': call ``calc`` on the question, then answer with its result."""
    text = TOKENIZER.decode(request.prompt_ids, skip_special_tokens=False)
    if request.turn_index == 0:
        expression = re.findall(r"What is (.+?)\?", text)[-1]
        call = {"name": "calc", "arguments": {"expression": expression}}
        return f"Let me compute it.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
    result = int(re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)[-1])
    if random.Random(request.sampling.seed).random() < SLIP_RATE:
        result += 1
    return f"The tool says so.\nAnswer: {result}"


def summary(trajectories: list[Trajectory], seconds: float) -> Table:
    """A two-column table of what the run produced."""
    n = len(trajectories)
    statuses: dict[str, int] = {}
    for t in trajectories:
        statuses[t.status] = statuses.get(t.status, 0) + 1
    rows = {
        "episodes": f"{n} ({NUM_TASKS} tasks x {SAMPLES_PER_TASK} samples)",
        "status": ", ".join(f"{k}={v}" for k, v in sorted(statuses.items())),
        "mean reward": f"{sum(t.reward for t in trajectories) / n:.3f}",
        "turns / episode": f"{sum(len(t.turns) for t in trajectories) / n:.2f}",
        "tokens (generated)": f"{sum(t.num_tokens for t in trajectories)} "
        f"({sum(t.num_generated for t in trajectories)})",
        "tool seconds / episode": f"{sum(t.metrics['tool_seconds'] for t in trajectories) / n:.3f}",
        "wall time": f"{seconds:.2f} s ({n / seconds:.1f} episodes/s)",
    }
    table = Table(title="agentroll quickstart: calculator x mock policy")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(key, value)
    return table


async def run() -> tuple[list[Trajectory], float]:
    env = load_environment("calculator", num_tasks=NUM_TASKS, seed=0)
    backend = MockBackend(mock_policy, tokenizer=TOKENIZER)
    config = RolloutConfig(samples_per_task=SAMPLES_PER_TASK, concurrency=16, progress="off")
    started = time.perf_counter()
    async with RolloutEngine(backend, env, config, tokenizer=TOKENIZER) as engine:
        trajectories = [t async for t in engine.run()]
    return trajectories, time.perf_counter() - started


def main() -> None:
    trajectories, seconds = asyncio.run(run())
    console = Console()
    console.print(summary(trajectories, seconds))
    failed = [t for t in trajectories if t.status == "failed"]
    if failed:
        console.print(f"[red]first failure:[/red] {failed[0].error}")


if __name__ == "__main__":
    main()
