"""``agentroll report RUN_DIR``: table, plots and tuning advice of a run's metric trace."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="run directory holding *.jsonl metric files"
    )


def main(args: argparse.Namespace) -> int:
    from agentroll.run.report import main_report

    return main_report(args.run_dir)
