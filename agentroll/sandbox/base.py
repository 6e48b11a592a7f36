"""The Sandbox protocol: where agent tool calls execute.

Invariants: a command's failure or timeout is an ``ExecResult``, never an exception
(``SandboxError`` is for the sandbox itself failing); output is bounded by ``max_output``
bytes per stream (head and tail kept); ``close()`` is idempotent and is always called by
the owner, shielded from cancellation.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, Self

import msgspec

from agentroll.types import ExecResult

DEFAULT_MAX_OUTPUT = 64 * 1024


class SandboxConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Static sandbox limits.  ``backend`` is ``local`` or ``docker``."""

    backend: str = "local"
    timeout: float = 30.0  # default wall-clock limit of one exec, seconds
    max_output: int = DEFAULT_MAX_OUTPUT  # bytes kept per stream
    cpu_seconds: int = 60  # RLIMIT_CPU of one exec
    memory_mb: int = 1024  # RLIMIT_AS of one exec
    file_size_mb: int = 64  # RLIMIT_FSIZE
    open_files: int = 256  # RLIMIT_NOFILE
    max_processes: int = 0  # RLIMIT_NPROC; 0 leaves it alone (it counts per user)
    network: bool = False
    use_bwrap: bool | None = None  # None: use bubblewrap when it works here
    image: str | None = None  # docker only
    options: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if self.backend not in ("local", "docker"):
            raise ValueError(
                f"sandbox backend {self.backend!r} is unknown; use 'local' or 'docker'"
            )
        if not self.timeout > 0:  # NaN too
            raise ValueError("sandbox timeout must be > 0 seconds")
        if self.max_output < 256:
            raise ValueError("sandbox max_output must be at least 256 bytes")


class Sandbox(abc.ABC):
    """A place to run commands and keep files for one episode.

    Use as ``async with`` (or call ``start()`` / ``close()``).  All methods are coroutines;
    blocking work runs off the event loop.
    """

    config: SandboxConfig

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Prepare the sandbox (create directories, start a container)."""

    @abc.abstractmethod
    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        max_output: int | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a shell string or an argv list) and return its result.

        On timeout the whole process group is killed and ``timed_out`` is set.  On
        cancellation the process group is killed before the cancellation propagates.
        """

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """Read a file relative to the working directory.  Raises ``FileNotFoundError`` if
        it is missing and ``ValueError`` for an absolute path or one that escapes the
        working directory."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: str | bytes) -> None:
        """Write a file relative to the working directory (parents created).  Raises
        ``ValueError`` for an absolute path or one that escapes the working directory."""

    @abc.abstractmethod
    async def snapshot(self) -> bytes:
        """The working directory's contents as an opaque blob (a tar archive)."""

    @abc.abstractmethod
    async def restore(self, blob: bytes) -> None:
        """Replace the working directory's contents with a ``snapshot()`` blob."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Kill what still runs and delete the sandbox.  Idempotent."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


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
