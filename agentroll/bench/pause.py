"""``agentroll bench pause``: weight syncs in the middle of a fleet's rollouts.

Runs calculator episodes on the tiny model with the built-in engine over ``--replicas``
in-process replicas, performs ``--syncs`` real delta updates (SyntheticTrainer) at seeded
random moments (when the fleet has streamed a random number of tokens, between 5% and 85% of
the ``--episodes`` episodes' tokens), and prints one final line::

    strategy=S policy=P episodes_restarted=N tokens_discarded=N tokens_recomputed=N
    pause_p50_ms=F pause_p99_ms=F busy_fraction_during_sync=F lost=N

``pause_*``: how long each replica stood paused per sync (stop at a token boundary ->
resumed); ``busy_fraction_during_sync``: replica-time spent in forward passes while a sync
was in progress, over all syncs; ``lost``: episodes that did not come back ``ok`` or
``truncated``.  Every sync must run while the fleet generates, so the run keeps admitting
episodes (``--episodes`` at a time) until the last sync is done: syncs take longer than a
fast engine takes to finish the first ``--episodes``, and a sync of an idle fleet would
count as busy 0.  A line before it gives the mean engine step, the reference for the pause
target (one decode step + 50 ms), the episodes run and the syncs that found generations in
flight (a warning says when one did not).  Replicas run with a prefill budget of
``--prefill-budget`` tokens per step (512), which bounds every step, so a pause does not
wait long for the step in flight even when ``recompute`` re-prefills every request.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentroll.backends.base import ResumePolicy, SamplingParams

#: the run admits episodes beyond ``--episodes`` while syncs are still to come, up to this
#: many times as many
_MAX_EPISODES_FACTOR = 20


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


async def run_pause_bench(
    *,
    replicas: int = 4,
    episodes: int = 64,
    syncs: int = 10,
    strategy: str = "rolling",
    policy: ResumePolicy = "keep",
    model: str | Path | None = None,
    max_tokens: int = 96,
    seed: int = 0,
    kind: str = "local",
    in_flight: str = "migrate",
    prefill_budget: int = 512,
    verbose: bool = True,
) -> dict[str, Any]:
    args = (
        replicas,
        episodes,
        syncs,
        strategy,
        policy,
        model,
        max_tokens,
        seed,
        kind,
        in_flight,
        prefill_budget,
    )
    if kind == "ray":
        from agentroll.fleet.ray import local_cluster

        with local_cluster(num_cpus=max(4, replicas)):
            return await _run(*args, verbose)
    return await _run(*args, verbose)


async def _run(
    replicas: int,
    episodes: int,
    syncs: int,
    strategy: str,
    policy: ResumePolicy,
    model: str | Path | None,
    max_tokens: int,
    seed: int,
    kind: str,
    in_flight: str,
    prefill_budget: int,
    verbose: bool,
) -> dict[str, Any]:
    from agentroll.backends.torch import TorchBackend
    from agentroll.chat import ChatTokenizer
    from agentroll.env import load_environment
    from agentroll.fleet import FleetBackend, LocalReplica
    from agentroll.model.tiny import ensure_tiny_model
    from agentroll.rollout.engine import RolloutConfig, RolloutEngine
    from agentroll.rollout.pause import fixed_policy
    from agentroll.testing import SyntheticTrainer

    model_dir = ensure_tiny_model(model)
    if syncs >= episodes:
        raise ValueError("--syncs must be smaller than --episodes (syncs happen between finishes)")
    rng = random.Random(seed)
    total_tokens = episodes * max_tokens  # every generation runs to max_tokens (ignore_eos)
    triggers = sorted(rng.uniform(0.05, 0.85) * total_tokens for _ in range(syncs))
    # The prefill budget bounds every step, so a pause never waits long for the step in
    # flight, even right after a sync when recompute re-prefills every request.
    overrides: dict[str, Any] = {"max_num_seqs": 64, "max_num_batched_tokens": prefill_budget}
    reps: list[Any]
    if kind == "ray":
        from agentroll.fleet.ray import RayReplica

        reps = [RayReplica(model_dir, name=f"replica-{i}", **overrides) for i in range(replicas)]
    else:
        reps = [
            LocalReplica(TorchBackend(model_dir, **overrides), name=f"replica-{i}")
            for i in range(replicas)
        ]
    fleet = FleetBackend(reps, strategy=strategy, in_flight=in_flight)  # type: ignore[arg-type]
    env = load_environment("calculator")
    tokenizer = ChatTokenizer.from_pretrained(model_dir)
    trainer = SyntheticTrainer(model_dir, seed=seed)
    cfg = RolloutConfig(
        concurrency=episodes,
        seed=seed,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True),
        progress="off",
    )
    pool = list(env.tasks())
    started = 0  # episodes handed to the engine
    loaded: list[bool] = []  # per sync: were generations in flight when it started?
    trajs: list[Any] = []
    t_start = time.perf_counter()
    async with fleet:
        async with RolloutEngine(fleet, env, cfg, tokenizer=tokenizer) as engine:
            engine.pauses.policy = fixed_policy(policy)

            # The updates are made up front (the trainer is another process in real runs):
            # one made at its trigger would land well after it, when the engine may have
            # finished every episode (a run takes well under a second on the tiny model).
            updates = [await asyncio.to_thread(trainer.step) for _ in triggers]

            async def syncer() -> list[Any]:
                """Sync whenever the fleet has streamed the next trigger's token count."""
                done = []

                def generating() -> bool:
                    return any(fleet.calls_on(n) for n in fleet.replicas)

                for at, update in zip(triggers, updates, strict=True):
                    while fleet.stats.tokens < at:  # noqa: ASYNC110 - polls a counter
                        await asyncio.sleep(0.001)
                    # at a moment when a generation is in flight (every episode may be in a
                    # tool call at the trigger); not forever: a stalled fleet is reported
                    deadline = time.perf_counter() + 10.0
                    while not generating() and time.perf_counter() < deadline:  # noqa: ASYNC110
                        await asyncio.sleep(0.001)
                    loaded.append(generating())
                    done.append(await fleet.update(update, policies=engine.pauses.policies))
                return done

            sync_task = asyncio.create_task(syncer())

            def tasks() -> Iterator[Any]:
                """``episodes`` tasks, then more while syncs are still to come (at most
                ``_MAX_EPISODES_FACTOR`` times as many): every sync then runs while the fleet
                generates.  Without it a fast engine ends the episodes' generations before
                the later triggers, and those syncs time an idle fleet (busy 0)."""
                nonlocal started
                while started < episodes or (
                    not sync_task.done() and started < _MAX_EPISODES_FACTOR * episodes
                ):
                    started += 1
                    yield pool[(started - 1) % len(pool)]

            async for traj in engine.run(tasks()):
                trajs.append(traj)
            reports = await sync_task
        steps = [await r.steps() for r in reps]
        busy = [await r.busy_seconds() for r in reps]
    wall = time.perf_counter() - t_start
    pauses = [ms for r in reports for ms in r.pause_ms]
    weight = sum(r.seconds * replicas for r in reports)
    busy_frac = (
        sum(r.busy_fraction * r.seconds * replicas for r in reports) / weight
        if weight
        else float("nan")
    )
    step_frac = (
        sum(r.step_fraction * r.seconds * replicas for r in reports) / weight
        if weight
        else float("nan")
    )
    step_ms = 1e3 * sum(busy) / max(1, sum(steps))
    lost = started - sum(1 for t in trajs if t.status in ("ok", "truncated"))
    under_load = sum(loaded)
    if under_load < len(reports) and verbose:
        print(
            f"warning: {len(reports) - under_load} of {len(reports)} syncs started with no "
            f"generation in flight (after {started} episodes); their busy fraction is 0: "
            "use more --episodes or fewer --syncs",
            flush=True,
        )
    st = fleet.stats
    result = {
        "strategy": strategy,
        "policy": policy,
        "episodes_restarted": st.episodes_restarted,
        "tokens_discarded": st.tokens_discarded,
        "tokens_recomputed": st.tokens_recomputed,
        "pause_p50_ms": statistics.median(pauses) if pauses else float("nan"),
        "pause_p99_ms": _percentile(pauses, 0.99),
        "busy_fraction_during_sync": busy_frac,
        "step_fraction_during_sync": step_frac,
        "lost": lost,
        "mean_step_ms": step_ms,
        "syncs": len(reports),
        "syncs_under_load": under_load,
        "episodes_run": started,
        "migrated": st.migrated,
        "wall_s": wall,
        "failed_updates": sum(len(r.failed) for r in reports),
        "sync_p50_s": statistics.median(r.seconds for r in reports) if reports else float("nan"),
    }
    if verbose:
        print(
            f"info: kind={kind} in_flight={in_flight} replicas={replicas} episodes={episodes} "
            f"episodes_run={started} syncs={len(reports)} syncs_under_load={under_load} "
            f"mean_step_ms={step_ms:.1f} pause_target_ms={step_ms + 50:.1f} "
            f"step_fraction_during_sync={step_frac:.3f} "
            f"sync_p50_s={result['sync_p50_s']:.3f} migrated={st.migrated} failed_updates={result['failed_updates']} wall_s={wall:.1f}",
            flush=True,
        )
    return result


def format_line(r: dict[str, Any]) -> str:
    return (
        f"strategy={r['strategy']} policy={r['policy']} "
        f"episodes_restarted={r['episodes_restarted']} tokens_discarded={r['tokens_discarded']} "
        f"tokens_recomputed={r['tokens_recomputed']} pause_p50_ms={r['pause_p50_ms']:.1f} "
        f"pause_p99_ms={r['pause_p99_ms']:.1f} "
        f"busy_fraction_during_sync={r['busy_fraction_during_sync']:.3f} lost={r['lost']}"
    )


__all__ = ["format_line", "run_pause_bench"]
