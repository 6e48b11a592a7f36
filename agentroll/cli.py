"""Command line: ``agentroll run | worker | gateway | serve-env | report | bench | validate | envs | model | sandbox``.

A thin dispatcher: each subcommand lives in ``agentroll.commands.<name>`` (imported only when
used) and returns the exit status; an ``AgentrollError`` prints one line that says what to do
and exits with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from agentroll.commands import LazyParser, load
from agentroll.errors import AgentrollError

# name -> (module, one-line help), in the order ``agentroll --help`` lists them
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "agentroll.commands.run",
        "run a recipe end to end (rollout worker + trainer)",
    ),
    "worker": (
        "agentroll.commands.worker",
        "rollout worker: with --recipe it serves the trajectory stream until stopped; "
        "with --env it runs the tasks into --out.  SIGTERM checkpoints in-flight episodes "
        "and a restart continues them",
    ),
    "gateway": (
        "agentroll.commands.gateway",
        "serve an OpenAI-compatible gateway for existing agents, plus the trajectory stream",
    ),
    "serve-env": (
        "agentroll.commands.serve_env",
        "serve an agentroll environment as an OpenEnv server (reset/step/state, MCP tools)",
    ),
    "report": (
        "agentroll.commands.report",
        "table, plots and tuning advice of a run's metric trace",
    ),
    "bench": (
        "agentroll.commands.bench",
        "benchmarks (one key=value result line each)",
    ),
    "validate": (
        "agentroll.commands.validate",
        "learning-semantics checks of a backend",
    ),
    "envs": (
        "agentroll.commands.envs",
        "list the built-in environments",
    ),
    "model": (
        "agentroll.commands.model",
        "model checkpoints",
    ),
    "sandbox": (
        "agentroll.commands.sandbox",
        "sandbox audit and docker sandbox housekeeping",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``agentroll`` parser; a subcommand's arguments are added when it is parsed."""
    parser = argparse.ArgumentParser(
        prog="agentroll",
        description="Rollout engine for RL post-training of tool-using LLM agents.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser)
    for name, (module, text) in COMMANDS.items():
        sub.add_parser(name, help=text, description=text, module=module)
    return parser


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if not verbose:  # httpx logs one INFO line per request (a stream client makes many)
        logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its status."""
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return load(COMMANDS[args.command][0]).main(args)
    except AgentrollError as exc:
        print(f"agentroll: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
