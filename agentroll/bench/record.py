"""``agentroll bench NAME --record FILE``: one current row per benchmark in a markdown table.

The table has the columns ``benchmark | command | result | date | machine``; recording a
benchmark replaces its row (or appends one) and leaves every other line of the file as it
was.  Everything but ``record`` and ``this_machine`` is pure, driven by plain strings.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agentroll._fs import atomic_file

COLUMNS = ("benchmark", "command", "result", "date", "machine")

HEADER = (
    "# Benchmark results\n"
    "\n"
    "One current row per benchmark, written by `agentroll bench NAME --record FILE`.\n"
)

_PAIR = r"[A-Za-z_][\w.]*=\S+"
_RESULT_LINE = re.compile(rf"{_PAIR}(?: +{_PAIR})*")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


@dataclass(frozen=True, slots=True)
class ResultRow:
    """One row of the results table."""

    benchmark: str
    command: str
    result: str
    date: str
    machine: str

    def markdown(self) -> str:
        """The row as a markdown table line (command and result as code)."""
        cells = (self.benchmark, f"`{self.command}`", f"`{self.result}`", self.date, self.machine)
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def result_line(stdout: str) -> str | None:
    """The last line of ``stdout`` that is only ``key=value`` pairs, or None."""
    for line in reversed(stdout.splitlines()):
        if _RESULT_LINE.fullmatch(line.strip()):
            return line.strip()
    return None


def result_lines(stdout: str, key: str) -> dict[str, str]:
    """Every ``key=value``-only line of ``stdout`` that starts with ``key=``, by its value
    (the last line of each value wins): one row each for a benchmark that prints one
    line per subject (``bench appopt``: one per optimisation)."""
    out: dict[str, str] = {}
    for line in stdout.splitlines():
        line = line.strip()
        if _RESULT_LINE.fullmatch(line) and line.startswith(f"{key}="):
            out[line.split()[0].partition("=")[2]] = line
    return out


def _cells(line: str) -> list[str] | None:
    """The cells of a markdown table line, or None if the line is not one."""
    line = line.strip()
    if not (line.startswith("|") and line.endswith("|") and len(line) > 1):
        return None
    return [cell.strip() for cell in _CELL_SPLIT.split(line[1:-1])]


def _table_rows(lines: list[str]) -> tuple[int, int] | None:
    """``(first, end)``: the row lines of the results table (after its header and separator
    line), or None if ``lines`` hold no table with ``COLUMNS``."""
    for i, line in enumerate(lines[:-1]):
        cells = _cells(line)
        if cells is not None and tuple(c.lower() for c in cells) == COLUMNS:
            end = i + 2
            while end < len(lines) and _cells(lines[end]) is not None:
                end += 1
            return i + 2, end
    return None


def upsert(text: str, row: ResultRow) -> str:
    """``text`` (a markdown file, possibly empty) with ``row`` replacing the row of the same
    benchmark in the results table, or appended to it; a missing table is added at the end,
    and an empty text gets ``HEADER`` first."""
    lines = text.splitlines()
    span = _table_rows(lines)
    if span is None:
        head = "| " + " | ".join(COLUMNS) + " |"
        rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
        prefix = lines if lines else HEADER.splitlines()
        while prefix and not prefix[-1].strip():
            prefix = prefix[:-1]
        return "\n".join([*prefix, "", head, rule, row.markdown()]) + "\n"
    first, end = span
    for i in range(first, end):
        cells = _cells(lines[i])
        if cells and cells[0] == row.benchmark:
            lines[i] = row.markdown()
            break
    else:
        lines.insert(end, row.markdown())
    return "\n".join(lines) + "\n"


def describe_machine(arch: str, cpus: int | None, gpus: Sequence[str], cpu_model: str = "") -> str:
    """A short machine description, e.g. ``x86_64 (AMD EPYC), 2 CPUs, no GPU``: the CPU's
    model tells apart hosts whose figures differ (cores, vector units, memory)."""
    cpu = f"{cpus} CPU{'s' if cpus != 1 else ''}" if cpus else "? CPUs"
    head = f"{arch} ({cpu_model})" if cpu_model else arch
    if not gpus:
        return f"{head}, {cpu}, no GPU"
    names = sorted(set(gpus))
    label = f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"
    return f"{head}, {cpu}, {label} ({', '.join(names)})"


def cpu_model(cpuinfo: str) -> str:
    """The first ``model name`` of a ``/proc/cpuinfo`` text, blanks squeezed; "" if none.
    A "|" (the table's cell separator) becomes "/"."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return " ".join(value.split()).replace("|", "/")
    return ""


def this_machine() -> str:
    """``describe_machine`` of this host; GPUs are asked of torch only if a benchmark already
    imported it (recording never imports torch)."""
    gpus: list[str] = []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        model = cpu_model(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:  # not Linux
        model = ""
    return describe_machine(platform.machine() or "?", os.cpu_count(), gpus, model)


def command_line(prefix: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``prefix`` plus the options of ``parser`` whose value in ``args`` is not the default,
    in the parser's order: the command that reruns the same measurement."""
    words = [prefix]
    for action in parser._actions:
        if action.dest == argparse.SUPPRESS or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if not action.option_strings:
            words.append(shlex.quote(str(value)))
        elif value != action.default:
            flag = max(action.option_strings, key=len)
            if action.nargs == 0:  # store_true and its kin
                words.append(flag)
            elif isinstance(value, list):
                words.extend(f"{flag} {shlex.quote(str(v))}" for v in value)
            else:
                words.append(f"{flag} {shlex.quote(str(value))}")
    return " ".join(words)


def record(path: Path, row: ResultRow) -> None:
    """Upsert ``row`` into the table in ``path`` (created with ``HEADER`` if missing); the
    file is replaced atomically, so a reader never sees half a table."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(upsert(text, row), encoding="utf-8")


__all__ = [
    "COLUMNS",
    "HEADER",
    "ResultRow",
    "command_line",
    "describe_machine",
    "record",
    "result_line",
    "result_lines",
    "this_machine",
    "upsert",
]
