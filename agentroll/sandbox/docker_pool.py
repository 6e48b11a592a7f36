"""Docker containers and their warm pools: creation with the sandbox's security settings.

Invariants: every container has no network, the config's CPU, memory (no swap) and pids
limits, a read-only root with size-capped tmpfs mounts, only the agent's SETUID/SETGID/KILL
capabilities, ``no-new-privileges`` and tini as PID 1 (a limit it does not show is warned
about); a pooled container is pinged before hand-out and reused only after a verified reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentroll.errors import SandboxError
from agentroll.sandbox._channel import AgentChannel
from agentroll.sandbox._ratelimit import (
    LABEL,
    LABEL_CREATED,
    LABEL_EPISODE,
    LABEL_OWNER,
    LABEL_RUN,
    LABEL_TTL,
)
from agentroll.sandbox.docker_daemon import (
    _Daemon,
    _daemon,
    _daemons,
    _install_sigterm,
    _owner,
    _remove_quietly,
    _resolve_host,
    ensure_base_image,
)
from agentroll.sandbox.docker_options import _PATH, DEFAULT_IMAGE, DockerOptions, _Spec

log = logging.getLogger("agentroll.sandbox")

# Not /sbin: docker mounts its init (tini) at /sbin/docker-init.
_HOST_MOUNTS = ("/usr", "/lib", "/lib64", "/lib32", "/bin")
_PING_TIMEOUT = 2.0
_MIB = 1024 * 1024


@functools.cache
def _host_binds() -> dict[str, dict[str, str]]:
    return {
        os.path.realpath(path): {"bind": path, "mode": "ro"}
        for path in _HOST_MOUNTS
        if os.path.exists(path)
    }


@functools.cache
def _agent_source() -> str:
    return Path(__file__).with_name("_agent.py").read_text()


class _Container:
    def __init__(self, daemon: _Daemon, cid: str, channel: AgentChannel) -> None:
        self.daemon = daemon
        self.id = cid
        self.channel = channel
        self.broken: str | None = None

    async def healthy(self) -> bool:
        if self.broken or not self.channel.alive:
            return False
        try:
            reply = await self.channel.request({"op": "ping"}, timeout=_PING_TIMEOUT)
        except (SandboxError, TimeoutError):
            return False
        return bool(reply.get("ok"))

    async def destroy(self) -> None:
        await self.channel.close()
        await self.daemon.call(_remove_quietly, self.daemon.client, self.id)


async def _create(daemon: _Daemon, spec: _Spec, episode_id: str | None) -> _Container:
    import docker.errors

    await daemon.creation_slot()
    client = daemon.client
    labels = {
        LABEL: "1",
        LABEL_OWNER: _owner(),
        LABEL_CREATED: f"{time.time():.3f}",
        LABEL_TTL: f"{spec.ttl:.0f}",
        LABEL_RUN: spec.run_id,
        LABEL_EPISODE: episode_id or "",
    }
    binds = _host_binds() if spec.host_mounts else {}
    mem = f"{spec.memory_mb}m"
    ulimits = []
    if spec.file_size_mb > 0:
        fsize = spec.file_size_mb * _MIB
        ulimits.append(docker.types.Ulimit(name="fsize", soft=fsize, hard=fsize))
    if spec.open_files > 0:
        ulimits.append(
            docker.types.Ulimit(name="nofile", soft=spec.open_files, hard=spec.open_files)
        )
    uid = spec.command_uid
    host_config = client.create_host_config(
        network_mode="none",
        mem_limit=mem,
        memswap_limit=mem,  # equal: no swap
        nano_cpus=int(spec.cpus * 1e9),
        pids_limit=spec.pids,
        cap_drop=["ALL"],
        # The agent's only powers: run commands as command_uid and kill what they leave.
        cap_add=["SETUID", "SETGID", "KILL"],
        security_opt=["no-new-privileges"],
        init=True,
        read_only=True,
        tmpfs={
            spec.workdir: f"rw,nosuid,nodev,exec,size={spec.disk_mb}m,uid={uid},gid={uid},"
            "mode=0755",
            "/tmp": f"rw,nosuid,nodev,size={spec.tmp_mb}m,mode=1777",
        },
        shm_size=f"{spec.tmp_mb}m",
        binds=binds or None,
        ulimits=ulimits or None,
    )
    command = [spec.python, "-c", _agent_source(), f"{spec.ttl:.0f}", spec.workdir, str(uid)]

    def create() -> str:
        try:
            made = client.create_container(
                spec.image,
                command=command,
                stdin_open=True,  # with attach: StdinOnce, so our disconnect is EOF
                working_dir=spec.workdir,
                labels=labels,
                host_config=host_config,
                environment={"PATH": _PATH, "PYTHONDONTWRITEBYTECODE": "1"},
                user="0:0",  # the agent; commands get command_uid
                network_disabled=True,
            )
        except docker.errors.ImageNotFound:
            if spec.image != DEFAULT_IMAGE:
                raise SandboxError(
                    f"docker image {spec.image!r} is not at {daemon.url}; pull or build it "
                    "first (`docker pull IMAGE`)"
                ) from None
            ensure_base_image(daemon.url)
            return create()
        return str(made["Id"])

    creating = asyncio.ensure_future(daemon.call(create))
    try:
        # Shielded: the daemon creates the container whether or not we still wait for it.
        cid = await asyncio.shield(creating)
    except asyncio.CancelledError:
        creating.add_done_callback(functools.partial(_remove_created, daemon))
        raise
    channel: AgentChannel | None = None
    try:
        reader, writer = await daemon.attach(cid)
        channel = AgentChannel(reader, writer, multiplexed=True, name=f"container {cid[:12]}")
        await daemon.call(client.start, cid)
        hello = await channel.start(spec.start_timeout)
    except BaseException as exc:
        removal = asyncio.ensure_future(daemon.call(_remove_quietly, client, cid))
        with contextlib.suppress(BaseException):
            if channel is not None:
                await channel.close()
            await asyncio.shield(removal)
        hint = (
            f" (the sandbox's agent needs python >= 3.8 in the image: is {spec.python!r} on "
            f"the PATH of {spec.image!r}? set sandbox option python to its path)"
        )
        if isinstance(exc, SandboxError) and isinstance(exc.__cause__, docker.errors.APIError):
            missing = "executable file not found" in str(exc) or "no such file" in str(exc)
            raise SandboxError(
                f"docker could not start container {cid[:12]}: {exc}{hint if missing else ''}"
            ) from exc
        if isinstance(exc, SandboxError) and "cannot start" not in str(exc):
            raise SandboxError(f"{exc}{hint}") from exc
        raise
    _warn_unenforced(spec, hello.get("limits") or {})
    return _Container(daemon, cid, channel)


_warned: set[tuple[_Spec, str]] = set()


def _warn_unenforced(spec: _Spec, seen: Mapping[str, Any]) -> None:
    """Warn (once per spec and limit) about a limit the container does not show."""
    wanted = {
        "pids": (spec.pids, "sandbox.pids", "processes"),
        "memory": (spec.memory_mb * _MIB, "sandbox.memory_mb", "bytes"),
        "cpus": (spec.cpus, "sandbox.cpus", "cores"),
        "disk": (spec.disk_mb * _MIB, "sandbox.disk_mb", "bytes"),
        "tmp": (spec.tmp_mb * _MIB, "sandbox.tmp_mb", "bytes"),
    }
    for name, (value, field, unit) in wanted.items():
        got = seen.get(name)
        if isinstance(got, (int, float)) and abs(got - value) <= 0.02 * value:
            continue
        if (spec, name) in _warned:
            continue
        _warned.add((spec, name))
        log.warning(
            "docker sandbox: %s = %s %s is not enforced in the container (it sees %s); the "
            "daemon or its cgroup setup ignores this limit",
            field,
            value,
            unit,
            "no limit" if got is None else got,
        )


def _remove_created(daemon: _Daemon, creating: asyncio.Future[str]) -> None:
    """Done-callback of a creation whose caller was cancelled: remove what it made."""
    if not creating.cancelled() and creating.exception() is None:
        daemon.executor.submit(_remove_quietly, daemon.client, creating.result())


_RETRY_AFTER = (1.0, 5.0, 30.0)  # seconds the pool waits to refill after 1, 2, 3+ failures


class _Pool:
    """Warm containers of one spec, for one event loop."""

    def __init__(self, daemon: _Daemon, spec: _Spec, size: int) -> None:
        self.daemon = daemon
        self.spec = spec
        self.size = size
        self.warm: deque[_Container] = deque()
        self.filling = 0
        self.tasks: set[asyncio.Task[Any]] = set()
        self.closed = False
        self.fill_failures = 0  # in a row; any successful creation resets it
        self.retry_at = 0.0

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def refill(self) -> None:
        if self.closed or time.monotonic() < self.retry_at:
            return
        for _ in range(self.size - len(self.warm) - self.filling):
            self.filling += 1
            self._spawn(self._fill_one())

    async def _fill_one(self) -> None:
        try:
            container = await _create(self.daemon, self.spec, None)
        except Exception as exc:
            self._failed()
            log.warning("warm pool: cannot create a container of %s: %s", self.spec.image, exc)
            return
        finally:
            self.filling -= 1
        self.fill_failures = 0
        self.retry_at = 0.0
        if self.closed:
            await container.destroy()
        else:
            self.warm.append(container)

    def _failed(self) -> None:
        self.fill_failures += 1
        pause = _RETRY_AFTER[min(self.fill_failures, len(_RETRY_AFTER)) - 1]
        self.retry_at = time.monotonic() + pause

    async def acquire(self, episode_id: str | None) -> _Container:
        while self.warm:
            container = self.warm.popleft()
            healthy = await container.healthy()
            self.refill()  # after the ping: its set-up would delay the hand-out
            if healthy:
                if episode_id:  # labels are fixed at creation; the name says who has it
                    self._spawn(self._rename(container, episode_id))
                return container
            log.info("warm pool: container %s failed its health check", container.id[:12])
            self._spawn(container.destroy())
        self.refill()
        try:
            container = await _create(self.daemon, self.spec, episode_id)
        except SandboxError:
            self._failed()
            raise
        self.fill_failures, self.retry_at = 0, 0.0
        return container

    async def _rename(self, container: _Container, episode_id: str) -> None:
        safe = "".join(ch if ch.isalnum() or ch in "_.-" else "-" for ch in episode_id)[:80]
        with contextlib.suppress(Exception):
            await self.daemon.call(
                self.daemon.client.rename, container.id, f"agentroll-{safe}-{container.id[:8]}"
            )

    async def release(self, container: _Container, *, reuse: bool) -> None:
        if reuse and not self.closed and len(self.warm) < self.size and container.channel.alive:
            try:
                reply = await container.channel.request(
                    {"op": "reset", "dirs": [self.spec.workdir, "/tmp"], "kill": True},
                    timeout=10.0,
                )
            except (SandboxError, TimeoutError):
                reply = {"ok": False, "detail": "no answer"}
            if reply.get("ok"):
                self.warm.append(container)
                return
            log.info("container %s not reused: %s", container.id[:12], reply.get("detail"))
        await container.destroy()
        self.refill()

    async def close(self) -> None:
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        warm, self.warm = list(self.warm), deque()
        await asyncio.gather(*(c.destroy() for c in warm), return_exceptions=True)


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[_Spec, int], _Pool]] = (
    weakref.WeakKeyDictionary()
)


async def _pool(opts: DockerOptions, spec: _Spec) -> _Pool:
    loop = asyncio.get_running_loop()
    _install_sigterm()
    daemon = _daemons.get(_resolve_host(opts.docker_host))
    if daemon is None:  # first use: connect (and reap) off the loop
        daemon = await loop.run_in_executor(None, _daemon, opts)
    pools = _pools.setdefault(loop, {})
    key = (spec, opts.pool_size)
    pool = pools.get(key)
    if pool is None or pool.daemon is not daemon:
        pool = pools[key] = _Pool(daemon, spec, opts.pool_size)
    return pool


async def close_pools() -> None:
    """Remove the warm containers of this event loop's pools (call before the loop ends;
    what is left is removed at interpreter exit)."""
    pools = _pools.pop(asyncio.get_running_loop(), {})
    await asyncio.gather(*(p.close() for p in pools.values()), return_exceptions=True)
