"""Sandboxes: where tool calls run (``local`` process/bubblewrap, ``docker``)."""

from agentroll.sandbox.base import Sandbox, SandboxConfig, open_sandbox

__all__ = ["Sandbox", "SandboxConfig", "open_sandbox"]
