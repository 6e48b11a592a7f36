"""The reusable tools: the safe calculator (pure) and the sandbox tools on a local sandbox."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from agentroll.errors import ToolError
from agentroll.sandbox import Sandbox, open_sandbox
from agentroll.tools.calculator import MAX_INT_BITS, calculate
from agentroll.tools.files import read_file, write_file
from agentroll.tools.python_exec import python_exec
from agentroll.tools.shell import shell

SANDBOX_TOOLS = [python_exec, shell, read_file, write_file]


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    async with open_sandbox() as sb:
        yield sb


# -- calculate ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("-2 ** 2", "-4"),
        ("2 ** -1", "0.5"),
        ("+-+5", "-5"),
        (" 0.1 + 0.2 ", repr(0.1 + 0.2)),
        ("123456789 * 987654321", str(123456789 * 987654321)),
        (f"2 ** {MAX_INT_BITS - 1}", str(2 ** (MAX_INT_BITS - 1))),
    ],
)
def test_calculate_evaluates_arithmetic_exactly(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os')",
        "__import__('os').system('true')",
        "x + 1",
        "abs(-1)",
        "(1).real",
        "'a' * 3",
        "[1, 2]",
        "1 if 1 else 2",
        "1 < 2",
        "lambda: 1",
        "True + 1",
        "1j * 2",
        "2 +",
        "1; 2",
        "",
    ],
)
def test_calculate_rejects_everything_but_arithmetic(expression: str) -> None:
    with pytest.raises(ToolError, match=r"allowed|use only"):
        calculate(expression)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("9**9**9", "too large"),
        ("2**2**2**2**2", "too large"),
        (f"2 ** {MAX_INT_BITS}", "too large"),
        ("(10**2000) * (10**2000)", "too large"),
        ("2.0 ** 5000", "too large"),
        ("1e308 * 10", "not a finite number"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1" * 2000, "longer than"),
    ],
)
def test_calculate_refuses_huge_or_undefined_results_at_once(expression: str, message: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ToolError, match=message):
        calculate(expression)
    assert time.perf_counter() - started < 0.5


def test_calculate_schema_describes_its_one_argument() -> None:
    params = calculate.spec.parameters
    assert params["required"] == ["expression"]
    assert params["properties"]["expression"]["type"] == "string"
    assert params["properties"]["expression"]["description"]
    assert calculate.injected == ()


# -- sandbox tools --------------------------------------------------------------------------


@pytest.mark.parametrize("tool", SANDBOX_TOOLS, ids=lambda t: t.name)
def test_sandbox_tools_hide_the_injected_sandbox(tool: object) -> None:
    spec = tool.spec  # type: ignore[attr-defined]
    assert tool.injected == ("sandbox",)  # type: ignore[attr-defined]
    assert "sandbox" not in spec.parameters["properties"]
    assert spec.description
    assert all(p.get("description") for p in spec.parameters["properties"].values())
    assert set(spec.parameters["required"]) == set(spec.parameters["properties"])


@pytest.mark.parametrize(
    ("tool", "kwargs"),
    [
        (python_exec, {"code": "print(1)"}),
        (shell, {"command": "true"}),
        (read_file, {"path": "a.txt"}),
        (write_file, {"path": "a.txt", "content": "x"}),
    ],
    ids=lambda x: getattr(x, "name", ""),
)
async def test_sandbox_tools_without_a_sandbox_tell_the_model(tool: object, kwargs: dict) -> None:
    with pytest.raises(ToolError, match="needs a sandbox"):
        await tool(**kwargs, sandbox=None)  # type: ignore[operator]


async def test_python_exec_runs_code_and_reports_failures(sandbox: Sandbox) -> None:
    assert (await python_exec(code="print(6 * 7)", sandbox=sandbox)).strip() == "42"
    assert await python_exec(code="x = 1", sandbox=sandbox) == "(no output)"
    crashed = await python_exec(code="print('before')\n1 / 0", sandbox=sandbox)
    assert crashed.startswith("before")
    assert "ZeroDivisionError" in crashed
    assert "line 2" in crashed  # the traceback names the real line of the file
    assert crashed.endswith("[exit code 1]")


async def test_python_exec_parallel_calls_do_not_share_a_file(sandbox: Sandbox) -> None:
    outs = await asyncio.gather(
        *(python_exec(code=f"print({i})", sandbox=sandbox) for i in range(4))
    )
    assert [o.strip() for o in outs] == ["0", "1", "2", "3"]


async def test_shell_reports_stdout_stderr_and_exit_code(sandbox: Sandbox) -> None:
    out = await shell(command="echo hello; echo oops >&2; exit 3", sandbox=sandbox)
    assert out.startswith("hello\n")
    assert "[stderr]\noops" in out
    assert out.endswith("[exit code 3]")


async def test_files_round_trip_and_errors_reach_the_model(sandbox: Sandbox) -> None:
    text = "héllo\nwörld\n"
    confirmation = await write_file(path="sub/dir/a.txt", content=text, sandbox=sandbox)
    assert confirmation == f"wrote {len(text.encode())} bytes to sub/dir/a.txt"
    assert await read_file(path="sub/dir/a.txt", sandbox=sandbox) == text
    assert (await shell(command="cat sub/dir/a.txt", sandbox=sandbox)) == text
    with pytest.raises(ToolError, match=r"no such file: missing\.txt"):
        await read_file(path="missing.txt", sandbox=sandbox)
    with pytest.raises(ToolError, match="cannot read"):
        await read_file(path="../outside.txt", sandbox=sandbox)
    with pytest.raises(ToolError, match="cannot write"):
        await write_file(path="/etc/agentroll-test", content="x", sandbox=sandbox)
