"""``agentroll bench NAME``: run one benchmark of ``agentroll.bench.BENCHMARKS``.

The benchmark's module is imported only when it runs (or its ``--help`` is asked for).  With
``--record FILE`` the result line (the last ``key=value`` line on stdout) also becomes that
benchmark's row in the markdown table in FILE; a benchmark module with ``ROW_KEY`` gets a
row per line, named ``bench:<its ROW_KEY value>``, one with ``row_name(args)`` the row it names.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import sys
from pathlib import Path
from typing import TextIO

from agentroll.bench import BENCHMARKS
from agentroll.commands import LazyParser, load
from agentroll.errors import AgentrollError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(
        dest="bench", required=True, metavar="NAME", parser_class=LazyParser
    )
    for name, (module, text) in BENCHMARKS.items():
        bench = sub.add_parser(name, help=text, description=text, module=module)
        bench.add_argument(
            "--record",
            metavar="FILE",
            default=None,
            help="also write the result line as this benchmark's row of the markdown table "
            "in FILE (created if missing), e.g. benchmarks/RESULTS.md",
        )


class _Tee(io.TextIOBase):
    """Writes through to ``out`` and keeps a copy (the result line is read from it)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._copy = io.StringIO()

    def write(self, text: str) -> int:
        self._copy.write(text)
        return self._out.write(text)

    def flush(self) -> None:
        self._out.flush()

    def getvalue(self) -> str:
        return self._copy.getvalue()


def main(args: argparse.Namespace) -> int:
    module = load(BENCHMARKS[args.bench][0])
    if args.record is None:
        return module.main(args)
    from agentroll.bench.record import (
        ResultRow,
        command_line,
        record,
        result_line,
        result_lines,
        this_machine,
    )

    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        code = module.main(args)
    # a benchmark with ROW_KEY prints one line per subject: each is its own row
    key = getattr(module, "ROW_KEY", None)
    if key is not None:
        lines = {f"{args.bench}:{k}": v for k, v in result_lines(tee.getvalue(), key).items()}
    else:
        line = result_line(tee.getvalue())
        # a benchmark whose options pick what it measures (bench engine --shape) names its row
        name = module.row_name(args) if hasattr(module, "row_name") else args.bench
        lines = {name: line} if line is not None else {}
    if not lines:
        raise AgentrollError(
            f"bench {args.bench} printed no key=value result line; nothing was recorded in "
            f"{args.record}"
        )
    parser = argparse.ArgumentParser(add_help=False)
    module.add_arguments(parser)
    for name, line in lines.items():
        row = ResultRow(
            benchmark=name,
            command=command_line(f"agentroll bench {args.bench}", parser, args),
            result=line,
            date=datetime.datetime.now(datetime.UTC).date().isoformat(),
            machine=this_machine(),
        )
        record(Path(args.record), row)
        print(f"recorded {name} in {args.record}", file=sys.stderr)
    return code
