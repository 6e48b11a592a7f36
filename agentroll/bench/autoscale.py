"""``agentroll bench autoscale``: a deliberately unbalanced separate-pools run, with and
without the autoscaler, alternating pair by pair.

The recipe gives the rollout two replicas and the trainer one thread on a model whose
training step is the bottleneck (hidden 512, 4 layers), so the rollout waits for the
trainer.  ``imbalance_end`` is ``|rollout_idle - trainer_idle|`` over the last quarter of
the measurement windows; the ratio line gives autoscale/fixed per pair (target <= 0.5).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentroll.bench.pairs import DEFAULT_PAIRS, check_pairs, paired_ratio

KEYS = (
    "steps_per_s",
    "rollout_idle",
    "trainer_idle",
    "imbalance_start",
    "imbalance_end",
    "replicas_end",
    "trainer_threads_end",
    "moves",
    "restarted",
    "lost",
)


def end_imbalance(windows: list[Any]) -> float:
    """Mean ``|rollout_idle - trainer_idle|`` over the last quarter of ``windows`` (at
    least two), the first window left out (it holds the start-up)."""
    ws = windows[1:] or windows
    tail = ws[-max(2, len(ws) // 4) :]
    return statistics.fmean(w.imbalance for w in tail) if tail else float("nan")


async def run_once(
    model: Path,
    autoscale: bool,
    *,
    steps: int,
    replicas: int,
    trainer_threads: int,
    cores: int,
    batch_groups: int,
    samples: int,
    seed: int,
) -> dict[str, Any]:
    """One run of ``steps`` training steps; returns its figures."""
    from agentroll.backends.torch import TorchBackend
    from agentroll.bench.placement import long_tail_loop
    from agentroll.fleet.backend import FleetBackend
    from agentroll.fleet.replica import LocalReplica
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.run.autoscale import AutoscaleConfig, Autoscaler, Capacity
    from agentroll.run.capacity import CapacityMover
    from agentroll.run.placement import PlacementConfig, run_placement

    trainer, train, env, config = long_tail_loop(
        model, seed=seed, batch_groups=batch_groups, samples=samples, max_tokens=96
    )

    def make(i: int) -> LocalReplica:
        return LocalReplica(TorchBackend(model, kv_cache_mb=64), name=f"replica-{i}")

    start = Capacity(replicas, trainer_threads)
    controller = (
        Autoscaler(AutoscaleConfig(cores=cores, max_replicas=max(replicas, cores)), start)
        if autoscale
        else None
    )
    fleet = FleetBackend([make(i) for i in range(replicas)])
    mover = CapacityMover(
        fleet, controller, make, lambda: trainer.exporter.full(), trainer_threads=trainer_threads
    )
    placement = PlacementConfig(mode="separate", max_staleness=16, window_steps=2)
    async with fleet, RolloutEngine(fleet, env, config) as engine:
        stats = await run_placement(
            engine,
            train,
            env.tasks(),
            steps=steps,
            batch_groups=batch_groups,
            config=placement,
            capacity=mover,
        )
        replicas_end = len(fleet.replicas)
    ws = stats.windows
    return {
        "mode": "separate_autoscale" if autoscale else "separate_fixed",
        "steps_per_s": stats.steps_per_s,
        "rollout_idle": stats.rollout_idle,
        "trainer_idle": stats.trainer_idle,
        "imbalance_start": ws[1].imbalance if len(ws) > 1 else float("nan"),
        "imbalance_end": end_imbalance(ws),
        "replicas_end": replicas_end,
        "trainer_threads_end": mover.trainer_threads,
        "moves": sum(not m.error for m in stats.moves),
        "restarted": stats.restarted + fleet.stats.episodes_restarted,
        "lost": stats.failed,
    }


async def run_autoscale_bench(
    *,
    steps: int = 20,
    pairs: int = DEFAULT_PAIRS,
    replicas: int = 2,
    trainer_threads: int = 1,
    cores: int = 2,
    batch_groups: int = 4,
    samples: int = 2,
    hidden: int = 512,
    layers: int = 4,
    seed: int = 0,
    verbose: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Fixed then autoscaled, ``pairs`` times; returns the per-mode medians and the ratio."""
    check_pairs(pairs)
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="agentroll-bench-autoscale-") as tmp:
        from agentroll.model.tiny import create_tiny

        model = create_tiny(Path(tmp) / "model", hidden=hidden, layers=layers)
        for i in range(pairs):
            for autoscale in (False, True):
                t0 = time.perf_counter()
                got = await run_once(
                    model,
                    autoscale,
                    steps=steps,
                    replicas=replicas,
                    trainer_threads=trainer_threads,
                    cores=cores,
                    batch_groups=batch_groups,
                    samples=samples,
                    seed=seed + i,
                )
                runs.setdefault(got["mode"], []).append(got)
                if verbose:
                    print(
                        f"pair {i + 1}/{pairs} {got['mode']}: {time.perf_counter() - t0:.1f} s "
                        f"imbalance_end={got['imbalance_end']:.2f} moves={got['moves']}",
                        flush=True,
                        file=sys.stderr,
                    )
    medians = [
        {"mode": name, **{k: statistics.median(r[k] for r in rs) for k in KEYS}}
        for name, rs in runs.items()
    ]
    fixed, auto = runs["separate_fixed"], runs["separate_autoscale"]
    cut = paired_ratio(
        [(a["imbalance_end"], f["imbalance_end"]) for a, f in zip(auto, fixed, strict=True)]
    )
    speed = paired_ratio(
        [(a["steps_per_s"], f["steps_per_s"]) for a, f in zip(auto, fixed, strict=True)]
    )
    ratios = {
        "imbalance_end_ratio": cut.ratio,
        "imbalance_end_ratio_min": cut.ratio_min,
        "imbalance_end_ratio_max": cut.ratio_max,
        "speedup": speed.ratio,
        "speedup_min": speed.ratio_min,
        "speedup_max": speed.ratio_max,
        "pairs": pairs,
    }
    return medians, ratios


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def format_lines(medians: list[dict[str, Any]], ratios: dict[str, Any]) -> list[str]:
    """One line per mode, then the ratio line (the result line)."""
    ints = {"replicas_end", "trainer_threads_end", "moves", "restarted", "lost"}
    lines = [
        f"mode={row['mode']} "
        + " ".join(f"{k}={int(row[k]) if k in ints else _fmt(row[k])}" for k in KEYS)
        for row in medians
    ]
    lines.append(" ".join(f"{k}={_fmt(v)}" for k, v in ratios.items()))
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--pairs", type=int, default=DEFAULT_PAIRS)
    parser.add_argument("--replicas", type=int, default=2, help="rollout replicas at start")
    parser.add_argument("--trainer-threads", type=int, default=1, help="trainer threads at start")
    parser.add_argument("--cores", type=int, default=2, help="threads the machine runs at once")
    parser.add_argument("--hidden", type=int, default=512, help="width of the made-up model")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench (progress on stderr), print a line per mode and the ratio."""
    medians, ratios = asyncio.run(
        run_autoscale_bench(
            steps=args.steps,
            pairs=args.pairs,
            replicas=args.replicas,
            trainer_threads=args.trainer_threads,
            cores=args.cores,
            hidden=args.hidden,
            layers=args.layers,
            seed=args.seed,
        )
    )
    for line in format_lines(medians, ratios):
        print(line)
    return 0


__all__ = ["add_arguments", "end_imbalance", "format_lines", "main", "run_autoscale_bench"]
