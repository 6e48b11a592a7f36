"""Sandboxes: where tool calls run (``local``: a process under bubblewrap; ``docker``).

``open_sandbox`` picks the implementation named by ``SandboxConfig.backend``; the
implementations import only ``base``, so this package is the one place that knows them all.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentroll.sandbox.base import Sandbox, SandboxConfig

__all__ = ["Sandbox", "SandboxConfig", "open_sandbox"]


def open_sandbox(
    config: SandboxConfig | None = None, *, episode_id: str | None = None, **overrides: Any
) -> Sandbox:
    """Create (not yet started) a sandbox of ``config.backend``.  ``episode_id`` labels
    what the sandbox creates (docker containers) so leftovers can be traced to an episode."""
    cfg = config or SandboxConfig()
    if overrides:
        cfg = msgspec.structs.replace(cfg, **overrides)
    if cfg.backend == "local":
        from agentroll.sandbox.local import LocalSandbox

        return LocalSandbox(cfg)
    if cfg.backend == "docker":
        from agentroll.sandbox.docker import DockerSandbox

        return DockerSandbox(cfg, episode_id=episode_id)
    raise ValueError(f"unknown sandbox backend {cfg.backend!r}")
