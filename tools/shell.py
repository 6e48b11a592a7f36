"""Run a shell command in the episode's sandbox (the ``shell`` tool).

Invariants: the command runs in the sandbox's working directory under its limits; a failing
or timed-out command is output the model sees (with its exit code), never an exception.
"""

from __future__ import annotations

from agentroll.errors import ToolError
from agentroll.sandbox.base import Sandbox
from agentroll.tool import format_tool_output, tool


@tool
async def shell(command: str, sandbox: Sandbox | None) -> str:
    """Run a shell command in the sandbox's working directory and return its output.

    Args:
        command: a POSIX shell command line, e.g. "ls -la" or "python3 test.py".
    """
    if sandbox is None:
        raise ToolError("shell needs a sandbox; set sandbox_config on the environment")
    return format_tool_output(await sandbox.exec(command)) or "(no output)"
