"""``agentroll run RECIPE``: run a recipe end to end (rollout worker + trainer), then report.

The exit status is the report's (``agentroll.run.loop.run_recipe``).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE", help="recipe TOML file")
    parser.add_argument(
        "--run-dir", default=None, help="run directory (default: under run.out_dir)"
    )


def main(args: argparse.Namespace) -> int:
    from agentroll.run.loop import run_recipe

    return run_recipe(args.recipe, run_dir=args.run_dir)
