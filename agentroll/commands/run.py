"""``agentroll run RECIPE``: run a recipe end to end (rollout worker + trainer), then report.
``agentroll run --replay RUN_DIR``: run a recorded run again and say where it diverged.

The exit status is the report's (``agentroll.run.loop.run_recipe``), or the replay's (0:
the same training data step by step, 1: a divergence).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from agentroll.errors import ConfigError


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
    if args.replay is not None:
        if args.recipe is not None:
            raise ConfigError("give a RECIPE or --replay RUN_DIR, not both")
        return replay(args.replay, out_dir=args.run_dir)
    if args.recipe is None:
        raise ConfigError("give a RECIPE file (or --replay RUN_DIR to repeat a run)")
    from agentroll.run.loop import run_recipe

    return run_recipe(args.recipe, run_dir=args.run_dir)


def replay(run_dir: str | Path, *, out_dir: str | Path | None = None) -> int:
    """``agentroll run --replay RUN_DIR``: run the recorded recipe again into ``out_dir``
    (default: beside it), compare what each step trained on; 0 if the runs agree, 1 at the
    first divergence (printed, and written to ``replay.json``)."""
    import asyncio
    import sys

    from agentroll.run.loop import run_recipe_async
    from agentroll.run.recipe import load_recipe, package_versions
    from agentroll.run.replay import as_dict, first_divergence, read_log, version_changes

    src = Path(run_dir)
    if not (src / "recipe.toml").is_file():
        raise ConfigError(f"{src} holds no recipe.toml: pass the directory of a run")
    recorded = read_log(src)
    versions_path = src / "versions.json"
    recorded_versions = json.loads(versions_path.read_text()) if versions_path.is_file() else {}
    changes = version_changes(recorded_versions, package_versions())
    for change in changes:
        print(f"replay: version differs: {change}", file=sys.stderr)
    recipe = load_recipe(src / "recipe.toml")
    dest = (
        Path(out_dir) if out_dir else src.with_name(f"{src.name}-replay-{time.strftime('%H%M%S')}")
    )
    asyncio.run(run_recipe_async(recipe, src / "recipe.toml", run_dir=dest))
    found = first_divergence(recorded, read_log(dest))
    summary = {
        "recorded": str(src),
        "replayed": str(dest),
        "steps": len(recorded),
        "versions_changed": changes,
        "divergence": as_dict(found),
    }
    (dest / "replay.json").write_text(json.dumps(summary, indent=2) + "\n")
    if found is None:
        print(f"replay identical steps={len(recorded)} run_dir={dest}")
        return 0
    print(f"{found.line()} run_dir={dest}")
    return 1
