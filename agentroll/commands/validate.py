"""``agentroll validate``: learning-semantics checks of a backend, one line per check; with
``--recipe R.toml``, the checks the recipe's optimisations need by their risk class.

The exit status is 0 if every check passed, 1 if one failed; with ``--recipe``, 2 when
none failed but an optimisation has no check of its class yet (``unchecked``).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["torch", "vllm"], default="torch")
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    parser.add_argument("--device", default="cpu", help="torch device of the engine (cpu, cuda)")
    parser.add_argument(
        "--recipe", default=None, help="validate the optimisations this recipe turns on"
    )
    parser.add_argument(
        "--episodes", type=int, default=64, help="--recipe: episodes per side of a comparison"
    )
    parser.add_argument("--only", default=None, help="--recipe: this optimisation only")
    parser.add_argument(
        "--class",
        dest="risk",
        default=None,
        choices=["unit", "token_parity", "distribution", "end_to_end"],
        help="--recipe: the optimisations of this risk class only",
    )
    parser.add_argument(
        "--run-dir", default=None, help="--recipe: where validate/report.md goes (default: new)"
    )
    parser.add_argument(
        "--skip-warmup",
        action="store_true",
        help="--recipe: validate on the model before the recipe's warm-up",
    )


def main_recipe(args: argparse.Namespace) -> int:
    import sys
    import tempfile
    from pathlib import Path

    from agentroll.run.loop import prepare_model
    from agentroll.run.recipe import load_recipe
    from agentroll.validate.recipe import validate_recipe, write_report

    recipe = load_recipe(args.recipe)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="agentroll-validate-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    model = prepare_model(recipe, run_dir)
    if recipe.warmup.steps and not args.skip_warmup:
        import asyncio

        from agentroll.run.loop import demonstrations, warmup

        # the model RL starts from is the warmed-up one: validate that one
        print(f"warm-up: {recipe.warmup.steps} supervised steps, as the recipe", file=sys.stderr)
        model = warmup(recipe, model, run_dir, asyncio.run(demonstrations(recipe, model)))
    verdicts = validate_recipe(
        recipe,
        model,
        episodes=args.episodes,
        only=args.only,
        risk=args.risk,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    for v in verdicts:
        print(v.line(), flush=True)
    report = write_report(verdicts, run_dir / "validate", recipe.run.name)
    print(f"report: {report}", file=sys.stderr)
    if any(v.verdict == "fail" for v in verdicts):
        return 1
    return 2 if any(v.verdict == "unchecked" for v in verdicts) else 0


def main(args: argparse.Namespace) -> int:
    from agentroll.model.tiny import ensure_tiny_model

    if args.recipe is not None:
        return main_recipe(args)

    model = ensure_tiny_model(args.model)
    if args.backend == "vllm":
        import asyncio

        from agentroll.validate.vllm import run_vllm_checks

        results = asyncio.run(run_vllm_checks(model))
    else:
        from agentroll.validate import run_checks

        results = run_checks(model, device=args.device)
    for r in results:
        print(r.line(), flush=True)
    return 0 if all(r.passed for r in results) else 1
