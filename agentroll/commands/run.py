"""``agentroll run RECIPE``: run a recipe end to end (rollout worker + trainer), then report.
``agentroll run --replay RUN_DIR``: run a recorded run again and say where it diverged.

The exit status is the report's (``agentroll.run.loop.run_recipe``), or the replay's (0:
the same training data step by step, 1: a divergence).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE", nargs="?", help="recipe TOML file")
    parser.add_argument(
        "--run-dir", default=None, help="run directory (default: under run.out_dir)"
    )
    parser.add_argument(
        "--replay",
        metavar="RUN_DIR",
        default=None,
        help="run the run recorded in RUN_DIR again (its resolved recipe and seeds) and "
        "report the first step, trajectory and token where it diverged",
    )


def main(args: argparse.Namespace) -> int:
    from agentroll.errors import ConfigError

    if args.replay is not None:
        if args.recipe is not None:
            raise ConfigError("give a RECIPE or --replay RUN_DIR, not both")
        from agentroll.run.replay import replay

        return replay(args.replay, out_dir=args.run_dir)
    if args.recipe is None:
        raise ConfigError("give a RECIPE file (or --replay RUN_DIR to repeat a run)")
    from agentroll.run.loop import run_recipe

    return run_recipe(args.recipe, run_dir=args.run_dir)
