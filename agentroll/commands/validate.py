"""``agentroll validate``: learning-semantics checks of a backend, one line per check.

The exit status is 0 if every check passed, else 1.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["torch", "vllm"], default="torch")
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    parser.add_argument("--device", default="cpu", help="torch device of the engine (cpu, cuda)")


def main(args: argparse.Namespace) -> int:
    from agentroll.model.tiny import ensure_tiny_model

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
