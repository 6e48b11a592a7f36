import re
import subprocess
import sys

from agentroll.cli import main


def test_help_lists_commands(capsys) -> None:  # type: ignore[no-untyped-def]
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    assert "bench" in capsys.readouterr().out


def test_bench_overhead_prints_one_result_line() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentroll.cli",
            "bench",
            "overhead",
            "--episodes",
            "40",
            "--turns",
            "3",
            "--concurrency",
            "8",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"turns_per_s=([\d.]+) peak_rss_mb=([\d.]+) episodes=(\d+)", last)
    assert m, last
    assert float(m.group(1)) > 0 and int(m.group(3)) == 40


def test_bench_rejects_bad_arguments() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agentroll.cli", "bench", "overhead", "--episodes", "0"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "--episodes must be >= 1" in out.stderr


def test_envs_lists_builtin_environments(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "calculator" in out and "guess_number" in out and "code_fix" in out
