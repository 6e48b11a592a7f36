"""The docker sandbox: one container per episode, commands through a persistent channel.

Invariants: commands run as ``options.command_uid``, never as the agent, and nothing they
start outlives the call; a command's timeout is enforced inside the container and outside
(then the container is marked broken); a reply whose MAC fails marks it broken too; files
never move through a link that leaves the working directory; ``close()`` always finishes.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import os
import posixpath
import signal
import tarfile
import time
from collections.abc import Mapping
from typing import Any

from agentroll.errors import SandboxError
from agentroll.sandbox._channel import capture_from
from agentroll.sandbox.base import Sandbox, SandboxConfig
from agentroll.sandbox.docker_options import _PATH, DEFAULT_IMAGE, DockerOptions, _Spec
from agentroll.sandbox.docker_pool import _RETRY_AFTER, _Container, _Pool, _pool
from agentroll.types import ExecResult

__all__ = ["DockerSandbox", "prewarm"]

log = logging.getLogger("agentroll.sandbox")

_OUTSIDE_GRACE = 2.0  # seconds past a command's timeout before we stop waiting for the agent
_FILE_TIMEOUT = 120.0  # seconds for a file op in the agent (up to 192 MiB each way)


async def prewarm(config: SandboxConfig, *, timeout: float = 120.0) -> int:
    """Fill the warm pool of ``config`` (``options.pool_size`` containers) and wait until it
    is full; return how many are warm.  Raises ``SandboxError`` if the pool cannot fill."""
    probe = DockerSandbox(config)
    pool = await _pool(probe.options, probe.spec)
    deadline = time.monotonic() + timeout
    pool.refill()
    while len(pool.warm) < pool.size:
        if pool.fill_failures >= len(_RETRY_AFTER) or time.monotonic() > deadline:
            raise SandboxError(
                f"warm pool of {probe.spec.image} holds {len(pool.warm)}/{pool.size} "
                "containers; see the warnings above"
            )
        await asyncio.sleep(0.005)
    return len(pool.warm)


class DockerSandbox(Sandbox):
    """A container per episode (from a warm pool).

    Each container runs the in-container agent (``_agent.py``) as its main process under
    tini, with its stdin/stdout attached to us over one hijacked HTTP connection to the
    daemon, so an ``exec`` is one round trip on an open connection (a few ms) instead of a
    ``docker exec`` (about 50 ms).  Containers come from a warm pool per (daemon, image,
    limits) (``docker_pool``); blocking SDK calls run on a bounded thread pool whose size
    matches the docker client's connection pool (``docker_daemon``).  A container cannot
    outlive its TTL (the agent's SIGALRM ends it) nor, for long, its owner (the attach
    connection closing is the agent's stdin EOF).  Files move through the agent with the
    command uid's rights.  ``config.network`` is refused.

    ``config.memory_mb``, ``pids`` and ``cpus`` are the container's limits (no swap);
    ``disk_mb`` and ``tmp_mb`` size its tmpfs working directory and ``/tmp``;
    ``file_size_mb`` and ``open_files`` become ulimits; ``cpu_seconds`` does not apply
    (``cpus`` bounds the CPU share and each command's timeout its time).  Docker-only
    settings are ``DockerOptions`` fields in ``config.options``.
    """

    def __init__(self, config: SandboxConfig | None = None, *, episode_id: str | None = None):
        self.config = config or SandboxConfig(backend="docker")
        if self.config.network:
            raise ValueError(
                "docker sandboxes never have network (network_mode='none'); set network=false"
            )
        self.options = DockerOptions.from_config(self.config)
        image = self.config.image or DEFAULT_IMAGE
        host_mounts = self.options.host_mounts
        self.spec = _Spec(
            image=image,
            memory_mb=self.config.memory_mb,
            cpus=self.config.cpus,
            pids=self.config.pids,
            ttl=self.options.ttl,
            workdir=posixpath.normpath(self.options.workdir),
            disk_mb=self.config.disk_mb,
            tmp_mb=self.config.tmp_mb,
            command_uid=self.options.command_uid,
            host_mounts=image == DEFAULT_IMAGE if host_mounts is None else host_mounts,
            python=self.options.python,
            file_size_mb=self.config.file_size_mb,
            open_files=self.config.open_files,
            run_id=self.options.run_id,
            start_timeout=self.options.start_timeout,
        )
        self.episode_id = episode_id
        self._container: _Container | None = None
        self._pool: _Pool | None = None
        self._closed = False
        self._start_lock = asyncio.Lock()

    @property
    def container_id(self) -> str:
        """The container's id; raises ``SandboxError`` before ``start()`` or after ``close()``."""
        return self._live().id

    def _live(self) -> _Container:
        container = self._container
        if container is None:
            state = "closed" if self._closed else "not started; call start() first"
            raise SandboxError(f"the sandbox is {state}")
        if container.broken:
            raise SandboxError(f"container {container.id[:12]} is broken: {container.broken}")
        return container

    async def start(self) -> None:
        """Take a container from the warm pool (or create one).  Raises ``SandboxError`` if
        no daemon answers, the image is missing or the container's agent does not start."""
        async with self._start_lock:
            if self._closed:
                raise SandboxError("the sandbox is closed")
            if self._container is not None:
                return
            self._pool = await _pool(self.options, self.spec)
            self._container = await self._pool.acquire(self.episode_id)

    async def _started(self) -> _Container:
        if self._container is None and not self._closed:
            await self.start()
        return self._live()

    def _inside(self, path: str, *, allow_absolute: bool) -> str:
        """``path`` as an absolute container path in the working directory (lexically)."""
        root = self.spec.workdir
        if posixpath.isabs(path) and not allow_absolute:
            raise ValueError(f"sandbox path {path!r} must be relative to the working directory")
        full = posixpath.normpath(posixpath.join(root, path))
        if full != root and not full.startswith(root + "/"):
            raise ValueError(f"sandbox path {path!r} is outside the working directory")
        return full

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
        """Run ``cmd`` in the container (``/bin/sh -c`` for a string, an argv for a list).

        Same contract as ``LocalSandbox.exec``: the process group dies when the command
        exits, times out or the call is cancelled, and every other process of the command
        uid once no other exec runs (before the result is returned); ``exit_code`` is the
        negative signal
        number when the leader was killed (-9 for a timeout or the OOM killer, whose kill
        is also noted at the end of ``stderr``); 127 for a command not found.  Raises
        ``ValueError`` for bad arguments or a ``cwd`` outside the working directory,
        ``FileNotFoundError`` if ``cwd`` is not a directory, ``SandboxError`` if the
        container is gone or stopped answering.
        """
        container = await self._started()
        timeout = self.config.timeout if timeout is None else timeout
        max_output = self.config.max_output if max_output is None else max_output
        if not timeout > 0:  # NaN too
            raise ValueError(f"exec timeout must be > 0 seconds, got {timeout}")
        if max_output <= 0:
            raise ValueError(f"exec max_output must be > 0 bytes, got {max_output}")
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise ValueError("exec needs a non-empty command")
        run_dir = self.spec.workdir if cwd is None else self._inside(cwd, allow_absolute=True)
        environ = {"PATH": _PATH, "HOME": self.spec.workdir, "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
        if env:
            environ.update(env)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        msg = {
            "op": "exec",
            "argv": argv,
            "cwd": run_dir,
            "env": environ,
            "timeout": timeout,
            "max_output": max_output,
            "stdin": None if data is None else base64.b64encode(data).decode("ascii"),
        }
        channel = container.channel
        req_id = channel.new_id()
        started = time.monotonic()
        try:
            reply = await channel.request(msg, req_id=req_id, timeout=timeout + _OUTSIDE_GRACE)
        except asyncio.CancelledError:
            channel.post({"op": "kill", "target": req_id, "id": 0})
            raise
        except TimeoutError:
            channel.post({"op": "kill", "target": req_id, "id": 0})
            container.broken = (
                f"its agent did not answer within {timeout + _OUTSIDE_GRACE:.1f} s "
                "(the command's timeout plus a grace period)"
            )
            return ExecResult(
                exit_code=-signal.SIGKILL,
                stderr=f"[sandbox: no answer from the container: {container.broken}]\n",
                timed_out=True,
                duration=time.monotonic() - started,
            )
        error = reply.get("error")
        if error == "cwd":
            raise FileNotFoundError(f"exec cwd {cwd!r} is not a directory in the sandbox")
        if error:
            if "survive" in str(error):  # the container can no longer promise a clean call
                container.broken = str(error)
            raise SandboxError(f"container {container.id[:12]} could not run {argv[0]!r}: {error}")
        out = capture_from(reply["stdout"], max_output)
        err = capture_from(reply["stderr"], max_output)
        stderr = err.text()
        if reply.get("oom"):
            stderr += (
                f"\n[sandbox: killed by the out-of-memory killer: the container's memory "
                f"limit is {self.spec.memory_mb} MiB]\n"
            )
        elided = out.elided + err.elided
        return ExecResult(
            exit_code=int(reply["exit_code"]),
            stdout=out.text(),
            stderr=stderr,
            timed_out=bool(reply.get("timed_out")),
            truncated=elided > 0,
            elided_bytes=elided,
            duration=time.monotonic() - started,
        )

    # -- files, through the agent (the working directory is a tmpfs in the container) -----

    async def _file_op(self, msg: dict[str, Any], shown: str) -> dict[str, Any]:
        """Send a file op to the agent; its refusals as the matching Python errors."""
        container = await self._started()
        try:
            reply = await container.channel.request(msg, timeout=_FILE_TIMEOUT)
        except TimeoutError:
            container.broken = f"its agent did not finish a {msg['op']} in {_FILE_TIMEOUT:.0f} s"
            raise SandboxError(
                f"container {container.id[:12]} is broken: {container.broken}"
            ) from None
        error = reply.get("error")
        if error is None:
            return reply
        detail = reply.get("detail", "")
        if error == "os":
            code = int(reply.get("errno") or 0)
            raise OSError(code, f"{shown}: {os.strerror(code) if code else detail} in the sandbox")
        if error == "outside":
            raise ValueError(f"sandbox path {shown!r} is outside the working directory: {detail}")
        if error == "too_large":
            raise ValueError(
                f"{shown}: {detail}; the sandbox moves at most 192 MiB at once: compress or "
                "split it with exec"
            )
        if error == "not_regular":
            raise FileNotFoundError(f"{shown!r} is not a regular file in the sandbox")
        raise SandboxError(f"container {container.id[:12]}: {msg['op']} {shown!r}: {detail}")

    async def read_file(self, path: str) -> bytes:
        """Read ``path`` (relative to the working directory); symlinks are followed while
        they stay inside it.

        Raises ``FileNotFoundError`` if missing, ``IsADirectoryError`` for a directory,
        ``ValueError`` if absolute, escaping, or a link that leads out of the directory.
        """
        self._inside(path, allow_absolute=False)
        reply = await self._file_op({"op": "read", "path": path}, path)
        return base64.b64decode(reply["data"])

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Write ``path`` (relative to the working directory), creating parent directories;
        a symlink at ``path`` is replaced, never written through.

        A ``str`` is written as UTF-8.  Raises ``ValueError`` if absolute or escaping,
        ``OSError`` (``ENOSPC``...) as the command uid would get it.
        """
        target = self._inside(path, allow_absolute=False)
        if target == self.spec.workdir:
            raise ValueError(f"sandbox path {path!r} names the working directory")
        raw = data.encode() if isinstance(data, str) else data
        msg = {"op": "write", "path": path, "data": base64.b64encode(raw).decode("ascii")}
        await self._file_op(msg, path)

    async def snapshot(self) -> bytes:
        """The working directory as an uncompressed tar archive, member names relative to
        it (the local sandbox's format, so a snapshot restores on either backend)."""
        reply = await self._file_op({"op": "snapshot"}, "the working directory")
        return base64.b64decode(reply["data"])

    async def restore(self, blob: bytes) -> None:
        """Replace the working directory's contents with a ``snapshot()`` blob.

        A blob that is not a tar archive, or holds an absolute path, ``..``, a device or a
        link leaving the directory raises ``ValueError`` before anything is changed.
        """
        await self._started()
        _check_blob(blob)
        msg = {"op": "restore", "data": base64.b64encode(blob).decode("ascii")}
        await self._file_op(msg, "the snapshot")

    async def close(self) -> None:
        """Remove the container (or, with ``options.reuse``, reset it and return it to the
        pool).  Finishes even if the caller is cancelled.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        container, self._container = self._container, None
        if container is None or self._pool is None:
            return
        reuse = self.options.reuse and container.broken is None
        task = asyncio.ensure_future(self._pool.release(container, reuse=reuse))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise


def _check_blob(blob: bytes) -> None:
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                if member.name.startswith("/") or ".." in parts:
                    raise ValueError(f"snapshot member {member.name!r} leaves the directory")
                try:
                    tarfile.data_filter(member, "/nonexistent-restore-root")
                except tarfile.FilterError as exc:
                    raise ValueError(f"snapshot member {member.name!r} refused: {exc}") from exc
    except tarfile.TarError as exc:
        raise ValueError(f"not a usable sandbox snapshot: {exc}") from exc
