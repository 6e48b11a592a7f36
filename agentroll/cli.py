"""Command line: ``agentroll bench | envs``.  Each subcommand maps to one function here;
errors from agentroll print one line that says what to do, and exit with status 2."""

from __future__ import annotations

import argparse
import logging
import sys

from agentroll.errors import AgentrollError


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentroll",
        description="Rollout engine for RL post-training of tool-using LLM agents.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks (one key=value result line each)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    ov = bsub.add_parser(
        "overhead", help="engine overhead per tool turn (mock backend, real token path)"
    )
    ov.add_argument("--episodes", type=int, default=2000)
    ov.add_argument("--turns", type=int, default=4, help="tool turns per episode")
    ov.add_argument("--concurrency", type=int, default=256)

    sub.add_parser("envs", help="list the built-in environments")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "bench" and args.bench == "overhead":
            from agentroll.bench import main_overhead

            for name in ("episodes", "turns", "concurrency"):
                if getattr(args, name) < 1:
                    raise SystemExit(f"--{name} must be >= 1")
            main_overhead(args.episodes, args.turns, args.concurrency)
        elif args.command == "envs":
            import pkgutil

            import agentroll.environments as builtin
            from agentroll.env import environment_class

            for mod in sorted(m.name for m in pkgutil.iter_modules(builtin.__path__)):
                cls = environment_class(mod)
                doc = (cls.__doc__ or "").strip().splitlines()
                print(f"{mod:16s} {doc[0] if doc else ''}")
    except AgentrollError as exc:
        print(f"agentroll: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
