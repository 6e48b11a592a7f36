"""The Sandbox protocol: where agent tool calls execute.

Invariants: a command's failure or timeout is an ``ExecResult``, never an exception
(``SandboxError`` is for the sandbox itself failing); output is bounded by ``max_output``
bytes per stream (head and tail kept); ``close()`` is idempotent and is always called by
the owner, shielded from cancellation.
"""

from __future__ import annotations

import abc
import asyncio
import io
import tarfile
from collections.abc import Mapping
from typing import Any, Self

import msgspec
import xxhash

from agentroll.plugins import SANDBOXES
from agentroll.types import ExecResult

DEFAULT_MAX_OUTPUT = 64 * 1024


class SandboxConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Static sandbox limits.  ``backend`` is ``local``, ``docker`` or the name of a sandbox
    registered in entry point group ``agentroll.sandboxes`` (see ``agentroll.plugins``).

    Totals are per sandbox (all its processes together, enforced by cgroups where the host
    offers them): ``memory_mb``, ``pids``, ``cpus``.  Storage is size-capped: ``tmp_mb``
    for ``/tmp``, ``disk_mb`` for the working directory.  Per-process rlimits
    (``cpu_seconds``, ``file_size_mb``, ``open_files``) apply to every process besides.  A
    limit a host cannot enforce is named in a warning when the sandbox starts.
    """

    backend: str = "local"
    timeout: float = 30.0  # default wall-clock limit of one exec, seconds
    max_output: int = DEFAULT_MAX_OUTPUT  # bytes kept per stream
    cpu_seconds: int = 60  # RLIMIT_CPU of each process
    memory_mb: int = 1024  # memory of the whole sandbox (and RLIMIT_AS of each process)
    pids: int = 256  # processes and threads of the whole sandbox
    cpus: float = 1.0  # CPU time of the whole sandbox, in cores
    tmp_mb: int = 256  # size of /tmp (RAM-backed, counted in memory_mb where cgroups work)
    disk_mb: int = 1024  # size of the working directory
    file_size_mb: int = 64  # RLIMIT_FSIZE
    open_files: int = 256  # RLIMIT_NOFILE
    network: bool = False
    use_bwrap: bool | None = None  # None: use bubblewrap when it works here
    image: str | None = None  # docker only
    options: dict[str, Any] = {}

    def __post_init__(self) -> None:
        SANDBOXES.check(self.backend)  # a ConfigError, which is a ValueError
        _check("timeout", self.timeout, 0.001, 86400.0, "seconds")
        _check("max_output", self.max_output, 256, 1 << 30, "bytes")
        _check("cpu_seconds", self.cpu_seconds, 1, 86400, "seconds")
        _check("memory_mb", self.memory_mb, 16, 1 << 20, "MiB")
        _check("pids", self.pids, 8, 1 << 22, "processes")
        _check("cpus", self.cpus, 0.01, 1024.0, "cores")
        _check("tmp_mb", self.tmp_mb, 1, 1 << 20, "MiB")
        _check("disk_mb", self.disk_mb, 1, 1 << 24, "MiB")
        _check("file_size_mb", self.file_size_mb, 1, 1 << 24, "MiB")
        _check("open_files", self.open_files, 16, 1 << 20, "files")


def _check(name: str, value: float, low: float, high: float, unit: str) -> None:
    # `not low <= value <= high` also refuses NaN; bool is an int but never a limit.
    if isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"sandbox.{name} = {value!r} is out of range; use {low}..{high} {unit}")


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

    async def state_digest(self) -> str:
        """A digest of the working directory's files (paths, kinds, modes and contents;
        not times), so equal files give equal digests: the sandbox part of a pure tool's
        cache key.  From ``snapshot()``; a sandbox may compute it more cheaply."""
        blob = await self.snapshot()
        return await asyncio.to_thread(tar_digest, blob)

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


def tar_digest(blob: bytes) -> str:
    """The digest ``Sandbox.state_digest`` gives for a tar archive: its members in name
    order, each as (name, kind, mode, link target, contents)."""
    h = xxhash.xxh3_128()
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            h.update(f"{m.name}\0{m.type!r}\0{m.mode}\0{m.linkname}\0".encode())
            if m.isfile():
                f = tar.extractfile(m)
                h.update(f.read() if f is not None else b"")
            h.update(b"\0")
    return h.hexdigest()
