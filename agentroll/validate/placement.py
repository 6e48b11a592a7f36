"""Checks of the colocated placement: sleep and wake lose nothing a trainer sees.

Invariants: the reference is computed in the same run, on the same backend, without
interruptions; the engine runs batch-invariant, where exact parity is promised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from agentroll.types import ResumePolicy
from agentroll.validate.common import CheckResult, collect_stream, sample_prompts, sample_request

#: (level, resume policy) pairs the parity check sleeps with
SLEEP_CASES: tuple[tuple[int, ResumePolicy], ...] = (
    (1, "keep"),
    (2, "keep"),
    (1, "recompute"),
    (2, "restart"),
)


async def check_sleep_wake_parity(
    model: Path, n: int = 8, max_tokens: int = 32, device: str = "cpu"
) -> CheckResult:
    """Requests slept at random token boundaries (both levels; keep, recompute and restart)
    and woken on unchanged weights continue token for token and logprob for logprob as if
    never interrupted, with their versions unchanged."""
    from agentroll.backends.torch import TorchBackend

    async with TorchBackend(model, batch_invariant=True, device=device) as backend:
        prompts = sample_prompts(backend.tokenizer, n)

        reference = await asyncio.gather(
            *(
                collect_stream(backend, sample_request(i, p, max_tokens))
                for i, p in enumerate(prompts)
            )
        )
        sleeps = {case: 0 for case in SLEEP_CASES}
        freed: list[int] = []
        lock = asyncio.Lock()
        results = []
        for case in SLEEP_CASES:

            def sleeper(
                i: int, case: tuple[int, ResumePolicy] = case
            ) -> Callable[[int], Awaitable[None]]:
                # each request sleeps the backend once on passing each of its two thresholds
                # (once only: a restart regenerates past them again)
                todo = [3 + (5 * i) % 11, 17 + (3 * i) % 9]

                async def maybe_sleep(num_tokens: int) -> None:
                    if not todo or num_tokens < todo[0] or lock.locked():
                        return
                    todo.pop(0)
                    async with lock:
                        report = await backend.sleep(case[0], policy=case[1])
                        freed.append(report.freed_bytes)
                        await asyncio.sleep(0)  # requests made meanwhile wait
                        await backend.wake(fallback=True)  # unchanged weights
                        sleeps[case] += 1

                return maybe_sleep

            results.append(
                await asyncio.gather(
                    *(
                        collect_stream(backend, sample_request(i, p, max_tokens), sleeper(i))
                        for i, p in enumerate(prompts)
                    )
                )
            )
    equal = all(
        got[i][0] == reference[i][0] and got[i][2] == reference[i][2]
        for got in results
        for i in range(n)
    )
    max_diff = max(
        (
            abs(x - y)
            for got in results
            for i in range(n)
            for x, y in zip(reference[i][1], got[i][1], strict=False)
        ),
        default=0.0,
    )
    ok = equal and max_diff == 0.0 and all(v >= n // 2 for v in sleeps.values())
    return CheckResult(
        "sleep_wake_parity",
        ok,
        {
            "requests": n,
            **{f"sleeps_l{lv}_{p}": v for (lv, p), v in sleeps.items()},
            "tokens_equal": equal,
            "max_abs_logprob_diff": max_diff,
            "min_freed_mb": round(min(freed, default=0) / 2**20, 1),
        },
    )
