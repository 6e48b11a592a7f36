"""Checks of the colocated placement: sleep and wake lose nothing a trainer sees.

Invariants: the reference is computed in the same run, on the same backend, without
interruptions; the engine runs batch-invariant, where exact parity is promised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

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


async def check_colocated_provenance(
    model: Path, steps: int = 6, device: str = "cpu", sleep_level: int = 2
) -> CheckResult:
    """A colocated run with partial rollouts on a long-tailed environment: every trained
    token's ``policy_version`` is one the engine served by the time the batch was trained
    (no token from the future), versions never decrease within a trajectory, ``kv_version``
    never exceeds ``policy_version``, stragglers parked across a switch kept their KV (their
    first tokens after it record the old ``kv_version``), and the staleness bound held."""
    import numpy as np

    from agentroll.backends.torch import TorchBackend
    from agentroll.rollout.engine import RolloutConfig, RolloutEngine
    from agentroll.run.placement import PlacementConfig, run_placement
    from agentroll.testing import LONG_TAIL_STOP_IDS, LongTail
    from agentroll.types import SamplingParams, Trajectory
    from agentroll.weights.exporter import WeightExporter

    max_staleness = 3
    async with TorchBackend(model, kv_cache_mb=16, device=device) as backend:
        live = {n: t.detach().clone() for n, t in backend.engine.runner.state_dict().items()}
        exporter = WeightExporter(lambda: live)
        g = torch.Generator().manual_seed(7)

        def train(batch: list[Trajectory], base: int) -> Any:
            for t in live.values():  # a stand-in step: small seeded changes everywhere
                t.add_(1e-3 * torch.randn(t.shape, generator=g, dtype=t.dtype))
            return exporter.export()

        env = LongTail(long_turns=8, every=4)
        config = RolloutConfig(
            concurrency=8,
            samples_per_task=2,
            sampling=SamplingParams(
                temperature=1.0, max_tokens=96, stop_token_ids=LONG_TAIL_STOP_IDS, ignore_eos=True
            ),
            progress="off",
        )
        placement = PlacementConfig(
            mode="colocated",
            partial_rollouts=True,
            sleep_level=sleep_level,
            max_staleness=max_staleness,
        )
        trained: list[tuple[int, Trajectory]] = []

        def on_step(step: int, batch: list[Trajectory], _: Any) -> None:
            trained.extend((step, t) for t in batch)

        async with RolloutEngine(backend, env, config) as engine:
            stats = await run_placement(
                engine,
                train,
                env.tasks(),
                steps=steps,
                batch_groups=4,
                config=placement,
                on_step=on_step,
            )
    future = monotone = kv_ok = stale_ok = 0
    spanning = kept = 0
    for step, t in trained:
        gen = t.loss_mask.astype(bool)
        pv, kv = t.policy_version[gen], t.kv_version[gen]
        future += int((pv > step).any())  # trained at version `step`: nothing newer exists
        monotone += int((np.diff(pv) >= 0).all())
        kv_ok += int((kv <= pv).all())
        stale_ok += int(step - int(pv.min()) <= max_staleness) if pv.size else 1
        if pv.size and pv.max() > pv.min():
            spanning += 1
            kept += int((kv < pv).any())  # keep: tokens after the switch over older KV
    n = len(trained)
    ok = (
        n > 0
        and future == 0
        and monotone == n
        and kv_ok == n
        and stale_ok == n
        and spanning > 0
        and kept > 0
        and len(stats.switches) == steps
    )
    return CheckResult(
        "colocated_provenance",
        ok,
        {
            "trajectories": n,
            "switches": len(stats.switches),
            "spanning_switches": spanning,
            "kept_kv_across_switch": kept,
            "future_versions": future,
            "decreasing_versions": n - monotone,
            "kv_after_policy": n - kv_ok,
            "over_staleness": n - stale_ok,
            "dropped_stale": stats.dropped_stale,
        },
    )
