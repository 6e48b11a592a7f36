"""Sandboxes: where tool calls run (``local``: a process under bubblewrap; ``docker``; or
a plugin registered in entry point group ``agentroll.sandboxes``).

``open_sandbox`` picks the implementation named by ``SandboxConfig.backend``; the
implementations import only ``base``, so this package is the one place that knows them all.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentroll.errors import ConfigError
from agentroll.plugins import SANDBOXES
from agentroll.sandbox.base import Sandbox, SandboxConfig

__all__ = ["Sandbox", "SandboxConfig", "open_sandbox"]


def open_sandbox(
    config: SandboxConfig | None = None, *, episode_id: str | None = None, **overrides: Any
) -> Sandbox:
    """Create (not yet started) a sandbox of ``config.backend``.  ``episode_id`` labels
    what the sandbox creates (docker containers) so leftovers can be traced to an episode.
    A plugin backend is called as ``factory(config, episode_id=episode_id)``; raises
    ``ConfigError`` when the name is unknown or the plugin returns no ``Sandbox``."""
    cfg = config or SandboxConfig()
    if overrides:
        cfg = msgspec.structs.replace(cfg, **overrides)
    if cfg.backend == "local":
        from agentroll.sandbox.local import LocalSandbox

        return LocalSandbox(cfg)
    if cfg.backend == "docker":
        from agentroll.sandbox.docker import DockerSandbox

        return DockerSandbox(cfg, episode_id=episode_id)
    factory = SANDBOXES.load(cfg.backend)
    sandbox = factory(cfg, episode_id=episode_id)
    if not isinstance(sandbox, Sandbox):
        raise ConfigError(
            f"sandbox backend {cfg.backend!r} made a {type(sandbox).__name__}, not a Sandbox; "
            "its entry point must name a Sandbox subclass (or a factory returning one)"
        )
    return sandbox
