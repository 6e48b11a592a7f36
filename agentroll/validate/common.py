"""What every check shares: its result line, sample prompts and requests, stream collection.

Invariant: prompts and request seeds are fixed (seed 0, ids 1000+i), so a check and its
reference see the same inputs.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentroll.backends.base import GenerationRequest, SamplingParams


@dataclass
class CheckResult:
    name: str
    passed: bool
    figures: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        figs = " ".join(f"{k}={v}" for k, v in self.figures.items())
        return f"check={self.name} status={'pass' if self.passed else 'fail'} {figs}".rstrip()


def sample_prompts(tok: Any, n: int) -> list[list[int]]:
    words = ["hello", "compute", "answer", "tool", "python", "number", "guess", "test"]
    rng = random.Random(0)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(3 + i % 7))
        out.append(tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"))
    return out


def sample_request(
    i: int, prompt: list[int], max_tokens: int, temperature: float = 1.0
) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"req-{i}",
        prompt_ids=prompt,
        sampling=SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=1000 + i, stop_token_ids=()
        ),
    )


async def collect_stream(
    backend: Any, request: GenerationRequest, on_token: Callable[[int], Any] | None = None
) -> tuple[list[int], list[float], list[tuple[int, int]]]:
    ids: list[int] = []
    lps: list[float] = []
    versions: list[tuple[int, int]] = []
    async for chunk in backend.generate(request):
        if chunk.rollback:
            del ids[-chunk.rollback :], lps[-chunk.rollback :], versions[-chunk.rollback :]
        ids += chunk.token_ids
        lps += chunk.logprobs
        versions += [(chunk.policy_version, chunk.kv_version)] * len(chunk.token_ids)
        if on_token is not None:
            await on_token(len(ids))
    return ids, lps, versions


Streamed = tuple[list[int], list[float], list[tuple[int, int]]]


async def start_streams(
    backend: Any, requests: list[GenerationRequest], after_chunks: int
) -> list[asyncio.Task[Streamed]]:
    """``collect_stream`` of each request as a task; returns once ``after_chunks`` chunks
    arrived over all of them (the requests are in flight), or once they all ended."""
    seen = 0
    enough = asyncio.Event()

    async def on_token(_: int) -> None:
        nonlocal seen
        seen += 1
        if seen >= after_chunks:
            enough.set()

    tasks = [asyncio.create_task(collect_stream(backend, r, on_token)) for r in requests]
    waiter: asyncio.Future[Any] = asyncio.ensure_future(enough.wait())
    everything: asyncio.Future[Any] = asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.wait([waiter, everything], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    return tasks
