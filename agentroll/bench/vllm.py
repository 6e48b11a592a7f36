"""``agentroll bench vllm``: what the ``vllm`` backend adds on top of vLLM itself.

One ``AsyncLLM`` serves both measurements, in the same run: ``concurrency`` requests of
``max_tokens`` sampled tokens each (``ignore_eos``, seeded, logprobs on) through
``VLLMBackend.generate`` (``tokens_per_s``: chunks with logprobs and versions, as episodes
see them), and the same requests through ``AsyncLLM.generate`` directly
(``raw_tokens_per_s``: vLLM's own outputs, logprobs requested, nothing converted).  Rounds
alternate (ours, raw, ours, raw, ...) after one untimed warm-up round of each, and each
figure is the median over ``rounds``; ``overhead_ratio = raw / ours`` (1.0: no overhead).
Every round must deliver ``concurrency * max_tokens`` tokens or the bench fails.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.errors import ConfigError

__all__ = ["format_line", "main_vllm", "run_vllm_bench"]

PROMPT_LEN = 32


def _prompt(i: int) -> list[int]:
    return [(7 * i + 13 * k) % 997 + 1 for k in range(PROMPT_LEN)]


async def _ours(backend: Any, concurrency: int, max_tokens: int, tag: str) -> float:
    async def one(i: int) -> int:
        req = GenerationRequest(
            request_id=f"{tag}-{i}",
            prompt_ids=_prompt(i),
            sampling=SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True),
        )
        n = 0
        async for chunk in backend.generate(req):
            n += len(chunk.token_ids)
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    _check(counts, concurrency, max_tokens, "vllm backend")
    return sum(counts) / elapsed


async def _raw(llm: Any, concurrency: int, max_tokens: int, tag: str) -> float:
    from vllm import SamplingParams as VSamplingParams
    from vllm import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    async def one(i: int) -> int:
        params = VSamplingParams(
            max_tokens=max_tokens,
            seed=i,
            ignore_eos=True,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
        )
        n = 0
        async for out in llm.generate(
            TokensPrompt(prompt_token_ids=_prompt(i)), params, f"{tag}-{i}"
        ):
            n += len(out.outputs[0].token_ids)
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    _check(counts, concurrency, max_tokens, "raw AsyncLLM")
    return sum(counts) / elapsed


def _check(counts: list[int], concurrency: int, max_tokens: int, what: str) -> None:
    if sum(counts) != concurrency * max_tokens:
        raise AssertionError(
            f"{what} delivered {sum(counts)} tokens, expected {concurrency * max_tokens}"
        )


async def run_vllm_bench(
    concurrency: int = 16,
    max_tokens: int = 64,
    *,
    model: str | Path | None = None,
    rounds: int = 5,
    progress: bool = True,
    backend: Any = None,
) -> dict[str, float]:
    """Run the bench on ``model`` (default: the tiny model, made in a temporary directory),
    or on an already started ``backend`` (a ``VLLMBackend``; ``model`` is then ignored)."""
    if min(concurrency, max_tokens, rounds) < 1:
        raise ConfigError("concurrency, max_tokens and rounds must all be >= 1")
    from agentroll.backends.vllm import VLLMBackend

    def say(msg: str) -> None:
        if progress:
            print(f"bench vllm: {msg}", file=sys.stderr, flush=True)

    async def measure(backend: Any) -> tuple[list[float], list[float]]:
        await _ours(backend, concurrency, max_tokens, "warm-ours")
        await _raw(backend.llm, concurrency, max_tokens, "warm-raw")
        ours: list[float] = []
        raw: list[float] = []
        for r in range(rounds):
            ours.append(await _ours(backend, concurrency, max_tokens, f"ours-{r}"))
            raw.append(await _raw(backend.llm, concurrency, max_tokens, f"raw-{r}"))
            say(f"round {r + 1}/{rounds}: ours {ours[-1]:.1f} tok/s, raw {raw[-1]:.1f} tok/s")
        return ours, raw

    if backend is not None:
        ours, raw = await measure(backend)
    else:
        with tempfile.TemporaryDirectory(prefix="agentroll-bench-vllm-") as tmp:
            if model is None:
                from agentroll.model.tiny import create_tiny

                model = create_tiny(Path(tmp) / "tiny")
            say(f"starting vLLM on {model} (about 25 s on a 2-core CPU)")
            max_len = PROMPT_LEN + max_tokens + 64
            async with VLLMBackend(model, max_model_len=max_len) as started:
                ours, raw = await measure(started)
    tokens_per_s = statistics.median(ours)
    raw_tokens_per_s = statistics.median(raw)
    return {
        "tokens_per_s": tokens_per_s,
        "raw_tokens_per_s": raw_tokens_per_s,
        "overhead_ratio": raw_tokens_per_s / tokens_per_s,
    }


def format_line(result: dict[str, float]) -> str:
    return (
        f"tokens_per_s={result['tokens_per_s']:.1f} "
        f"raw_tokens_per_s={result['raw_tokens_per_s']:.1f} "
        f"overhead_ratio={result['overhead_ratio']:.3f}"
    )


def main_vllm(concurrency: int, max_tokens: int, model: str | None, rounds: int) -> None:
    """CLI entry: progress on stderr, the result line on stdout."""
    result = asyncio.run(run_vllm_bench(concurrency, max_tokens, model=model, rounds=rounds))
    print(format_line(result), flush=True)
