"""``agentroll bench pause``: weight syncs in the middle of a fleet's rollouts.

Calculator episodes on the tiny model over in-process (or Ray) replicas, with real delta
updates at seeded moments while the fleet generates: how long replicas stand paused, what
each resume policy throws away or recomputes, and what is lost.  No baseline and no ratio,
so nothing is paired; ``run_pause_bench`` describes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentroll.backends.base import ResumePolicy, SamplingParams
from agentroll.errors import ConfigError

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
    """Run the bench; return its figures (``format_line`` prints the result line)::

        strategy=S policy=P episodes_restarted=N tokens_discarded=N tokens_recomputed=N
        pause_p50_ms=F pause_p99_ms=F busy_fraction_during_sync=F lost=N

    ``syncs`` real delta updates (``SyntheticTrainer``) land at seeded random moments: when
    the fleet has streamed a random number of tokens, between 5% and 85% of the
    ``episodes`` episodes' tokens.  ``pause_*``: how long each replica stood paused per sync
    (stop at a token boundary -> resumed); ``busy_fraction_during_sync``: replica-time spent
    in forward passes while a sync was in progress, over all syncs; ``lost``: episodes that
    did not come back ``ok`` or ``truncated``.  Every sync must run while the fleet
    generates, so the run keeps admitting episodes (``episodes`` at a time) until the last
    sync is done: syncs take longer than a fast engine takes to finish the first
    ``episodes``, and a sync of an idle fleet would count as busy 0.  With ``verbose`` a
    line before the result gives the mean engine step, the reference for the pause target
    (one decode step + 50 ms), the episodes run and the syncs that found generations in
    flight (a warning says when one did not).  Replicas run with a prefill budget of
    ``prefill_budget`` tokens per step, which bounds every step, so a pause does not wait
    long for the step in flight even when ``recompute`` re-prefills every request."""
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


def _fleet(
    model_dir: Path,
    replicas: int,
    kind: str,
    prefill_budget: int,
    strategy: str,
    in_flight: str,
) -> tuple[Any, list[Any]]:
    """``(FleetBackend, its replicas)``: ``replicas`` engines in this process or Ray actors."""
    from agentroll.backends.torch import TorchBackend
    from agentroll.fleet import FleetBackend, LocalReplica

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
    return fleet, reps


async def _sync_at_triggers(
    fleet: Any, engine: Any, triggers: list[float], updates: list[Any], loaded: list[bool]
) -> list[Any]:
    """Sync whenever the fleet has streamed the next trigger's token count; appends to
    ``loaded`` whether generations were in flight when each sync started."""
    done = []

    def generating() -> bool:
        return any(fleet.calls_on(n) for n in fleet.replicas)

    for at, update in zip(triggers, updates, strict=True):
        while fleet.stats.tokens < at:  # noqa: ASYNC110 - polls a counter
            await asyncio.sleep(0.001)
        # at a moment when a generation is in flight (every episode may be in a tool call
        # at the trigger); not forever: a stalled fleet is reported
        deadline = time.perf_counter() + 10.0
        while not generating() and time.perf_counter() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        loaded.append(generating())
        done.append(await engine.sync(update, policy=engine.pauses.policy))
    return done


class _Admission:
    """The tasks the run hands the engine: ``episodes`` tasks, then more while syncs are
    still to come (at most ``_MAX_EPISODES_FACTOR`` times as many): every sync then runs
    while the fleet generates.  Without it a fast engine ends the episodes' generations
    before the later triggers, and those syncs time an idle fleet (busy 0)."""

    def __init__(self, pool: list[Any], episodes: int) -> None:
        self.pool, self.episodes = pool, episodes
        self.started = 0  # episodes handed to the engine

    def tasks(self, sync_task: asyncio.Task[Any]) -> Iterator[Any]:
        while self.started < self.episodes or (
            not sync_task.done() and self.started < _MAX_EPISODES_FACTOR * self.episodes
        ):
            self.started += 1
            yield self.pool[(self.started - 1) % len(self.pool)]


@dataclass
class _Observed:
    """What one run saw: the sync reports, the trajectories, the replicas' step counts and
    busy seconds, whether each sync found generations in flight, and the wall time."""

    reports: list[Any]
    trajs: list[Any]
    steps: list[int]
    busy: list[float]
    loaded: list[bool]
    started: int
    wall: float


async def _observe(
    fleet: Any,
    reps: list[Any],
    env: Any,
    cfg: Any,
    tokenizer: Any,
    trainer: Any,
    triggers: list[float],
    policy: ResumePolicy,
    episodes: int,
) -> _Observed:
    """Run the episodes through the fleet with a sync at each trigger."""
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.rollout.pause import fixed_policy

    admission = _Admission(list(env.tasks()), episodes)
    loaded: list[bool] = []
    trajs: list[Any] = []
    t_start = time.perf_counter()
    async with fleet:
        async with RolloutEngine(fleet, env, cfg, tokenizer=tokenizer) as engine:
            engine.pauses.policy = fixed_policy(policy)
            # The updates are made up front (the trainer is another process in real runs):
            # one made at its trigger would land well after it, when the engine may have
            # finished every episode (a run takes well under a second on the tiny model).
            updates = [await asyncio.to_thread(trainer.step) for _ in triggers]
            sync_task = asyncio.create_task(
                _sync_at_triggers(fleet, engine, triggers, updates, loaded)
            )
            async for traj in engine.run(admission.tasks(sync_task)):
                trajs.append(traj)
            reports = await sync_task
        steps = [await r.steps() for r in reps]
        busy = [await r.busy_seconds() for r in reps]
    wall = time.perf_counter() - t_start
    return _Observed(reports, trajs, steps, busy, loaded, admission.started, wall)


def _weighted(reports: list[Any], replicas: int, field: str) -> float:
    """``field`` of the sync reports, averaged over replica-time (nan without syncs)."""
    weight = sum(r.seconds * replicas for r in reports)
    if not weight:
        return float("nan")
    return sum(getattr(r, field) * r.seconds * replicas for r in reports) / weight


def _summary(
    seen: _Observed, fleet: Any, strategy: str, policy: ResumePolicy, replicas: int
) -> dict[str, Any]:
    reports = seen.reports
    pauses = [ms for r in reports for ms in r.pause_ms]
    st = fleet.stats
    return {
        "strategy": strategy,
        "policy": policy,
        "episodes_restarted": st.episodes_restarted,
        "tokens_discarded": st.tokens_discarded,
        "tokens_recomputed": st.tokens_recomputed,
        "pause_p50_ms": statistics.median(pauses) if pauses else float("nan"),
        "pause_p99_ms": _percentile(pauses, 0.99),
        "busy_fraction_during_sync": _weighted(reports, replicas, "busy_fraction"),
        "step_fraction_during_sync": _weighted(reports, replicas, "step_fraction"),
        "lost": seen.started - sum(1 for t in seen.trajs if t.status in ("ok", "truncated")),
        "mean_step_ms": 1e3 * sum(seen.busy) / max(1, sum(seen.steps)),
        "syncs": len(reports),
        "syncs_under_load": sum(seen.loaded),
        "episodes_run": seen.started,
        "migrated": st.migrated,
        "wall_s": seen.wall,
        "failed_updates": sum(len(r.failed) for r in reports),
        "sync_p50_s": statistics.median(r.seconds for r in reports) if reports else float("nan"),
    }


def _say(r: dict[str, Any], kind: str, in_flight: str, replicas: int, episodes: int) -> None:
    """The warning about idle syncs and the info line before the result line."""
    if r["syncs_under_load"] < r["syncs"]:
        print(
            f"warning: {r['syncs'] - r['syncs_under_load']} of {r['syncs']} syncs started "
            f"with no generation in flight (after {r['episodes_run']} episodes); their busy "
            "fraction is 0: use more --episodes or fewer --syncs",
            flush=True,
        )
    step_ms = r["mean_step_ms"]
    print(
        f"info: kind={kind} in_flight={in_flight} replicas={replicas} episodes={episodes} "
        f"episodes_run={r['episodes_run']} syncs={r['syncs']} "
        f"syncs_under_load={r['syncs_under_load']} "
        f"mean_step_ms={step_ms:.1f} pause_target_ms={step_ms + 50:.1f} "
        f"step_fraction_during_sync={r['step_fraction_during_sync']:.3f} "
        f"sync_p50_s={r['sync_p50_s']:.3f} migrated={r['migrated']} "
        f"failed_updates={r['failed_updates']} wall_s={r['wall_s']:.1f}",
        flush=True,
    )


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
    from agentroll.chat import ChatTokenizer
    from agentroll.env import load_environment
    from agentroll.model.tiny import ensure_tiny_model
    from agentroll.rollout.engine import RolloutConfig
    from agentroll.testing import SyntheticTrainer

    model_dir = ensure_tiny_model(model)
    if syncs >= episodes:
        raise ValueError("--syncs must be smaller than --episodes (syncs happen between finishes)")
    rng = random.Random(seed)
    total_tokens = episodes * max_tokens  # every generation runs to max_tokens (ignore_eos)
    triggers = sorted(rng.uniform(0.05, 0.85) * total_tokens for _ in range(syncs))
    fleet, reps = _fleet(model_dir, replicas, kind, prefill_budget, strategy, in_flight)
    cfg = RolloutConfig(
        concurrency=episodes,
        seed=seed,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True),
        progress="off",
    )
    seen = await _observe(
        fleet,
        reps,
        load_environment("calculator"),
        cfg,
        ChatTokenizer.from_pretrained(model_dir),
        SyntheticTrainer(model_dir, seed=seed),
        triggers,
        policy,
        episodes,
    )
    result = _summary(seen, fleet, strategy, policy, replicas)
    if verbose:
        _say(result, kind, in_flight, replicas, episodes)
    return result


def format_line(r: dict[str, Any]) -> str:
    return (
        f"strategy={r['strategy']} policy={r['policy']} "
        f"episodes_restarted={r['episodes_restarted']} tokens_discarded={r['tokens_discarded']} "
        f"tokens_recomputed={r['tokens_recomputed']} pause_p50_ms={r['pause_p50_ms']:.1f} "
        f"pause_p99_ms={r['pause_p99_ms']:.1f} "
        f"busy_fraction_during_sync={r['busy_fraction_during_sync']:.3f} lost={r['lost']}"
    )


# -- command line --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PauseBenchConfig:
    """The options of ``agentroll bench pause``: at least one replica, and every sync falls
    strictly inside the run (0 < syncs < episodes)."""

    replicas: int
    episodes: int
    syncs: int
    strategy: str
    policy: ResumePolicy
    model: str | None
    max_tokens: int
    seed: int
    kind: str
    in_flight: str
    prefill_budget: int

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.episodes < 2 or not 0 < self.syncs < self.episodes:
            raise ConfigError(
                f"need --replicas >= 1 and 0 < --syncs < --episodes (got --replicas "
                f"{self.replicas}, --syncs {self.syncs}, --episodes {self.episodes}); "
                "raise --episodes or lower --syncs"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--syncs", type=int, default=10)
    parser.add_argument(
        "--strategy", default="rolling", choices=["pause", "rolling", "drain", "background"]
    )
    parser.add_argument("--policy", default="keep", choices=["keep", "recompute", "restart"])
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per generation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    parser.add_argument(
        "--prefill-budget",
        type=int,
        default=512,
        help="tokens per engine step (bounds how long a pause waits for the step in flight)",
    )
    parser.add_argument(
        "--in-flight",
        default="migrate",
        choices=["migrate", "finish"],
        help="rolling: calls in flight on a group move at once (with their KV) or finish there "
        "first (moved after 5 s)",
    )
    parser.add_argument(
        "--kind",
        default="local",
        choices=["local", "ray"],
        help="replicas in this process, or Ray actors on a local loopback-only cluster",
    )


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench (progress on stderr) and print its result line."""
    config = PauseBenchConfig(
        replicas=args.replicas,
        episodes=args.episodes,
        syncs=args.syncs,
        strategy=args.strategy,
        policy=args.policy,
        model=args.model,
        max_tokens=args.max_tokens,
        seed=args.seed,
        kind=args.kind,
        in_flight=args.in_flight,
        prefill_budget=args.prefill_budget,
    )
    print(format_line(asyncio.run(run_pause_bench(**dataclasses.asdict(config)))))
    return 0


__all__ = ["PauseBenchConfig", "add_arguments", "format_line", "main", "run_pause_bench"]
