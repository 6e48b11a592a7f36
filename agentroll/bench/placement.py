"""``agentroll bench placement``: one RL loop three ways on this machine, in one run.

Separate pools (rollout and training at once), colocated waiting for the longest trajectory
of each phase, and colocated with partial rollouts (a switch parks the stragglers), on the
tiny model and a multi-turn environment whose episode lengths are long-tailed (one task in
eight takes ten turns, the others one).  The runs alternate (separate, wait, partial) pair
by pair; the ratios partial/wait of ``steps_per_s`` and ``tail_wait_s`` are per pair.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from agentroll.bench.pairs import DEFAULT_PAIRS, check_pairs, paired_ratio
from agentroll.testing import LONG_TAIL_STOP_IDS, LongTail
from agentroll.types import SamplingParams, Trajectory

MODES = (("separate", True), ("colocated", False), ("colocated", True))


def long_tail_loop(
    model: Path, *, seed: int, batch_groups: int, samples: int, max_tokens: int
) -> tuple[Any, Any, LongTail, Any]:
    """The pieces both placement benchmarks run: a GRPO trainer on ``model``, its step as a
    ``TrainFn`` (delta exports), ``LongTail`` and a rollout config of one batch in flight."""
    from agentroll.rollout.engine import RolloutConfig
    from agentroll.trainer.algorithm import GRPO
    from agentroll.trainer.grpo import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-5, seed=seed, export="delta"))

    def train(batch: list[Trajectory], base_version: int) -> Any:
        trainer.step(GRPO.collate(batch, pad_id=0))
        return trainer.export(base_version)

    config = RolloutConfig(
        concurrency=batch_groups * samples,
        samples_per_task=samples,
        # a turn ends on one of a twelfth of the ids (about 12 tokens, geometric), never on
        # the token budget (a turn cut by it ends its episode as truncated)
        sampling=SamplingParams(
            temperature=1.0,
            max_tokens=max_tokens,
            stop_token_ids=LONG_TAIL_STOP_IDS,
            ignore_eos=True,
        ),
        seed=seed,
        progress="off",
    )
    return trainer, train, LongTail(), config


async def run_mode(
    model: Path,
    mode: str,
    partial: bool,
    *,
    steps: int,
    batch_groups: int,
    samples: int,
    max_tokens: int,
    kv_cache_mb: int,
    sleep_level: int,
    seed: int,
) -> dict[str, Any]:
    """One run of ``steps`` training steps in one placement; returns its figures."""
    from agentroll.backends.torch import TorchBackend
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.run.placement import PlacementConfig, run_placement

    _, train, env, config = long_tail_loop(
        model, seed=seed, batch_groups=batch_groups, samples=samples, max_tokens=max_tokens
    )
    placement = PlacementConfig(
        mode=mode,  # type: ignore[arg-type]
        partial_rollouts=partial,
        sleep_level=sleep_level,
        max_staleness=16,
    )
    async with TorchBackend(model, kv_cache_mb=kv_cache_mb) as backend:
        kv_mb = backend.engine.runner.kv_bytes / 2**20
        weights_mb = backend.engine.runner.weight_bytes / 2**20
        async with RolloutEngine(backend, env, config) as engine:
            stats = await run_placement(
                engine, train, env.tasks(), steps=steps, batch_groups=batch_groups, config=placement
            )
    switches = stats.switches
    return {
        "mode": mode if mode == "separate" else f"colocated_{'partial' if partial else 'wait'}",
        "steps_per_s": stats.steps_per_s,
        "tokens_per_s": stats.tokens_per_s,
        "tail_wait_s": stats.tail_wait_s,
        "rollout_idle": stats.rollout_idle,
        "trainer_idle": stats.trainer_idle,
        "sleep_freed_mb": statistics.median(s.rss_freed_bytes for s in switches) / 2**20
        if switches
        else 0.0,
        "sleep_target_mb": kv_mb + (weights_mb if sleep_level == 2 else 0.0),
        "wake_ms": statistics.median(s.wake_ms for s in switches) if switches else 0.0,
        "restarted": stats.restarted,
        "lost": stats.failed,
        "dropped_stale": stats.dropped_stale,
    }


async def run_placement_bench(
    *,
    steps: int = 20,
    pairs: int = DEFAULT_PAIRS,
    batch_groups: int = 4,
    samples: int = 2,
    max_tokens: int = 96,
    kv_cache_mb: int = 64,
    sleep_level: int = 1,
    model: str | Path | None = None,
    seed: int = 0,
    verbose: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every mode ``pairs`` times, alternating; returns the per-mode medians and the ratios."""
    check_pairs(pairs)
    with tempfile.TemporaryDirectory(prefix="agentroll-bench-placement-") as tmp:
        if model is None:
            from agentroll.model.tiny import create_tiny

            model = create_tiny(Path(tmp) / "model")
        runs: dict[str, list[dict[str, Any]]] = {}
        for i in range(pairs):
            for mode, partial in MODES:
                t0 = time.perf_counter()
                got = await run_mode(
                    Path(model),
                    mode,
                    partial,
                    steps=steps,
                    batch_groups=batch_groups,
                    samples=samples,
                    max_tokens=max_tokens,
                    kv_cache_mb=kv_cache_mb,
                    sleep_level=sleep_level,
                    seed=seed + i,
                )
                runs.setdefault(got["mode"], []).append(got)
                if verbose:
                    print(
                        f"pair {i + 1}/{pairs} {got['mode']}: {time.perf_counter() - t0:.1f} s "
                        f"steps_per_s={got['steps_per_s']:.2f} tail_wait_s={got['tail_wait_s']:.2f}",
                        flush=True,
                        file=__import__("sys").stderr,
                    )
    medians = []
    for name, rs in runs.items():
        row: dict[str, Any] = {"mode": name}
        for key in rs[0]:
            if key != "mode":
                row[key] = statistics.median(r[key] for r in rs)
        medians.append(row)
    wait, partial_runs = runs["colocated_wait"], runs["colocated_partial"]
    speed = paired_ratio(
        [(p["steps_per_s"], w["steps_per_s"]) for p, w in zip(partial_runs, wait, strict=True)]
    )
    tail = paired_ratio(
        [(p["tail_wait_s"], w["tail_wait_s"]) for p, w in zip(partial_runs, wait, strict=True)]
    )
    ratios = {
        "speedup_partial_vs_wait": speed.ratio,
        "speedup_min": speed.ratio_min,
        "speedup_max": speed.ratio_max,
        "tail_cut": 1.0 - tail.ratio,
        "tail_cut_min": 1.0 - tail.ratio_max,
        "tail_cut_max": 1.0 - tail.ratio_min,
        "pairs": pairs,
    }
    return medians, ratios


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def format_lines(medians: list[dict[str, Any]], ratios: dict[str, Any]) -> list[str]:
    """One line per mode, then the ratio line (the result line)."""
    keys = [
        "steps_per_s",
        "tokens_per_s",
        "tail_wait_s",
        "rollout_idle",
        "trainer_idle",
        "sleep_freed_mb",
        "sleep_target_mb",
        "wake_ms",
        "restarted",
        "lost",
    ]
    lines = []
    for row in medians:
        ints = {"restarted", "lost"}
        lines.append(
            f"mode={row['mode']} "
            + " ".join(f"{k}={int(row[k]) if k in ints else _fmt(row[k])}" for k in keys)
        )
    lines.append(" ".join(f"{k}={_fmt(v)}" for k, v in ratios.items()))
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--pairs", type=int, default=DEFAULT_PAIRS)
    parser.add_argument("--batch-groups", type=int, default=4, help="groups per training batch")
    parser.add_argument("--samples", type=int, default=2, help="samples per task (group size)")
    parser.add_argument("--max-tokens", type=int, default=96, help="token budget of a turn")
    parser.add_argument("--kv-cache-mb", type=int, default=64)
    parser.add_argument("--sleep-level", type=int, default=1, choices=[1, 2])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench (progress on stderr), print a line per mode and the ratios."""
    medians, ratios = asyncio.run(
        run_placement_bench(
            steps=args.steps,
            pairs=args.pairs,
            batch_groups=args.batch_groups,
            samples=args.samples,
            max_tokens=args.max_tokens,
            kv_cache_mb=args.kv_cache_mb,
            sleep_level=args.sleep_level,
            model=args.model,
            seed=args.seed,
        )
    )
    for line in format_lines(medians, ratios):
        print(line)
    return 0


__all__ = ["add_arguments", "format_lines", "main", "run_placement_bench"]
