"""Every ``agentroll ... --help`` exits 0 in-process, ``agentroll bench --help`` lists every
benchmark with its one-line help, and neither help imports a benchmark or torch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from agentroll import cli
from agentroll.bench import BENCHMARKS

NESTED = [["model", "sizes"], ["model", "create-tiny"], ["sandbox", "ls"], ["sandbox", "reap"]]
NESTED.append(["sandbox", "audit"])
COMMANDS = [[], *([name] for name in cli.COMMANDS), *NESTED]
COMMANDS += [["bench", name] for name in BENCHMARKS]


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: agentroll"), out
    return out


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv) or "agentroll")
def test_help_exits_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(argv, capsys)
    assert f"usage: {' '.join(['agentroll', *argv])}" in " ".join(out.split())


def test_bench_help_lists_every_benchmark_with_its_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = " ".join(_help(["bench"], capsys).split())  # argparse wraps long help lines
    for name, (_, text) in BENCHMARKS.items():
        assert re.search(rf"\b{name} {re.escape(' '.join(text.split()))}", out), (name, out)


def test_every_command_help_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    out = " ".join(_help([], capsys).split())
    for name, (_, text) in cli.COMMANDS.items():
        assert f"{name} {' '.join(text.split())}" in out, name


def test_benchmark_options_appear_in_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(["bench", "overhead"], capsys)
    assert "--episodes" in out and "--record FILE" in out


_PROBE = """
import sys
from agentroll import cli
try:
    cli.main(sys.argv[1:] + ["--help"])
except SystemExit:
    pass
print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("agentroll.commands.",
    "agentroll.bench."))))
"""


@pytest.mark.parametrize(
    ("argv", "loaded"), [([], "[]"), (["bench"], "['agentroll.commands.bench']")]
)
def test_help_imports_no_benchmark_and_no_torch(argv: list[str], loaded: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == loaded
