"""``agentroll bench vllm``: what the ``vllm`` backend adds on top of vLLM itself.

One ``AsyncLLM`` serves the same requests through ``VLLMBackend.generate`` (A,
``tokens_per_s``) and through ``AsyncLLM.generate`` directly (B, ``raw_tokens_per_s``) in
``--pairs`` alternating rounds; ``overhead_ratio`` is the median per-pair raw / ours (1.0: no
overhead), ``ratio_min``/``ratio_max`` its range (see ``run_vllm_bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.bench.pairs import (
    DEFAULT_PAIRS,
    alternate_async,
    check_pairs,
    median_side,
    paired_ratio,
)
from agentroll.errors import ConfigError

__all__ = ["add_arguments", "format_line", "main", "run_vllm_bench"]

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
    pairs: int = DEFAULT_PAIRS,
    rounds: int | None = None,
    progress: bool = True,
    backend: Any = None,
) -> dict[str, float]:
    """Run the bench on ``model`` (default: the tiny model, made in a temporary directory),
    or on an already started ``backend`` (a ``VLLMBackend``; ``model`` is then ignored), over
    ``pairs`` alternating rounds (``rounds``: the same, by its older name), after one untimed
    warm-up round of each.  Requests are ``concurrency`` of ``max_tokens`` sampled tokens
    (``ignore_eos``, seeded, logprobs on): ours are chunks with logprobs and versions, as
    episodes see them; raw are vLLM's own outputs, logprobs requested, nothing converted.
    Returns the line's figures: each side's median over the pairs, the ratio and its range.
    Raises ``ConfigError`` for a count below 1 or fewer than 5 pairs, and ``AssertionError``
    when a round delivers the wrong number of tokens."""
    pairs = check_pairs(pairs, "pairs") if rounds is None else check_pairs(rounds, "rounds")
    if min(concurrency, max_tokens) < 1:
        raise ConfigError("concurrency and max_tokens must both be >= 1")
    from agentroll.backends.vllm import VLLMBackend

    def say(msg: str) -> None:
        if progress:
            print(f"bench vllm: {msg}", file=sys.stderr, flush=True)

    async def measure(backend: Any) -> list[tuple[float, float]]:
        await _ours(backend, concurrency, max_tokens, "warm-ours")
        await _raw(backend.llm, concurrency, max_tokens, "warm-raw")

        ours_seen: list[float] = []  # for the progress line

        async def ours(r: int) -> float:
            ours_seen.append(await _ours(backend, concurrency, max_tokens, f"ours-{r}"))
            return ours_seen[-1]

        async def raw(r: int) -> float:
            rate = await _raw(backend.llm, concurrency, max_tokens, f"raw-{r}")
            say(f"pair {r + 1}/{pairs}: ours {ours_seen[-1]:.1f} tok/s, raw {rate:.1f} tok/s")
            return rate

        return await alternate_async(ours, raw, pairs)

    if backend is not None:
        measured = await measure(backend)
    else:
        with tempfile.TemporaryDirectory(prefix="agentroll-bench-vllm-") as tmp:
            if model is None:
                from agentroll.model.tiny import create_tiny

                model = create_tiny(Path(tmp) / "tiny")
            say(f"starting vLLM on {model} (about 25 s on a 2-core CPU)")
            max_len = PROMPT_LEN + max_tokens + 64
            async with VLLMBackend(model, max_model_len=max_len) as started:
                measured = await measure(started)
    overhead = paired_ratio([(raw, ours) for ours, raw in measured])
    return {
        "tokens_per_s": median_side([ours for ours, _ in measured]),
        "raw_tokens_per_s": median_side([raw for _, raw in measured]),
        "overhead_ratio": overhead.ratio,
        **overhead.fields(),
    }


def format_line(result: dict[str, float]) -> str:
    return (
        f"tokens_per_s={result['tokens_per_s']:.1f} "
        f"raw_tokens_per_s={result['raw_tokens_per_s']:.1f} "
        f"overhead_ratio={result['overhead_ratio']:.3f} pairs={int(result['pairs'])} "
        f"ratio_min={result['ratio_min']:.3f} ratio_max={result['ratio_max']:.3f}"
    )


# -- command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    parser.add_argument(
        "--pairs",
        "--rounds",
        dest="pairs",
        type=int,
        default=DEFAULT_PAIRS,
        help="alternating timed rounds (ours, raw), at least 5; the ratio is their median",
    )


def main(args: argparse.Namespace) -> int:
    """CLI entry: progress on stderr, the result line on stdout.  ``run_vllm_bench`` checks
    the counts (``ConfigError``)."""
    result = asyncio.run(
        run_vllm_bench(args.concurrency, args.max_tokens, model=args.model, pairs=args.pairs)
    )
    print(format_line(result), flush=True)
    return 0
