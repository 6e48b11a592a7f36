"""``agentroll worker``: the rollout worker, with one of two sinks.

With ``--recipe`` it serves the recipe's rollouts over the trajectory stream until stopped;
with ``--env`` it runs the tasks into the ``--out`` file.  SIGTERM checkpoints the episodes
in flight and a restart continues them.  Prints one JSON or ``key=value`` summary line.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from agentroll.errors import ConfigError


@dataclass(frozen=True, slots=True)
class FileWorkerConfig:
    """The sink of ``agentroll worker`` without ``--recipe``: all three paths are needed."""

    env: str | None
    out: str | None
    checkpoint_dir: str | None

    def __post_init__(self) -> None:
        if self.env is None or self.out is None or self.checkpoint_dir is None:
            raise ConfigError(
                "worker needs --recipe, or --env, --out and --checkpoint-dir; "
                "pass a recipe to serve the stream, or all three to write a file"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default=None, help="recipe TOML: serve its rollouts over HTTP")
    parser.add_argument(
        "--port", type=int, default=None, help="stream port (default: the recipe's)"
    )
    parser.add_argument("--run-dir", default=None, help="metrics, spool and checkpoints (--recipe)")
    parser.add_argument("--ready-file", default=None, help="write {url, pid} here once serving")
    parser.add_argument("--env", default=None, help="environment name or module:Class")
    parser.add_argument("--backend", choices=["torch", "mock"], default="torch")
    parser.add_argument(
        "--model", default=None, help="torch checkpoint dir (default: the tiny model)"
    )
    parser.add_argument("--device", default="cpu", help="torch device of the engine (cpu, cuda)")
    parser.add_argument("--tasks", type=int, default=None, help="the first N tasks (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="rollout seed")
    parser.add_argument("--out", default=None, help="trajectories file: .jsonl or .msgpack")
    parser.add_argument("--checkpoint-dir", default=None, help="where in-flight episodes go")
    parser.add_argument(
        "--no-kv", action="store_true", help="checkpoint without KV (the restart recomputes it)"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per generation")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="exact continuation (slower engine)"
    )
    parser.add_argument("--mock-latency", type=float, default=0.0, help="seconds per mock reply")


def _serve(args: argparse.Namespace) -> int:
    from agentroll.run.service import main_service

    served = main_service(
        args.recipe,
        model=args.model,
        run_dir=args.run_dir,
        checkpoint_dir=args.checkpoint_dir,
        port=args.port,
        ready_file=args.ready_file,
    )
    print(json.dumps(served), flush=True)
    return 0


def _run_into_file(args: argparse.Namespace) -> int:
    from agentroll.run.worker import main_worker

    FileWorkerConfig(args.env, args.out, args.checkpoint_dir)  # ConfigError unless all three
    summary = main_worker(
        env=args.env,
        backend=args.backend,
        model=args.model,
        device=args.device,
        num_tasks=args.tasks,
        seed=args.seed,
        out=args.out,
        checkpoint_dir=args.checkpoint_dir,
        with_kv=not args.no_kv,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        batch_invariant=args.batch_invariant,
        mock_latency=args.mock_latency,
    )
    print(summary.line(), flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    return _serve(args) if args.recipe is not None else _run_into_file(args)
