"""``agentroll validate --recipe R.toml``: the evidence each optimisation a recipe turns on
needs, by its risk class (``agentroll.validate.registry``), on the recipe's own model.

Token parity: the recipe's episodes with and without the optimisation, token for token and
logprob for logprob (weights unchanged, batch-invariant numerics on both sides).
Distribution: the episodes with and without, two-sample Kolmogorov-Smirnov tests on the
sampled tokens' logprobs, response lengths and rewards.  Unit: a bit-exact round trip.
Invariant: a verdict is ``pass`` or ``fail`` only when its check ran; an optimisation whose
check is not built yet says ``unchecked`` and the command exits non-zero for it.
"""

from __future__ import annotations

import asyncio
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np

from agentroll.errors import ConfigError, require
from agentroll.run.recipe import Recipe
from agentroll.types import Trajectory
from agentroll.validate.common import CheckResult
from agentroll.validate.registry import Optimisation, enabled

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate

VerdictName = Literal["pass", "fail", "unchecked"]

#: a KS statistic (the largest gap between the two CDFs) above this, at a p-value below
#: ``ALPHA``, fails a distribution check: a gap that large and that unlikely by chance (at 64
#: episodes a side the same distribution gives gaps of 0.2 one time in ten)
KS_TOLERANCE = 0.2
ALPHA = 0.01
#: kept-KV tokens whose importance ratio leaves the trainer's clip band: at most this share
MAX_CLIPPED = 0.2
#: distribution tests need at least this many episodes per side to mean anything
MIN_EPISODES = 16
#: runs of a check whose update must land mid-generation, before it gives up
ATTEMPTS = 3


class Evidence(msgspec.Struct, kw_only=True):
    """What a check compared, for the report's plots: two samples of ``name`` (``hist``) or
    two curves over steps (``curve``), with and without the optimisation."""

    kind: Literal["hist", "curve"]
    name: str
    with_: list[float]
    without: list[float]


class Verdict(msgspec.Struct, kw_only=True):
    """One row of the validate table."""

    optimisation: str
    risk: str
    check: str
    figure: str
    verdict: VerdictName
    seconds: float = 0.0
    evidence: list[Evidence] = []

    def line(self) -> str:
        return (
            f"optimisation={self.optimisation} class={self.risk} check={self.check} "
            f"verdict={self.verdict} {self.figure}"
        ).rstrip()


# -- running the recipe's episodes ----------------------------------------------------------


def _engine(recipe: Recipe, model: Path, **engine: Any) -> Any:
    """A built-in engine with the recipe's ``[backend]`` settings, batch-invariant, and
    ``engine`` overrides."""
    from agentroll.backends.torch import TorchBackend

    b = recipe.backend
    settings: dict[str, Any] = {
        "dtype": b.dtype,
        "kv_cache_mb": b.kv_cache_mb,
        "max_num_seqs": b.max_num_seqs,
        "max_num_batched_tokens": b.prefill_budget,
        "share_group_prefill": b.share_group_prefill,
        "batch_invariant": True,
        **engine,
    }
    return TorchBackend(str(model), **settings)


def _tasks(recipe: Recipe, episodes: int) -> tuple[Any, list[Any]]:
    from agentroll.run.build import build_environment

    env = build_environment(recipe)
    n = recipe.rollout.samples_per_task
    return env, list(env.tasks())[: max(1, math.ceil(episodes / n))]


def _ordered(out: list[Trajectory]) -> list[Trajectory]:
    return sorted(out, key=lambda t: (t.task_id, t.sample_index))


async def recipe_episodes(
    recipe: Recipe,
    model: Path,
    episodes: int,
    *,
    update: WeightUpdate | None = None,
    rollout: dict[str, Any] | None = None,
    tool_cache: dict[str, Any] | None = None,
    engine_stats: dict[str, Any] | None = None,
    **engine: Any,
) -> list[Trajectory]:
    """``episodes`` episodes of the recipe's environment on one built-in engine with the
    recipe's settings and ``engine`` overrides (batch-invariant), on the model's weights or
    ``update`` applied to them, unchanged during the run; sorted by (task, sample) so two
    runs compare pair by pair.  ``rollout``: overrides of the ``RolloutConfig``;
    ``tool_cache``: filled with the run's tool-cache figures when it has a cache;
    ``engine_stats``: with the engine's (``shared_tokens``: prompt tokens group forks did
    not compute, ``prompt_tokens``: prompt tokens of all requests)."""
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.run.build import rollout_config

    env, tasks = _tasks(recipe, episodes)
    config = msgspec.structs.replace(rollout_config(recipe), **(rollout or {}))
    async with (
        _engine(recipe, model, **engine) as backend,
        RolloutEngine(backend, env, config) as engine_,
    ):
        if update is not None:
            await engine_.sync(update)
        out = [t async for t in engine_.run(tasks)]
        if tool_cache is not None and engine_.tool_cache is not None:
            tool_cache.update(engine_.tool_cache.stats())
        if engine_stats is not None:
            sched = backend.engine.scheduler
            engine_stats["shared_tokens"] = sched.num_shared_tokens
            engine_stats["prompt_tokens"] = sched.num_prompt_tokens
    return _ordered(out)


async def synced_episodes(
    recipe: Recipe,
    model: Path,
    episodes: int,
    policy: str,
    *,
    replicas: int = 1,
    strategy: str | None = None,
    after_tokens: int = 2,
    start: WeightUpdate | None = None,
    update: WeightUpdate | None = None,
    ratios: list[float] | None = None,
) -> tuple[list[Trajectory], int]:
    """As ``recipe_episodes`` (on a fleet of ``replicas`` engines when more than one, on
    the model's weights or ``start`` applied to them), with one weight update (``update``,
    by default a seeded perturbation of a twentieth of the weights, about a training
    step's) synced in with ``policy`` and ``strategy`` once generations are under way
    (``after_tokens`` sampled by several of them), or the first episode ended; returns
    the episodes and how many sampled tokens attended to KV of the old weights
    (``kv_version < policy_version``).  ``ratios`` (one engine only): filled with the log
    importance ratio of each such token, its logprob under the new weights rescored from a
    fresh prefill minus the logprob it was sampled with."""
    from agentroll.fleet.backend import FleetBackend
    from agentroll.fleet.replica import LocalReplica
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.run.build import rollout_config
    from agentroll.testing import SyntheticTrainer

    if update is None:
        update = SyntheticTrainer(model, fraction=0.05, seed=1).step()
    env, tasks = _tasks(recipe, episodes)
    engines = [_engine(recipe, model) for _ in range(replicas)]
    backend: Any = engines[0]
    if replicas > 1:
        backend = FleetBackend(
            [LocalReplica(e, name=f"replica-{i}") for i, e in enumerate(engines)],
            strategy=strategy or "pause",  # type: ignore[arg-type]
        )
    async with backend, RolloutEngine(backend, env, rollout_config(recipe)) as engine:
        if start is not None:
            await engine.sync(start)
        delivered = asyncio.Event()

        async def collect() -> list[Trajectory]:
            out = []
            async for t in engine.run(tasks):
                out.append(t)
                delivered.set()
            return out

        running = asyncio.create_task(collect())
        want = max(1, min(4, recipe.rollout.concurrency // 4))

        def ready() -> bool:
            # generations under way (a trained model's turns are short: between them the
            # episodes run tools and nothing is in flight); read while the engines step
            going = sum(n >= after_tokens for e in engines for n in e.inflight().values())
            return going >= want

        # the engines count on their own threads: nothing to wait on but the counts.  At the
        # latest the first finished episode triggers it: with more episodes than slots,
        # some are still to start, so the update always lands before the end
        while not ready() and not delivered.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.0005)
        if not running.done():
            await engine.sync(update, policy=policy, strategy=strategy)  # type: ignore[arg-type]
        out = await running
        if ratios is not None and replicas == 1:
            ratios.extend(await _lagged_log_ratios(engines[0], out))
    lagged = sum(
        int(((t.kv_version < t.policy_version) & t.loss_mask.astype(bool)).sum()) for t in out
    )
    return _ordered(out), lagged


async def _lagged_log_ratios(backend: Any, trajectories: list[Trajectory]) -> list[float]:
    """``log pi_new(token) - logprob sampled`` of every sampled token that attended to KV
    of older weights, ``pi_new`` from the backend's current weights (a fresh prefill)."""
    out: list[float] = []
    for t in trajectories:
        lagged = (t.kv_version < t.policy_version) & t.loss_mask.astype(bool)
        if not lagged.any():
            continue
        fresh = await backend.score(t.token_ids.tolist())  # logprobs of tokens[1:]
        for pos in np.flatnonzero(lagged):
            out.append(float(fresh[pos - 1]) - float(t.logprobs[pos]))
    return out


def ratio_figure(log_ratios: list[float], clip_eps: float) -> tuple[bool, str]:
    """The kept-KV tokens' importance ratios: median, 5th and 95th percentiles, and the
    share outside the trainer's clip band ``[1 - clip_eps, 1 + clip_eps]`` (a token out
    there gives PPO no gradient: keep-KV wasted it); more than ``MAX_CLIPPED`` fails."""
    r = np.exp(np.asarray(log_ratios, dtype=np.float64))
    clipped = float(np.mean((r < 1 - clip_eps) | (r > 1 + clip_eps))) if len(r) else 0.0
    q05, q50, q95 = (float(np.quantile(r, q)) for q in (0.05, 0.5, 0.95)) if len(r) else (1.0,) * 3
    figure = (
        f"kv_ratio_median={q50:.4f} kv_ratio_p05={q05:.4f} kv_ratio_p95={q95:.4f} "
        f"kv_ratio_clipped={clipped:.3f} clip_eps={clip_eps} max_clipped={MAX_CLIPPED}"
    )
    return clipped <= MAX_CLIPPED, figure


def _sampled(t: Trajectory) -> tuple[list[int], list[float]]:
    mask = t.loss_mask.astype(bool)
    return t.token_ids[mask].tolist(), t.logprobs[mask].tolist()


def token_parity(a: list[Trajectory], b: list[Trajectory]) -> tuple[bool, str]:
    """Whether the two runs sampled the same tokens with the same logprobs, and the figure."""
    pairs = list(zip(a, b, strict=False))
    differ = 0
    first = ""
    max_lp = 0.0
    for x, y in pairs:
        (ids_x, lx), (ids_y, ly) = _sampled(x), _sampled(y)
        if ids_x != ids_y:
            differ += 1
            if not first:
                at = next(
                    (i for i, (p, q) in enumerate(zip(ids_x, ids_y, strict=False)) if p != q), None
                )
                at = min(len(ids_x), len(ids_y)) if at is None else at
                first = f" first_diff={x.task_id}/{x.sample_index}@{at}"
            continue
        max_lp = max([max_lp, *(abs(p - q) for p, q in zip(lx, ly, strict=True))])
    same = differ == 0 and len(a) == len(b) and max_lp == 0.0
    return same, (f"episodes={len(pairs)} differ={differ} max_abs_logprob_diff={max_lp:.3g}{first}")


def _series(ts: list[Trajectory]) -> dict[str, list[float]]:
    return {
        "logprob": [lp for t in ts for lp in _sampled(t)[1]],
        "length": [float(t.num_generated) for t in ts],
        "reward": [float(t.reward) for t in ts],
        "tool_calls": [float(sum(len(turn.tool_calls) for turn in t.turns)) for t in ts],
    }


def _effect_size(x: list[float], y: list[float]) -> float:
    """Cohen's d: the difference of the means over the pooled standard deviation (0 when
    both samples are constant)."""
    mx, my = sum(x) / len(x), sum(y) / len(y)
    vx = sum((v - mx) ** 2 for v in x) / max(1, len(x) - 1)
    vy = sum((v - my) ** 2 for v in y) / max(1, len(y) - 1)
    pooled = math.sqrt(((len(x) - 1) * vx + (len(y) - 1) * vy) / max(1, len(x) + len(y) - 2))
    return 0.0 if pooled == 0 else (mx - my) / pooled


def ks_compare(with_: list[Trajectory], without: list[Trajectory]) -> tuple[bool, str]:
    """Two-sample KS on sampled-token logprobs, response lengths, rewards and tool calls
    per episode: a statistic beyond ``KS_TOLERANCE`` with a p-value below ``ALPHA`` fails;
    the figure gives the statistic, p-value and effect size (Cohen's d) of each."""
    return ks_series(_series(with_), _series(without))


def ks_series(sa: dict[str, list[float]], sb: dict[str, list[float]]) -> tuple[bool, str]:
    """``ks_compare`` on named samples: ``sa[k]`` against ``sb[k]`` for each key."""
    ks_2samp = require("scipy.stats", "validate").ks_2samp
    ok = True
    parts = []
    for key in sa:
        x, y = sa[key], sb[key]
        if not x or not y:
            ok = False
            parts.append(f"{key}: one side has no samples")
            continue
        if len(set(x) | set(y)) <= 1:  # both constant and equal: no difference to test
            parts.append(f"{key}_ks=0.000")
            continue
        with warnings.catch_warnings():  # "exact calculation unsuccessful": asymptotic then
            warnings.simplefilter("ignore", RuntimeWarning)
            res = ks_2samp(x, y)
        stat, p = float(res.statistic), float(res.pvalue)
        ok = ok and not (stat > KS_TOLERANCE and p < ALPHA)
        parts.append(f"{key}_ks={stat:.3f} {key}_p={p:.3g} {key}_d={_effect_size(x, y):.3f}")
    return ok, " ".join(parts) + f" tolerance={KS_TOLERANCE} alpha={ALPHA}"


def compared(
    figure: str, with_: list[Trajectory], without: list[Trajectory]
) -> tuple[bool, str, list[Evidence]]:
    """A distribution check's result: ``ks_compare`` after the check's own ``figure``,
    with the histograms."""
    ok, tests = ks_compare(with_, without)
    return ok, f"{figure} {tests}", histograms(with_, without)


def histograms(with_: list[Trajectory], without: list[Trajectory]) -> list[Evidence]:
    """The samples ``ks_compare`` tests, as the report's histograms."""
    return series_histograms(_series(with_), _series(without))


def series_histograms(sa: dict[str, list[float]], sb: dict[str, list[float]]) -> list[Evidence]:
    """Named samples (``ks_series``'s input) as the report's histograms."""
    return [Evidence(kind="hist", name=k, with_=sa[k], without=sb[k]) for k in sa]


def advantage_series(ts: list[Trajectory]) -> dict[str, list[float]]:
    """The GRPO advantage and the reward of each trajectory (whole groups): what early
    group cut-off must not shift."""
    from agentroll.trainer.algorithm import grpo_advantages

    return {
        "advantage": [float(a) for a in grpo_advantages(ts)],
        "reward": [float(t.reward) for t in ts],
    }


# -- checks -----------------------------------------------------------------------------------


def _from_result(r: CheckResult) -> tuple[bool, str]:
    figs = " ".join(f"{k}={v}" for k, v in r.figures.items())
    return r.passed, f"{r.name}: {figs}"


#: a check returns (passed, figure) or (passed, figure, the evidence the report plots)
CheckOutput = tuple[bool, str] | tuple[bool, str, list[Evidence]]
Check = Callable[[Recipe, Path, int], CheckOutput]


def _episodes_pair(
    recipe: Recipe, model: Path, episodes: int, with_: dict[str, Any], without: dict[str, Any]
) -> tuple[list[Trajectory], list[Trajectory]]:
    async def both() -> tuple[list[Trajectory], list[Trajectory]]:
        a = await recipe_episodes(recipe, model, episodes, **with_)
        b = await recipe_episodes(recipe, model, episodes, **without)
        return a, b

    return asyncio.run(both())


def parity_check(
    *, with_: dict[str, Any] | None = None, without: dict[str, Any] | None = None
) -> Check:
    """A token-parity check: the recipe's episodes with the engine settings ``with_`` (the
    recipe's own when empty) against ``without``, token for token."""

    def check(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
        a, b = _episodes_pair(recipe, model, episodes, with_ or {}, without or {})
        return token_parity(a, b)

    return check


def _enough(episodes: int, recipe: Recipe | None = None) -> None:
    if episodes < MIN_EPISODES:
        raise ConfigError(
            f"--episodes {episodes} is too few for a distribution test: use at least "
            f"{MIN_EPISODES} (64 or more for a test with power)"
        )
    if recipe is not None and episodes <= recipe.rollout.concurrency:
        raise ConfigError(
            f"--episodes {episodes}: use more than rollout.concurrency "
            f"({recipe.rollout.concurrency}), so the update lands while episodes remain"
        )


def distribution_check(
    *, with_: dict[str, Any] | None = None, without: dict[str, Any] | None = None
) -> Check:
    """A distribution check: the recipe's episodes with the engine settings ``with_``
    against ``without``, two-sample tests (``ks_compare``)."""

    def check(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
        _enough(episodes)
        a, b = _episodes_pair(recipe, model, episodes, with_ or {}, without or {})
        return (*ks_compare(a, b), histograms(a, b))

    return check


def _resume_policy(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """Keep-KV resume under new weights against recompute, both with one update landing
    mid-generation: the distributions of what they sample must agree."""
    _enough(episodes, recipe)

    ratios: list[float] = []

    async def both() -> tuple[tuple[list[Trajectory], int], tuple[list[Trajectory], int]]:
        ratios.clear()
        keep = await synced_episodes(recipe, model, episodes, "keep", ratios=ratios)
        recompute = await synced_episodes(recipe, model, episodes, "recompute")
        return keep, recompute

    for _ in range(ATTEMPTS):  # the moment of the update is timing: try it again
        (keep, lagged), (recompute, _) = asyncio.run(both())
        if lagged:
            break
    if lagged == 0:
        return (
            False,
            "kv_lagged_tokens=0: the update landed between generations; use more --episodes",
        )
    ok, figure = ks_compare(keep, recompute)
    evidence = histograms(keep, recompute)
    if recipe.sampling.temperature == 1.0:  # rescoring gives plain-softmax logprobs
        ratio_ok, ratio = ratio_figure(ratios, recipe.trainer.clip_eps)
        ok = ok and ratio_ok
        figure = f"{ratio} {figure}"
        evidence.append(
            Evidence(kind="hist", name="kv_log_ratio", with_=ratios, without=[0.0] * len(ratios))
        )
    return ok, f"kv_lagged_tokens={lagged} {figure}", evidence


def staleness_lag(recipe: Recipe) -> int:
    """Versions a trained trajectory may lag the trainer under the recipe: its staleness
    bound, or the sync interval's lag; 4 for an unbounded buffer (a typical lag)."""
    bound = recipe.buffer.max_staleness
    return max(1, recipe.sync.interval - 1, 4 if bound is None else bound)


def _staleness(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """Episodes of the weights ``staleness_lag`` training steps old (the recipe's trainer
    on the recipe's own episodes) against episodes of the trained weights: how far apart
    the samples a stale batch holds are from the on-policy ones."""
    from agentroll.run.loop import build_trainer

    _enough(episodes)
    lag = staleness_lag(recipe)
    trainer, algorithm = build_trainer(recipe, model)

    async def both() -> tuple[list[Trajectory], list[Trajectory], float]:
        stale = await recipe_episodes(recipe, model, episodes)
        size = recipe.trainer.batch_size
        moved = 0.0
        for step in range(lag):
            start = (step * size) % max(1, len(stale))
            batch = (stale * (1 + size // max(1, len(stale))))[start : start + size]
            before = {n: p.detach().clone() for n, p in trainer.params.items()}
            await asyncio.to_thread(trainer.step, algorithm.collate(batch, pad_id=0))
            moved = max(
                moved,
                max(float((p.detach() - before[n]).abs().max()) for n, p in trainer.params.items()),
            )
        fresh = await recipe_episodes(recipe, model, episodes, update=trainer.export(0))
        return stale, fresh, moved

    stale, fresh, moved = asyncio.run(both())
    if moved == 0.0:
        return False, (
            f"lag={lag} max_weight_change=0: the recipe's rewards gave the trainer nothing to "
            "learn on this model (validate with its warmed-up or trained checkpoint)"
        )
    return compared(f"lag={lag} max_weight_change={moved:.3g}", stale, fresh)


#: training steps of each side of an end-to-end comparison
E2E_STEPS = 8
#: mean rewards of the last half of the steps may differ by this much (absolute)
E2E_TOLERANCE = 0.15


def reward_curve(recipe: Recipe, model: Path, lag: int, steps: int = E2E_STEPS) -> list[float]:
    """A short synchronous training run of the recipe's trainer on the recipe's episodes
    (``trainer.batch_size`` a step), each batch sampled by the weights ``lag`` steps older
    than the trainer's; returns the mean reward of each step's batch."""
    from agentroll.run.loop import build_trainer

    trainer, algorithm = build_trainer(recipe, model)

    async def run() -> list[float]:
        history: list[WeightUpdate | None] = [None]  # the weights after each step, full
        rewards = []
        for step in range(steps):
            weights = history[max(0, step - lag)]
            batch = await recipe_episodes(recipe, model, recipe.trainer.batch_size, update=weights)
            rewards.append(sum(t.reward for t in batch) / max(1, len(batch)))
            await asyncio.to_thread(trainer.step, algorithm.collate(batch, pad_id=0))
            history.append(trainer.export(-1))  # no replica is at -1: a full update
        return rewards

    return asyncio.run(run())


def _curves(
    recipe: Recipe, model: Path, lag_with: int, lag_without: int, without: Recipe
) -> tuple[bool, str, list[Evidence]]:
    a = reward_curve(recipe, model, lag_with)
    b = reward_curve(without, model, lag_without)
    return _compare_curves(a, b)


def _compare_curves(a: list[float], b: list[float]) -> tuple[bool, str, list[Evidence]]:
    """The mean rewards of the curves' last halves must differ by at most the band."""
    half = len(a) // 2
    end_a, end_b = sum(a[half:]) / len(a[half:]), sum(b[half:]) / len(b[half:])
    ok = abs(end_a - end_b) <= E2E_TOLERANCE
    figure = (
        f"steps={len(a)} reward_start={a[0]:.3f}/{b[0]:.3f} reward_end={end_a:.3f}/{end_b:.3f} "
        f"(with/without) band={E2E_TOLERANCE}"
    )
    return ok, figure, [Evidence(kind="curve", name="reward", with_=a, without=b)]


def _async_off_policy(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """Training on batches ``staleness_lag`` versions old against on-policy batches."""
    lag = staleness_lag(recipe)
    ok, figure, curves = _curves(recipe, model, lag, 0, recipe)
    return ok, f"lag={lag} {figure}", curves


def _importance_cap(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """The recipe's importance-weight cap against no cap, both on stale batches (on-policy
    tokens have weight 1: the cap does nothing there)."""
    lag = staleness_lag(recipe)
    uncapped = msgspec.structs.replace(
        recipe, trainer=msgspec.structs.replace(recipe.trainer, is_cap=1e6)
    )
    ok, figure, curves = _curves(recipe, model, lag, lag, uncapped)
    return ok, f"is_cap={recipe.trainer.is_cap}/none lag={lag} {figure}", curves


def _rolling(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """The recipe's rolling (or background) update over its replicas, episodes running on
    mixed versions, against all replicas paused and updated at once."""
    _enough(episodes, recipe)
    n = recipe.backend.replicas

    async def both() -> tuple[tuple[list[Trajectory], int], tuple[list[Trajectory], int]]:
        policy = "keep" if recipe.sync.policy == "staleness" else recipe.sync.policy
        mixed = await synced_episodes(
            recipe, model, episodes, policy, replicas=n, strategy=recipe.sync.strategy
        )
        at_once = await synced_episodes(
            recipe, model, episodes, policy, replicas=n, strategy="pause"
        )
        return mixed, at_once

    for _ in range(ATTEMPTS):  # the moment of the update is timing: try it again
        (mixed, _), (at_once, _) = asyncio.run(both())
        versions = {int(v) for t in mixed for v in t.policy_version[t.loss_mask.astype(bool)]}
        if len(versions) >= 2:
            break
    if len(versions) < 2:
        return False, f"versions={sorted(versions)}: the update landed after the episodes"
    return compared(f"replicas={n} versions={sorted(versions)}", mixed, at_once)


#: trainer steps of a scaled-down consumption run (``consumed_episodes``)
CONSUMED_STEPS = 4


def scaled_consumption(recipe: Recipe, episodes: int) -> tuple[int, int]:
    """(trainer batch, rollout concurrency) of a scaled-down run of ``episodes`` episodes:
    the batch takes a ``CONSUMED_STEPS``-th of them (whole groups), the concurrency keeps
    the recipe's ratio to the batch, which is what sets how stale episodes get."""
    n = recipe.rollout.samples_per_task
    size = max(n, min(recipe.trainer.batch_size, episodes // CONSUMED_STEPS) // n * n)
    ratio = recipe.rollout.concurrency / recipe.trainer.batch_size
    return size, max(1, round(size * ratio))


async def consumed_episodes(
    recipe: Recipe, model: Path, episodes: int, *, admission: bool
) -> tuple[list[Trajectory], list[Trajectory]]:
    """The recipe's episodes, at the batch and concurrency of ``scaled_consumption``,
    consumed by a stand-in trainer a batch a step, each step a weight update synced with
    the recipe's policy (a thousandth of the weights perturbed: versions move, samples
    barely do); new groups start under the recipe's admission control when ``admission``.
    Returns (all, kept): kept are those within the recipe's staleness bound when consumed,
    in the order the trainer took them."""
    from agentroll.rollout.admission import AdmissionController
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.run.build import rollout_config
    from agentroll.testing import SyntheticTrainer

    bound = recipe.buffer.max_staleness
    size, concurrency = scaled_consumption(recipe, episodes)
    n = recipe.rollout.samples_per_task
    controller = AdmissionController(max_staleness=bound, batch_size=size, group_size=n)
    trainer = SyntheticTrainer(model, fraction=0.001, seed=2)
    env, tasks = _tasks(recipe, episodes)
    version = consumed = admitted = 0
    every: list[Trajectory] = []
    kept: list[Trajectory] = []
    async with (
        _engine(recipe, model) as backend,
        RolloutEngine(
            backend, env, msgspec.structs.replace(rollout_config(recipe), concurrency=concurrency)
        ) as engine,
    ):

        async def admit(k: int) -> None:
            nonlocal admitted
            await controller.wait(
                policy_version=lambda: int(backend.policy_version),
                trainer_version=lambda: version,
                outstanding=lambda: admitted - consumed,
            )
            admitted += k

        batch: list[Trajectory] = []

        def consume(ts: list[Trajectory]) -> None:
            nonlocal consumed
            for t in ts:
                sampled = t.policy_version[t.loss_mask.astype(bool)]
                oldest = int(sampled.min()) if len(sampled) else version
                if bound is None or version - oldest <= bound:
                    kept.append(t)
            consumed += len(ts)

        async for t in engine.run(tasks, admit=admit if admission else None):
            every.append(t)
            controller.observe_episode(t.finished_at - t.started_at)
            batch.append(t)
            if len(batch) == size:
                consume(batch)
                batch = []
                update = await asyncio.to_thread(trainer.step)
                version += 1
                controller.observe_trainer_version(version)
                await engine.sync(update, policy=recipe.sync.policy)  # type: ignore[arg-type]
        consume(batch)
    return every, kept


def _admission(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """What a trainer consumes under the recipe's admission control and staleness bound
    (the episodes within the bound) against everything sampled without admission control:
    admission must not bias what the trainer sees (dropping stale episodes favours short
    ones; admission exists to keep them from going stale)."""
    _enough(episodes, recipe)

    async def both() -> tuple[tuple[list[Trajectory], list[Trajectory]], ...]:
        with_ = await consumed_episodes(recipe, model, episodes, admission=True)
        without = await consumed_episodes(recipe, model, episodes, admission=False)
        return with_, without

    (every_w, kept_w), (every_o, kept_o) = asyncio.run(both())
    ok, figure = ks_compare(kept_w, every_o)
    size, concurrency = scaled_consumption(recipe, episodes)
    figure = (
        f"batch={size} concurrency={concurrency} max_staleness={recipe.buffer.max_staleness} "
        f"dropped={len(every_w) - len(kept_w)}/{len(every_o) - len(kept_o)} (with/without) "
        f"kept_vs_all: {figure}"
    )
    return ok, figure, histograms(kept_w, every_o)


def _group_prefill(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
    """The recipe's episodes with group prefill sharing against without, token for token;
    a run where no group's samples met in a prefill checked nothing and fails."""
    stats: dict[str, Any] = {}

    async def both() -> tuple[list[Trajectory], list[Trajectory]]:
        a = await recipe_episodes(
            recipe, model, episodes, engine_stats=stats, share_group_prefill=True
        )
        b = await recipe_episodes(recipe, model, episodes, share_group_prefill=False)
        return a, b

    with_, without = asyncio.run(both())
    ok, figure = token_parity(with_, without)
    shared = f"shared_tokens={stats['shared_tokens']}/{stats['prompt_tokens']}"
    if not stats["shared_tokens"]:
        return False, f"{shared}: no group's samples met in one prefill, nothing was shared"
    return ok, f"{shared} {figure}"


def _prewarm(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
    """The recipe's episodes with their sandboxes pre-warmed against opened by each
    episode, token for token (a sandbox started earlier must be the same sandbox)."""

    async def both() -> tuple[list[Trajectory], list[Trajectory]]:
        on, off = {"prewarm_sandboxes": True}, {"prewarm_sandboxes": False}
        a = await recipe_episodes(recipe, model, episodes, rollout=on)
        return a, await recipe_episodes(recipe, model, episodes, rollout=off)

    return token_parity(*asyncio.run(both()))


def _tool_cache(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """The recipe's episodes with the result cache of pure tools against without: the
    distributions must agree, and no tool declared pure may have returned two results for
    one key (found by the cache's re-executions); with no hit the cache did nothing here."""
    _enough(episodes)
    stats: dict[str, Any] = {}

    async def both() -> tuple[list[Trajectory], list[Trajectory]]:
        on = {"tool_cache": True}
        a = await recipe_episodes(recipe, model, episodes, rollout=on, tool_cache=stats)
        b = await recipe_episodes(recipe, model, episodes, rollout={"tool_cache": False})
        return a, b

    with_, without = asyncio.run(both())
    counts = (
        f"hits={stats.get('hits', 0)} misses={stats.get('misses', 0)} "
        f"verified={stats.get('verified', 0)}"
    )
    if stats.get("impure"):
        return False, (
            f"{counts} impure={','.join(stats['impure'])}: a tool declared pure returned a "
            "different result for the same arguments and files; the cache stopped serving it "
            "(drop pure=True from it, or make its result a function of its key)"
        )
    if not stats.get("hits"):
        return False, (
            f"{counts}: no call of a pure tool repeated a key in {episodes} episodes, so the "
            "check saw nothing cached; use more --episodes or the recipe's trained model"
        )
    return compared(counts, with_, without)


def _group_cutoff(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """The recipe's groups with early cut-off against without: the trainer's advantages
    (GRPO, per group) and the rewards must keep their distribution (cutting a group whose
    stragglers would have scored otherwise turns its advantages to zero)."""
    _enough(episodes)
    if recipe.rollout.samples_per_task < 2:
        raise ConfigError("early group cut-off needs rollout.samples_per_task >= 2")

    async def both() -> tuple[list[Trajectory], list[Trajectory]]:
        a = await recipe_episodes(recipe, model, episodes)
        b = await recipe_episodes(recipe, model, episodes, rollout={"group_cutoff": 0.0})
        return a, b

    with_, without = asyncio.run(both())
    cut = sum(t.status == "cut" for t in with_)

    sa, sb = advantage_series(with_), advantage_series(without)
    ok, figure = ks_series(sa, sb)
    return (
        ok,
        f"group_cutoff={recipe.rollout.group_cutoff} cut={cut}/{len(with_)} {figure}",
        series_histograms(sa, sb),
    )


async def colocated_run(
    recipe: Recipe, model: Path, steps: int, *, partial: bool
) -> tuple[list[list[Trajectory]], int]:
    """The recipe's colocated loop (``agentroll.run.placement``) on one built-in engine
    with the recipe's trainer for ``steps`` steps, partial rollouts on or off; returns the
    batches trained (in order) and how many episodes were parked across switches."""
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.run.build import rollout_config
    from agentroll.run.loop import build_trainer
    from agentroll.run.placement import PlacementConfig, run_placement

    trainer, algorithm = build_trainer(recipe, model)
    env, tasks = _tasks(recipe, recipe.trainer.batch_size * steps)
    batches: list[list[Trajectory]] = []

    def train(batch: list[Trajectory], base: int) -> WeightUpdate:
        batches.append(list(batch))
        trainer.step(algorithm.collate(batch, pad_id=0))
        return trainer.export(base)

    p = recipe.placement
    config = PlacementConfig(
        mode="colocated",
        partial_rollouts=partial,
        sleep_level=p.sleep_level,
        wake_timeout=p.wake_timeout,
    )
    async with (
        _engine(recipe, model) as backend,
        RolloutEngine(backend, env, rollout_config(recipe)) as engine,
    ):
        stats = await run_placement(
            engine,
            train,
            tasks,
            steps=steps,
            batch_groups=recipe.trainer.batch_size // recipe.rollout.samples_per_task,
            config=config,
        )
    return batches, sum(s.parked for s in stats.switches)


def _partial_rollouts(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """Colocated training with partial rollouts (stragglers parked across a switch finish
    under the next weights) against waiting for every episode of a phase: what the trainer
    is handed must keep its distribution."""
    _enough(episodes)
    steps = max(2, math.ceil(episodes / recipe.trainer.batch_size))

    async def both() -> tuple[tuple[list[list[Trajectory]], int], ...]:
        a = await colocated_run(recipe, model, steps, partial=True)
        b = await colocated_run(recipe, model, steps, partial=False)
        return a, b

    for _ in range(ATTEMPTS):  # whether a switch finds an episode running is timing
        (with_, parked), (without, _) = asyncio.run(both())
        if parked:
            break
    a = [t for batch in with_ for t in batch]
    b = [t for batch in without for t in batch]
    if parked == 0:
        return False, (
            f"steps={steps} parked=0: no episode was still running at a switch, so nothing "
            "finished under newer weights; use more --episodes or longer generations"
        )
    return compared(f"steps={steps} parked={parked}", a, b)


def _colocated(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """The recipe's colocated training (sleep, wake on each update, its partial-rollouts
    setting) against synchronous training on fresh batches, from the same weights."""
    batches, parked = asyncio.run(
        colocated_run(recipe, model, E2E_STEPS, partial=recipe.placement.partial_rollouts)
    )
    a = [sum(t.reward for t in b) / max(1, len(b)) for b in batches]
    ok, figure, curves = _compare_curves(a, reward_curve(recipe, model, 0))
    return ok, f"parked={parked} {figure}", curves


def _autoscale(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """The recipe's in-process separate run with its autoscaler against the same run with
    capacity fixed, from the same weights: the rewards and lengths of what each step
    trained on (``trained.jsonl``) must keep their distribution; a run whose autoscaler
    moved nothing checked nothing and fails."""
    import tempfile

    from agentroll.run.loop import train_in_process
    from agentroll.run.replay import read_log

    _enough(episodes)
    steps = max(4, math.ceil(episodes / recipe.trainer.batch_size))
    run = msgspec.structs.replace(recipe.run, steps=steps)

    def series(log: list[dict[str, Any]]) -> dict[str, list[float]]:
        ts = [t for step in log for t in step["trajectories"]]
        return {
            "reward": [float(t["reward"]) for t in ts],
            "length": [float(len(t["tokens"])) for t in ts],
        }

    async def one(autoscale: bool, out: Path) -> dict[str, Any]:
        placement = msgspec.structs.replace(recipe.placement, autoscale=autoscale)
        r = msgspec.structs.replace(recipe, run=run, placement=placement)
        return await train_in_process(r, model_dir=model, run_dir=out, progress="off")

    with tempfile.TemporaryDirectory(prefix="agentroll-validate-") as tmp:
        a, b = Path(tmp, "autoscale"), Path(tmp, "fixed")
        a.mkdir()
        b.mkdir()
        moved = asyncio.run(one(True, a)).get("moves", 0)
        asyncio.run(one(False, b))
        sa, sb = series(read_log(a)), series(read_log(b))
    if not moved:
        return False, (
            f"steps={steps} moves=0: the autoscaler moved no capacity, so nothing was "
            "checked; use more --episodes or a recipe whose sides are unbalanced"
        )
    ok, figure = ks_series(sa, sb)
    return ok, f"steps={steps} moves={moved} {figure}", series_histograms(sa, sb)


def kv_lag_curve(recipe: Recipe, model: Path, steps: int = E2E_STEPS) -> tuple[list[float], int]:
    """As ``reward_curve``, but each step's batch starts on the previous step's weights and
    the trainer's current weights are synced in mid-generation under the ``keep`` policy,
    so a share of its tokens attended to KV of the older weights; returns the rewards and
    how many sampled tokens were kv-lagged in all."""
    from agentroll.run.loop import build_trainer

    trainer, algorithm = build_trainer(recipe, model)

    async def run() -> tuple[list[float], int]:
        history: list[WeightUpdate | None] = [None]
        rewards, lagged = [], 0
        size = recipe.trainer.batch_size
        for step in range(steps):
            if step == 0:
                batch = await recipe_episodes(recipe, model, size)
            else:
                batch, n = await synced_episodes(
                    recipe, model, size, "keep", start=history[step - 1], update=history[step]
                )
                lagged += n
            rewards.append(sum(t.reward for t in batch) / max(1, len(batch)))
            await asyncio.to_thread(trainer.step, algorithm.collate(batch, pad_id=0))
            history.append(trainer.export(-1))
        return rewards, lagged

    return asyncio.run(run())


def _kv_lag(recipe: Recipe, model: Path, episodes: int) -> CheckOutput:
    """The recipe's treatment of kv-lagged tokens against none (every token weighted 1),
    both on batches whose update landed mid-generation under ``keep``."""
    untreated = msgspec.structs.replace(
        recipe,
        trainer=msgspec.structs.replace(recipe.trainer, kv_lag="weight", kv_lag_weight=1.0),
    )
    a, lag_a = kv_lag_curve(recipe, model)
    b, _ = kv_lag_curve(untreated, model)
    if lag_a == 0:
        return False, "kv_lagged_tokens=0: no update landed mid-generation; nothing was treated"
    ok, figure, curves = _compare_curves(a, b)
    return ok, f"kv_lag={recipe.trainer.kv_lag}/none kv_lagged_tokens={lag_a} {figure}", curves


def _existing(fn: Callable[[Path], Any]) -> Check:
    def check(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
        got = fn(model)
        if asyncio.iscoroutine(got):
            got = asyncio.run(got)
        return _from_result(got)

    return check


def check_delta_roundtrip(model: Path, updates: int = 3) -> CheckResult:
    """Delta updates of a changing model applied to an engine: after each, the digest the
    engine recomputes from its live bytes equals the trainer's."""
    from agentroll.backends.torch import TorchBackend
    from agentroll.testing import SyntheticTrainer
    from agentroll.weights.update import model_digest, state_checksums

    trainer = SyntheticTrainer(model)

    async def run() -> tuple[int, int, int]:
        equal = payload = 0
        async with TorchBackend(model) as backend:
            for _ in range(updates):
                update = trainer.step()
                payload += update.payload_bytes
                await backend.pause()
                await backend.apply(update)
                await backend.resume()
                live = backend.engine.weight_store().verify()
                equal += live == model_digest(state_checksums(trainer.state))
            return equal, payload, backend.policy_version

    equal, payload, version = asyncio.run(run())
    return CheckResult(
        "delta_roundtrip",
        equal == updates and version == updates,
        {"updates": updates, "digest_equal": f"{equal}/{updates}", "payload_bytes": payload},
    )


def _checks() -> dict[str, Check]:
    from agentroll.validate.checkpoint import check_episode_checkpoint_parity
    from agentroll.validate.layout import check_layout_roundtrip
    from agentroll.validate.parity import (
        check_reference_parity,
        check_token_parity_migrate,
        check_token_parity_pause,
    )

    return {
        "unit:delta_roundtrip": _existing(check_delta_roundtrip),
        "unit:layout_roundtrip": _existing(check_layout_roundtrip),
        "token_parity:prefix_cache": parity_check(without={"enable_prefix_caching": False}),
        "token_parity:chunked_prefill": parity_check(without={"max_num_batched_tokens": 1 << 16}),
        "token_parity:group_prefill": _group_prefill,
        "token_parity:prewarm": _prewarm,
        "token_parity:reference": _existing(check_reference_parity),
        "token_parity:pause_resume": _existing(check_token_parity_pause),
        "token_parity:migrate": _existing(check_token_parity_migrate),
        "token_parity:checkpoint": _existing(check_episode_checkpoint_parity),
        "distribution:dtype": distribution_check(without={"dtype": "float32"}),
        "distribution:resume_policy": _resume_policy,
        "distribution:rolling": _rolling,
        "distribution:staleness": _staleness,
        "distribution:admission": _admission,
        "distribution:tool_cache": _tool_cache,
        "distribution:group_cutoff": _group_cutoff,
        "distribution:partial_rollouts": _partial_rollouts,
        "distribution:autoscale": _autoscale,
        "end_to_end:colocated": _colocated,
        "end_to_end:kv_lag": _kv_lag,
        "end_to_end:async_off_policy": _async_off_policy,
        "end_to_end:importance_cap": _importance_cap,
    }


def validate_recipe(
    recipe: Recipe,
    model: Path,
    *,
    episodes: int = 64,
    only: str | None = None,
    risk: str | None = None,
    progress: Callable[[str], None] | None = None,
    extra: dict[str, Check] | None = None,
) -> list[Verdict]:
    """A verdict for each optimisation ``recipe`` turns on (``only``/``risk`` select);
    ``extra`` adds or replaces checks by name (tests use it for broken optimisations)."""
    if episodes < 1:
        raise ConfigError("--episodes must be at least 1")
    checks = {**_checks(), **(extra or {})}
    out: list[Verdict] = []
    for o in enabled(recipe, only=only, risk=risk):
        out.append(_run_one(o, checks.get(o.check), recipe, model, episodes, progress))
    return out


def _run_one(
    o: Optimisation,
    check: Check | None,
    recipe: Recipe,
    model: Path,
    episodes: int,
    progress: Callable[[str], None] | None,
) -> Verdict:
    if progress is not None:
        progress(f"validating {o.name} ({o.risk}: {o.check})")
    if check is None:
        return Verdict(
            optimisation=o.name,
            risk=o.risk,
            check=o.check,
            figure="no check of this class is built for it yet",
            verdict="unchecked",
        )
    t0 = time.perf_counter()
    got = check(recipe, model, episodes)
    return Verdict(
        optimisation=o.name,
        risk=o.risk,
        check=o.check,
        figure=got[1],
        verdict="pass" if got[0] else "fail",
        seconds=time.perf_counter() - t0,
        evidence=list(got[2]) if len(got) > 2 else [],
    )


def write_plots(verdict: Verdict, out_dir: Path) -> Path | None:
    """``out_dir/<optimisation>.png``: a histogram of each sample the check compared (with
    against without, as densities) and each curve over steps; None when it has none."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not verdict.evidence:
        return None
    n = len(verdict.evidence)
    fig = Figure(figsize=(4 * n, 3.2))
    FigureCanvasAgg(fig)
    for i, ev in enumerate(verdict.evidence):
        ax = fig.add_subplot(1, n, i + 1)
        if ev.kind == "curve":
            ax.plot(range(len(ev.with_)), ev.with_, "o-", label="with")
            ax.plot(range(len(ev.without)), ev.without, "s--", label="without")
            ax.set_xlabel("training step")
            ax.set_ylabel(f"mean {ev.name}")
        else:
            both = ev.with_ + ev.without
            lo, hi = (min(both), max(both)) if both else (0.0, 1.0)
            bins = 30 if hi > lo else 1
            span = (lo, hi if hi > lo else lo + 1)
            ax.hist(ev.with_, bins=bins, range=span, density=True, alpha=0.5, label="with")
            ax.hist(
                ev.without, bins=bins, range=span, density=True, histtype="step", label="without"
            )
            ax.set_xlabel(ev.name)
        ax.legend(fontsize=7)
    fig.suptitle(f"{verdict.optimisation} ({verdict.check}): {verdict.verdict}", fontsize=9)
    fig.tight_layout()
    path = out_dir / f"{verdict.optimisation}.png"
    tmp = out_dir / f".{verdict.optimisation}.png.tmp"
    fig.savefig(tmp, format="png", dpi=90)
    tmp.replace(path)
    return path


def write_report(verdicts: list[Verdict], out_dir: Path, recipe_name: str) -> Path:
    """``out_dir/report.md``: the table (optimisation, class, check, figure, verdict), then
    the plots of each check that compared samples or curves (``write_plots``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        f"| {v.optimisation} | {v.risk} | `{v.check}` | {v.figure} | {v.verdict} |"
        for v in verdicts
    ]
    plots = []
    for v in verdicts:
        png = write_plots(v, out_dir)
        if png is not None:
            plots += [f"### {v.optimisation}", "", f"![{v.optimisation}]({png.name})", ""]
    counts = {k: sum(v.verdict == k for v in verdicts) for k in ("pass", "fail", "unchecked")}
    text = "\n".join(
        [
            f"# validate: {recipe_name}",
            "",
            f"{counts['pass']} passed, {counts['fail']} failed, {counts['unchecked']} unchecked.",
            "",
            "| optimisation | class | check | figure | verdict |",
            "|---|---|---|---|---|",
            *rows,
            "",
            *plots,
        ]
    )
    path = out_dir / "report.md"
    path.write_text(text)
    return path


__all__ = [
    "ALPHA",
    "KS_TOLERANCE",
    "MIN_EPISODES",
    "Evidence",
    "Verdict",
    "advantage_series",
    "compared",
    "distribution_check",
    "histograms",
    "ks_compare",
    "ks_series",
    "parity_check",
    "recipe_episodes",
    "series_histograms",
    "token_parity",
    "validate_recipe",
    "write_plots",
    "write_report",
]
