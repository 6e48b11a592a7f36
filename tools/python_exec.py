"""Run a Python program in the episode's sandbox (the ``python_exec`` tool).

Invariants: the code goes to a fresh file under ``.agentroll/`` in the sandbox and runs as
``python3 FILE``, so tracebacks name real lines and parallel calls never share a file; a
failing or timed-out program is output the model sees, never an exception.
"""

from __future__ import annotations

from agentroll.errors import ToolError
from agentroll.sandbox.base import Sandbox
from agentroll.tool import format_tool_output, tool
from agentroll.types import new_id


@tool
async def python_exec(code: str, sandbox: Sandbox | None) -> str:
    """Run a Python 3 program in the sandbox and return what it prints (stdout, stderr,
    exit code).  Nothing persists between calls except files the program writes.

    Args:
        code: the complete program; use print() to show results.
    """
    if sandbox is None:
        raise ToolError("python_exec needs a sandbox; set sandbox_config on the environment")
    path = f".agentroll/exec_{new_id()[:12]}.py"
    await sandbox.write_file(path, code)
    return format_tool_output(await sandbox.exec(["python3", path])) or "(no output)"
