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

from agentroll.errors import ConfigError, require
from agentroll.run.recipe import Recipe
from agentroll.types import Trajectory
from agentroll.validate.common import CheckResult
from agentroll.validate.registry import Optimisation, enabled

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate

VerdictName = Literal["pass", "fail", "unchecked"]

#: a KS statistic (the largest gap between the two CDFs) above this fails a distribution check
KS_TOLERANCE = 0.2
#: distribution tests need at least this many episodes per side to mean anything
MIN_EPISODES = 16
#: runs of a check whose update must land mid-generation, before it gives up
ATTEMPTS = 3


class Verdict(msgspec.Struct, kw_only=True):
    """One row of the validate table."""

    optimisation: str
    risk: str
    check: str
    figure: str
    verdict: VerdictName
    seconds: float = 0.0

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
    **engine: Any,
) -> list[Trajectory]:
    """``episodes`` episodes of the recipe's environment on one built-in engine with the
    recipe's settings and ``engine`` overrides (batch-invariant), on the model's weights or
    ``update`` applied to them, unchanged during the run; sorted by (task, sample) so two
    runs compare pair by pair."""
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.run.build import rollout_config

    env, tasks = _tasks(recipe, episodes)
    async with (
        _engine(recipe, model, **engine) as backend,
        RolloutEngine(backend, env, rollout_config(recipe)) as engine_,
    ):
        if update is not None:
            await engine_.sync(update)
        out = [t async for t in engine_.run(tasks)]
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
) -> tuple[list[Trajectory], int]:
    """As ``recipe_episodes`` (on a fleet of ``replicas`` engines when more than one), with
    one weight update (a seeded perturbation of a twentieth of the weights, about a training
    step's) synced in with ``policy`` and ``strategy`` once generations are under way
    (``after_tokens`` sampled by several of them), or the first episode ended; returns
    the episodes and how many sampled tokens attended to KV of the old weights
    (``kv_version < policy_version``)."""
    from agentroll.fleet.backend import FleetBackend
    from agentroll.fleet.replica import LocalReplica
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.run.build import rollout_config
    from agentroll.testing import SyntheticTrainer

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
    lagged = sum(
        int(((t.kv_version < t.policy_version) & t.loss_mask.astype(bool)).sum()) for t in out
    )
    return _ordered(out), lagged


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


def ks_compare(with_: list[Trajectory], without: list[Trajectory]) -> tuple[bool, str]:
    """Two-sample KS on sampled-token logprobs, response lengths and rewards: each statistic
    must stay within ``KS_TOLERANCE``; the figure gives statistic and p-value of each."""
    ks_2samp = require("scipy.stats", "validate").ks_2samp

    def series(ts: list[Trajectory]) -> dict[str, list[float]]:
        return {
            "logprob": [lp for t in ts for lp in _sampled(t)[1]],
            "length": [float(t.num_generated) for t in ts],
            "reward": [float(t.reward) for t in ts],
        }

    sa, sb = series(with_), series(without)
    ok = True
    parts = []
    for key in ("logprob", "length", "reward"):
        x, y = sa[key], sb[key]
        if len(set(x) | set(y)) <= 1:  # both constant and equal: no difference to test
            parts.append(f"{key}_ks=0.000")
            continue
        with warnings.catch_warnings():  # "exact calculation unsuccessful": asymptotic then
            warnings.simplefilter("ignore", RuntimeWarning)
            res = ks_2samp(x, y)
        stat, p = float(res.statistic), float(res.pvalue)
        ok = ok and stat <= KS_TOLERANCE
        parts.append(f"{key}_ks={stat:.3f} {key}_p={p:.3g}")
    return ok, " ".join(parts) + f" tolerance={KS_TOLERANCE}"


# -- checks -----------------------------------------------------------------------------------


def _from_result(r: CheckResult) -> tuple[bool, str]:
    figs = " ".join(f"{k}={v}" for k, v in r.figures.items())
    return r.passed, f"{r.name}: {figs}"


Check = Callable[[Recipe, Path, int], tuple[bool, str]]


def _episodes_pair(
    recipe: Recipe, model: Path, episodes: int, without: dict[str, Any]
) -> tuple[list[Trajectory], list[Trajectory]]:
    async def both() -> tuple[list[Trajectory], list[Trajectory]]:
        a = await recipe_episodes(recipe, model, episodes)
        b = await recipe_episodes(recipe, model, episodes, **without)
        return a, b

    return asyncio.run(both())


def _parity_without(**without: Any) -> Check:
    def check(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
        a, b = _episodes_pair(recipe, model, episodes, without)
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


def _distribution_without(**without: Any) -> Check:
    def check(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
        _enough(episodes)
        a, b = _episodes_pair(recipe, model, episodes, without)
        return ks_compare(a, b)

    return check


def _resume_policy(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
    """Keep-KV resume under new weights against recompute, both with one update landing
    mid-generation: the distributions of what they sample must agree."""
    _enough(episodes, recipe)

    async def both() -> tuple[tuple[list[Trajectory], int], tuple[list[Trajectory], int]]:
        keep = await synced_episodes(recipe, model, episodes, "keep")
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
    return ok, f"kv_lagged_tokens={lagged} {figure}"


def staleness_lag(recipe: Recipe) -> int:
    """Versions a trained trajectory may lag the trainer under the recipe: its staleness
    bound, or the sync interval's lag; 4 for an unbounded buffer (a typical lag)."""
    bound = recipe.buffer.max_staleness
    return max(1, recipe.sync.interval - 1, 4 if bound is None else bound)


def _staleness(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
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
    ok, figure = ks_compare(stale, fresh)
    return ok, f"lag={lag} max_weight_change={moved:.3g} {figure}"


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
) -> tuple[bool, str]:
    a = reward_curve(recipe, model, lag_with)
    b = reward_curve(without, model, lag_without)
    half = len(a) // 2
    end_a, end_b = sum(a[half:]) / len(a[half:]), sum(b[half:]) / len(b[half:])
    ok = abs(end_a - end_b) <= E2E_TOLERANCE
    return ok, (
        f"steps={len(a)} reward_start={a[0]:.3f}/{b[0]:.3f} reward_end={end_a:.3f}/{end_b:.3f} "
        f"(with/without) band={E2E_TOLERANCE}"
    )


def _async_off_policy(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
    """Training on batches ``staleness_lag`` versions old against on-policy batches."""
    lag = staleness_lag(recipe)
    ok, figure = _curves(recipe, model, lag, 0, recipe)
    return ok, f"lag={lag} {figure}"


def _importance_cap(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
    """The recipe's importance-weight cap against no cap, both on stale batches (on-policy
    tokens have weight 1: the cap does nothing there)."""
    lag = staleness_lag(recipe)
    uncapped = msgspec.structs.replace(
        recipe, trainer=msgspec.structs.replace(recipe.trainer, is_cap=1e6)
    )
    ok, figure = _curves(recipe, model, lag, lag, uncapped)
    return ok, f"is_cap={recipe.trainer.is_cap}/none lag={lag} {figure}"


def _rolling(recipe: Recipe, model: Path, episodes: int) -> tuple[bool, str]:
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
    ok, figure = ks_compare(mixed, at_once)
    return ok, f"replicas={n} versions={sorted(versions)} {figure}"


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
        "token_parity:prefix_cache": _parity_without(enable_prefix_caching=False),
        "token_parity:chunked_prefill": _parity_without(max_num_batched_tokens=1 << 16),
        "token_parity:reference": _existing(check_reference_parity),
        "token_parity:pause_resume": _existing(check_token_parity_pause),
        "token_parity:migrate": _existing(check_token_parity_migrate),
        "token_parity:checkpoint": _existing(check_episode_checkpoint_parity),
        "distribution:dtype": _distribution_without(dtype="float32"),
        "distribution:resume_policy": _resume_policy,
        "distribution:rolling": _rolling,
        "distribution:staleness": _staleness,
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
    passed, figure = check(recipe, model, episodes)
    return Verdict(
        optimisation=o.name,
        risk=o.risk,
        check=o.check,
        figure=figure,
        verdict="pass" if passed else "fail",
        seconds=time.perf_counter() - t0,
    )


def write_report(verdicts: list[Verdict], out_dir: Path, recipe_name: str) -> Path:
    """``out_dir/report.md``: the table (optimisation, class, check, figure, verdict)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        f"| {v.optimisation} | {v.risk} | `{v.check}` | {v.figure} | {v.verdict} |"
        for v in verdicts
    ]
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
        ]
    )
    path = out_dir / "report.md"
    path.write_text(text)
    return path


__all__ = [
    "KS_TOLERANCE",
    "MIN_EPISODES",
    "Verdict",
    "ks_compare",
    "recipe_episodes",
    "token_parity",
    "validate_recipe",
    "write_report",
]
