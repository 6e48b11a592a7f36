"""``agentroll bench NAME --record FILE`` as pure logic: the result line is the last
``key=value`` line, a benchmark's row is replaced in place or appended, every other line of
the file is kept, and a missing file or table is created with the header."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agentroll.bench.record import (
    COLUMNS,
    HEADER,
    ResultRow,
    command_line,
    cpu_model,
    describe_machine,
    record,
    result_line,
    upsert,
)


def row(name: str, result: str = "a=1 b=2", date: str = "2030-01-02") -> ResultRow:
    return ResultRow(name, f"agentroll bench {name}", result, date, "x86_64, 2 CPUs, no GPU")


def table_rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(COLUMNS)
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_result_line_is_the_last_key_value_line() -> None:
    stdout = "[bench engine] model=/tmp/x requests=4\nwarming up\nx=1 y=2.5\ntok=3 rate=nan\n"
    assert result_line(stdout) == "tok=3 rate=nan"
    assert result_line("x=1\nlast line is prose\n") == "x=1"
    assert result_line("no pairs here\n[bench] a=1\n") is None
    assert result_line("") is None


def test_an_empty_file_gets_the_header_and_one_row() -> None:
    text = upsert("", row("overhead"))
    assert text.startswith(HEADER)
    assert table_rows(text) == [
        [
            "overhead",
            "`agentroll bench overhead`",
            "`a=1 b=2`",
            "2030-01-02",
            "x86_64, 2 CPUs, no GPU",
        ]
    ]
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_a_benchmark_row_is_replaced_in_place_and_others_kept() -> None:
    text = upsert(upsert(upsert("", row("overhead")), row("sync")), row("stream"))
    updated = upsert(text, row("sync", result="a=9", date="2030-02-03"))
    assert [r[0] for r in table_rows(updated)] == ["overhead", "sync", "stream"]
    assert table_rows(updated)[1][2:4] == ["`a=9`", "2030-02-03"]
    assert table_rows(updated)[0] == table_rows(text)[0]
    assert table_rows(updated)[2] == table_rows(text)[2]
    assert upsert(updated, row("sync", result="a=9", date="2030-02-03")) == updated  # idempotent


def test_lines_around_the_table_are_kept() -> None:
    text = upsert("", row("overhead")).replace(HEADER, "# Results\n\nProse before.\n")
    text += "\nProse after the table.\n"
    updated = upsert(text, row("chaos"))
    assert updated.startswith("# Results\n\nProse before.\n")
    assert updated.endswith("| x86_64, 2 CPUs, no GPU |\n\nProse after the table.\n")
    assert [r[0] for r in table_rows(updated)] == ["overhead", "chaos"]


def test_a_file_without_the_table_gets_one_at_the_end() -> None:
    updated = upsert("# Notes\n\nNo table yet.\n\n\n", row("sandbox"))
    assert updated.startswith("# Notes\n\nNo table yet.\n\n| benchmark |")
    assert [r[0] for r in table_rows(updated)] == ["sandbox"]


def test_pipes_in_a_cell_are_escaped_and_do_not_split_the_row() -> None:
    odd = ResultRow("sync", "agentroll bench sync", "a=1|2", "2030-01-02", "arm64, 1 CPU, no GPU")
    text = upsert(upsert("", odd), row("overhead"))
    assert "`a=1\\|2`" in text
    assert upsert(text, odd) == text


def test_describe_machine() -> None:
    assert describe_machine("x86_64", 2, []) == "x86_64, 2 CPUs, no GPU"
    assert describe_machine("arm64", 1, []) == "arm64, 1 CPU, no GPU"
    assert describe_machine("x86_64", None, []) == "x86_64, ? CPUs, no GPU"
    assert describe_machine("x86_64", 16, ["NVIDIA H200"]) == "x86_64, 16 CPUs, 1 GPU (NVIDIA H200)"
    assert describe_machine("x86_64", 8, ["A", "A"]) == "x86_64, 8 CPUs, 2 GPUs (A)"
    assert describe_machine("x86_64", 2, [], "AMD EPYC") == "x86_64 (AMD EPYC), 2 CPUs, no GPU"


def test_cpu_model_reads_the_first_model_name() -> None:
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t:  AMD  EPYC 9R14\n\n"
    assert cpu_model(text + "processor\t: 1\nmodel name\t: other\n") == "AMD EPYC 9R14"
    assert cpu_model("model name : a|b\n") == "a/b"
    assert cpu_model("processor : 0\n") == ""


def test_command_line_names_only_the_options_that_differ_from_the_defaults() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--model", default=None)
    parser.add_argument("--no-kv", action="store_true")
    parser.add_argument("--probe", action="append", default=None)
    args = parser.parse_args(["--episodes", "40", "--no-kv", "--probe", "a b", "--probe", "c"])
    args.record = "RESULTS.md"  # the bench command's own option is not the benchmark's
    line = command_line("agentroll bench x", parser, args)
    assert line == "agentroll bench x --episodes 40 --no-kv --probe 'a b' --probe c"
    assert command_line("agentroll bench x", parser, parser.parse_args([])) == "agentroll bench x"


def test_record_creates_and_updates_the_file(tmp_path: Path) -> None:
    path = tmp_path / "benchmarks" / "RESULTS.md"
    record(path, row("overhead"))
    record(path, row("overhead", result="a=2"))
    assert [r[2] for r in table_rows(path.read_text())] == ["`a=2`"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["RESULTS.md"]


def test_the_cli_records_the_result_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentroll.cli import main

    path = tmp_path / "RESULTS.md"
    argv = ["bench", "overhead", "--episodes", "4", "--turns", "1", "--concurrency", "2"]
    assert main([*argv, "--record", str(path)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.startswith("turns_per_s=")  # the line is still printed
    [recorded] = table_rows(path.read_text())
    assert recorded[:3] == [
        "overhead",
        "`agentroll bench overhead --episodes 4 --turns 1 --concurrency 2`",
        f"`{printed}`",
    ]


def test_result_lines_by_key_keep_the_last_line_of_each_value() -> None:
    from agentroll.bench.record import result_lines

    out = "progress\nopt=a speedup=1 x=1\nnoise here\nopt=b speedup=2\nopt=a speedup=3\nk=v\n"
    assert result_lines(out, "opt") == {"a": "opt=a speedup=3", "b": "opt=b speedup=2"}
    assert result_lines("nothing", "opt") == {}
