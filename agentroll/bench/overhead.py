"""``agentroll bench overhead``: the rollout engine's own cost per tool turn, no baseline.

N episodes of T tool turns against a zero-latency MockBackend and a no-op in-process tool,
on the real token path (chat template, sampled ids appended, tool results rendered
incrementally, masks and versions filled); every prompt and tool result differs, so no
cache serves what a real run would miss.  No ratio, so nothing is paired.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import resource
import time
from dataclasses import dataclass
from typing import Any

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment
from agentroll.errors import ConfigError
from agentroll.model.tokenizer import tiny_chat_tokenizer
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.tool import tool
from agentroll.types import Task


class _EchoEnv(Environment):
    """T turns of a no-op tool, then a final answer."""

    name = "bench_echo"
    system_prompt = "You are a benchmark assistant. Call the echo tool, then answer."
    max_turns = 1_000

    @tool
    async def echo(self, value: int) -> str:
        """Return the value (a no-op).

        Args:
            value: any integer
        """
        return f"echo {value}"

    async def reward(self, trajectory: Any, state: Any) -> float:
        return 1.0


def _script(turns: int, tok: ChatTokenizer) -> Any:
    """The mock policy: a backend emits token ids, so the ids of the fixed parts of a reply
    are computed once and only the varying number is tokenized per request."""
    head = tok.encode('<tool_call>\n{"name": "echo", "arguments": {"value": ')
    tail = tok.encode("}}\n</tool_call>") + [tok.eot_id]
    final = tok.encode("Done. Answer: 42") + [tok.eot_id]
    # The tiny tokenizer splits digits individually, so a number's ids are its digits' ids.
    digit = {c: tok.encode(c) for c in "0123456789"}
    if any(len(v) != 1 for v in digit.values()) or tok.encode("9071") != [
        digit[c][0] for c in "9071"
    ]:
        raise RuntimeError("the bench tokenizer no longer splits digits one by one")
    digit_id = {c: v[0] for c, v in digit.items()}
    counter = itertools.count(100_000)

    def respond(request: GenerationRequest) -> list[int]:
        if request.turn_index < turns:
            # a new argument per request: every tool result differs, so no cache of the
            # engine can serve it
            value = next(counter)
            return head + [digit_id[c] for c in str(value)] + tail
        return final

    return respond


async def overhead(episodes: int, turns: int, concurrency: int) -> dict[str, float]:
    """Run the overhead benchmark; returns the figures it prints."""
    tok = tiny_chat_tokenizer()
    backend = MockBackend(_script(turns, tok), tokenizer=tok)
    env = _EchoEnv()
    tasks = [
        Task(id=f"t{i}", data={"prompt": f"Task {i}: echo {i * 7} please."})
        for i in range(episodes)
    ]
    cfg = RolloutConfig(
        concurrency=concurrency, sampling=SamplingParams(max_tokens=256), keep_messages=False
    )
    done = num_turns = failed = 0
    async with RolloutEngine(backend, env, cfg, tokenizer=tok) as engine:
        start = time.perf_counter()
        async for traj in engine.run(tasks):
            done += 1
            failed += traj.status == "failed"
            num_turns += sum(1 for t in traj.turns if t.tool_calls)
        elapsed = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"{failed} benchmark episodes failed; the figure would be meaningless")
    return {
        "turns_per_s": num_turns / elapsed,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "episodes": done,
    }


# -- command line --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OverheadBenchConfig:
    """The options of ``agentroll bench overhead``; every count is at least 1."""

    episodes: int
    turns: int
    concurrency: int

    def __post_init__(self) -> None:
        for name in ("episodes", "turns", "concurrency"):
            if (value := getattr(self, name)) < 1:
                raise ConfigError(f"--{name} must be >= 1 (got {value}); pass a positive count")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=4, help="tool turns per episode")
    parser.add_argument("--concurrency", type=int, default=256)


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench and print its result line."""
    config = OverheadBenchConfig(args.episodes, args.turns, args.concurrency)
    r = asyncio.run(overhead(config.episodes, config.turns, config.concurrency))
    print(
        f"turns_per_s={r['turns_per_s']:.1f} peak_rss_mb={r['peak_rss_mb']:.1f} episodes={int(r['episodes'])}"
    )
    return 0
