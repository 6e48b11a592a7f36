"""Read and write files in the episode's sandbox (``read_file`` and ``write_file`` tools).

Invariants: paths are relative to the sandbox's working directory (the sandbox enforces
that); text is UTF-8 (undecodable bytes are replaced, never an error); a missing file or a
bad path is a ``ToolError`` the model sees.
"""

from __future__ import annotations

from agentroll.errors import ToolError
from agentroll.sandbox.base import Sandbox
from agentroll.tool import tool


def _need(sandbox: Sandbox | None, name: str) -> Sandbox:
    if sandbox is None:
        raise ToolError(f"{name} needs a sandbox; set sandbox_config on the environment")
    return sandbox


@tool
async def read_file(path: str, sandbox: Sandbox | None) -> str:
    """Read a text file from the sandbox's working directory.

    Args:
        path: file path relative to the working directory, e.g. "src/main.py".
    """
    try:
        data = await _need(sandbox, "read_file").read_file(path)
    except FileNotFoundError:
        raise ToolError(f"no such file: {path}") from None
    except (OSError, ValueError) as exc:  # ValueError: the path leaves the working directory
        raise ToolError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return data.decode("utf-8", errors="replace")


@tool
async def write_file(path: str, content: str, sandbox: Sandbox | None) -> str:
    """Write a text file in the sandbox's working directory (parents are created, an
    existing file is replaced).

    Args:
        path: file path relative to the working directory, e.g. "solution.py".
        content: the complete new contents of the file.
    """
    try:
        await _need(sandbox, "write_file").write_file(path, content)
    except (OSError, ValueError) as exc:
        raise ToolError(f"cannot write {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return f"wrote {len(content.encode())} bytes to {path}"
