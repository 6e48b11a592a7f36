"""The docker sandbox: one container per episode, commands through a persistent channel.

Each container runs the in-container agent (``_agent.py``) as its main process under tini,
with its stdin/stdout attached to us over one hijacked HTTP connection to the daemon, so an
``exec`` is one round trip on an open connection (a few ms) instead of a ``docker exec``
(about 50 ms).  Files move through the archive API.  Containers come from a warm pool per
(daemon, image, limits); blocking SDK calls run on a bounded thread pool whose size matches
the docker client's connection pool.

Invariants:
- Every container has ``network_mode="none"``, the CPU, memory (no swap) and pids limits of
  ``SandboxConfig``, a read-only root with size-capped tmpfs mounts (the working directory:
  ``disk_mb``; ``/tmp`` and ``/dev/shm``: ``tmp_mb``), ``cap_drop=ALL`` but the agent's
  SETUID/SETGID/KILL, ``no-new-privileges``, tini as PID 1, and the labels of
  ``_ratelimit`` (owner, created at, TTL, run, episode).  ``config.network`` is refused.  A
  limit the container does not show is named in a warning at start.
- Commands run as ``options.command_uid``, never as the agent (root without other
  capabilities); nothing a command starts outlives its call, and a reply whose MAC fails
  (see ``_channel``) marks the container broken.  Files move through the agent with the
  command uid's rights and never through a link that leaves the working directory.
- A container cannot outlive its TTL (the agent's SIGALRM ends it) nor, for long, its owner
  (the attach connection closing is the agent's stdin EOF); a stopped container is removed
  by ``close()``, by the owner's exit/SIGTERM handler (bulk, by owner label) or by the
  reaper that runs when a process first uses a daemon.
- A command's timeout is enforced inside the container (the agent SIGKILLs its process
  group) and outside (no answer by timeout + grace: a timed-out result, the container is
  marked broken and later calls raise ``SandboxError``).
- A pooled container is health-checked (a ping) before hand-out; one is reused only if
  ``options.reuse`` and the agent verified the reset (no other process, empty directories).
- ``close()`` finishes removing the container even if the caller is cancelled.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import functools
import io
import logging
import os
import posixpath
import signal
import socket
import tarfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import msgspec

from agentroll.errors import SandboxError
from agentroll.sandbox._channel import AgentChannel, capture_from
from agentroll.sandbox._owner import HOST, me, owner_alive
from agentroll.sandbox._ratelimit import (
    LABEL,
    LABEL_CREATED,
    LABEL_EPISODE,
    LABEL_OWNER,
    LABEL_RUN,
    LABEL_TTL,
    TokenBucket,
    reap_reason,
)
from agentroll.sandbox.base import Sandbox, SandboxConfig
from agentroll.types import ExecResult

__all__ = [
    "DEFAULT_IMAGE",
    "DockerOptions",
    "DockerSandbox",
    "close_pools",
    "describe_containers",
    "ensure_base_image",
    "list_containers",
    "prewarm",
    "reap",
    "remove_owned",
]

log = logging.getLogger("agentroll.sandbox")

T = TypeVar("T")

DEFAULT_IMAGE = "agentroll/base:host"  # empty image; the host's runtime is bind-mounted
# Not /sbin: docker mounts its init (tini) at /sbin/docker-init.
_HOST_MOUNTS = ("/usr", "/lib", "/lib64", "/lib32", "/bin")
_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
_OUTSIDE_GRACE = 2.0  # seconds past a command's timeout before we stop waiting for the agent
_PING_TIMEOUT = 2.0
_FILE_TIMEOUT = 120.0  # seconds for a file op in the agent (up to 192 MiB each way)
_MIB = 1024 * 1024
_DOCKER_HINT = (
    "start a daemon (`scripts/dockerd.sh start` starts a private one and prints its "
    "DOCKER_HOST), or set sandbox option docker_host / $DOCKER_HOST"
)


class DockerOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Docker-only settings, read from ``SandboxConfig.options``."""

    docker_host: str | None = None  # default: $DOCKER_HOST, else unix:///var/run/docker.sock
    ttl: float = 3600.0  # seconds a container may live at most
    workdir: str = "/workspace"
    command_uid: int = 1000  # uid and gid of every command (the agent runs as 0)
    pool_size: int = 2  # warm containers kept ready per image and limits
    reuse: bool = False  # put a container back in the pool after a verified reset
    host_mounts: bool | None = None  # bind the host's /usr, /lib...; None: default image only
    python: str = "python3"  # the image's interpreter for the agent
    run_id: str = ""
    create_rate: float = 10.0  # container creations per second
    create_burst: int = 8
    max_connections: int = 64  # docker client connection pool = SDK thread pool size
    start_timeout: float = 30.0

    @classmethod
    def from_config(cls, config: SandboxConfig) -> DockerOptions:
        try:
            opts = msgspec.convert(config.options, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"sandbox options: {exc}") from None
        if opts.max_connections < 1:
            raise ValueError("sandbox options: max_connections must be >= 1")
        if not 1 <= opts.command_uid <= 65534:
            raise ValueError(
                f"sandbox options: command_uid = {opts.command_uid} is out of range; use "
                "1..65534 (0 is the agent's)"
            )
        if not posixpath.isabs(opts.workdir) or posixpath.normpath(opts.workdir) == "/":
            raise ValueError(f"sandbox options: workdir {opts.workdir!r} must be absolute, not /")
        return opts


class _Spec(msgspec.Struct, frozen=True):
    """Everything a container is created from; containers of equal specs are interchangeable."""

    image: str
    memory_mb: int
    cpus: float
    pids: int
    ttl: float
    workdir: str
    disk_mb: int
    tmp_mb: int
    command_uid: int
    host_mounts: bool
    python: str
    file_size_mb: int
    open_files: int
    run_id: str
    start_timeout: float


# ---------------------------------------------------------------------------------------
# process identity, used by the owner label and the reaper


_HOST = HOST


def _owner() -> str:
    """This process's owner label (``me()`` is recomputed in a forked child)."""
    pid, ticks = me()
    return f"{_HOST}:{pid}:{ticks}"


# ---------------------------------------------------------------------------------------
# the daemon: one SDK client, one thread pool, one creation rate limit per URL


@contextlib.contextmanager
def _docker_errors(url: str, what: str) -> Iterator[None]:
    """Translate the docker SDK's and its transport's errors into ``SandboxError``: every
    blocking docker call runs inside this (``_Daemon.call`` and the module's functions)."""
    import docker.errors
    import requests.exceptions

    try:
        yield
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        raise SandboxError(
            f"docker {what} failed at {url}: {exc}; check that the daemon is healthy "
            f"(`docker info`, its log), then retry"
        ) from exc


def _resolve_host(docker_host: str | None) -> str:
    url = docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if url.startswith("/"):
        url = "unix://" + url
    return url


class _Daemon:
    def __init__(self, url: str, max_connections: int, rate: float, burst: int) -> None:
        import docker

        self.url = url
        parsed = urlparse(url)
        if parsed.scheme not in ("unix", "tcp", "http"):
            raise SandboxError(
                f"docker sandbox: daemon URL {url!r} is not supported (its commands need a "
                "persistent attach connection, which agentroll opens over unix:// or plain "
                "tcp://); use one of those"
            )
        self.parsed = parsed
        try:
            self.client = docker.APIClient(base_url=url, max_pool_size=max_connections, timeout=120)
            self.client.ping()
        except Exception as exc:
            raise SandboxError(
                f"no docker daemon answers at {url} ({exc}); {_DOCKER_HINT}"
            ) from exc
        self.api_version: str = self.client.api_version
        self.executor = ThreadPoolExecutor(max_connections, thread_name_prefix="agentroll-docker")
        self.bucket = TokenBucket(rate, burst, time.monotonic())
        self.reaped = 0

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the SDK thread pool; docker errors as ``SandboxError``."""
        what = getattr(fn, "__name__", "call").strip("_")

        def run() -> T:
            with _docker_errors(self.url, what):
                return fn(*args, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(self.executor, run)

    async def creation_slot(self) -> None:
        await asyncio.sleep(self.bucket.reserve(time.monotonic()))

    async def attach(self, cid: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A raw connection to the container's stdin/stdout/stderr (hijacked HTTP)."""
        try:
            return await self._attach(cid)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise SandboxError(
                f"cannot attach to container {cid[:12]} at {self.url}: {exc}; check that the "
                "daemon is healthy (`docker info`), then retry"
            ) from exc

    async def _attach(self, cid: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.parsed.scheme == "unix":
            reader, writer = await asyncio.open_unix_connection(self.parsed.path)
        else:
            reader, writer = await asyncio.open_connection(
                self.parsed.hostname, self.parsed.port or 2375
            )
        request = (
            f"POST /v{self.api_version}/containers/{cid}/attach"
            "?stream=1&stdin=1&stdout=1&stderr=1 HTTP/1.1\r\n"
            "Host: docker\r\nContent-Type: text/plain\r\n"
            "Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
        )
        writer.write(request.encode())
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].decode("latin-1")
        if " 101 " not in status and " 200 " not in status:
            writer.close()
            raise SandboxError(f"docker refused to attach to container {cid[:12]}: {status}")
        sock = writer.get_extra_info("socket")
        if sock is not None and self.parsed.scheme != "unix":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer


_daemons: dict[str, _Daemon] = {}
_daemons_lock = threading.Lock()


def _daemon(opts: DockerOptions) -> _Daemon:
    """The process's ``_Daemon`` for ``opts.docker_host`` (blocking; call off the loop)."""
    url = _resolve_host(opts.docker_host)
    with _daemons_lock:
        daemon = _daemons.get(url)
        if daemon is None:
            daemon = _Daemon(url, opts.max_connections, opts.create_rate, opts.create_burst)
            _install_atexit()
            with _docker_errors(url, "listing containers to reap"):
                daemon.reaped = _reap(daemon.client)
            if daemon.reaped:
                log.warning(
                    "removed %d leftover agentroll container(s) at %s (past their TTL or "
                    "their owner is gone)",
                    daemon.reaped,
                    url,
                )
            _daemons[url] = daemon
        return daemon


# ---------------------------------------------------------------------------------------
# cleanup: the reaper, bulk removal at exit and on SIGTERM


def list_containers(docker_host: str | None = None, *, owner: str | None = None) -> list[str]:
    """Ids of this project's containers (all states) at the daemon; ``owner``: only those
    of that owner label (``"self"`` for this process).  Blocking."""
    daemon = _daemon(DockerOptions(docker_host=docker_host))
    label = LABEL if owner is None else f"{LABEL_OWNER}={_owner() if owner == 'self' else owner}"
    with _docker_errors(daemon.url, "listing containers"):
        return [c["Id"] for c in daemon.client.containers(all=True, filters={"label": label})]


def describe_containers(docker_host: str | None = None) -> list[str]:
    """One line per project container: id, state, age, owner, run, episode.  Blocking."""
    daemon = _daemon(DockerOptions(docker_host=docker_host))
    now = time.time()
    lines = []
    with _docker_errors(daemon.url, "listing containers"):
        found = daemon.client.containers(all=True, filters={"label": LABEL})
    for c in found:
        labels = c.get("Labels") or {}
        try:
            age = f"{now - float(labels.get(LABEL_CREATED, now)):.0f}s"
        except ValueError:
            age = "?"
        lines.append(
            f"{c['Id'][:12]} state={c.get('State', '?')} age={age} "
            f"owner={labels.get(LABEL_OWNER, '?')} run={labels.get(LABEL_RUN) or '-'} "
            f"episode={labels.get(LABEL_EPISODE) or '-'}"
        )
    return lines


def _reap(client: Any) -> int:
    removed = 0
    now = time.time()
    for c in client.containers(all=True, filters={"label": LABEL}):
        why = reap_reason(c.get("Labels") or {}, now=now, host=_HOST, owner_alive=owner_alive)
        if why is None:
            continue
        log.info("reaping container %s: %s", c["Id"][:12], why)
        if _remove_quietly(client, c["Id"]):
            removed += 1
    return removed


def reap(docker_host: str | None = None) -> int:
    """Remove this project's containers that are past their TTL or whose owner process on
    this host is gone; return how many.  Runs by itself when a process first uses a daemon;
    call it to sweep again.  Blocking."""
    daemon = _daemon(DockerOptions(docker_host=docker_host))
    with _docker_errors(daemon.url, "reaping containers"):
        return _reap(daemon.client)


def _remove_quietly(client: Any, cid: str) -> bool:
    import docker.errors

    try:
        client.remove_container(cid, force=True, v=True)
        return True
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError as exc:
        if exc.status_code == 409:  # removal already in progress
            return False
        log.warning("cannot remove container %s: %s", cid[:12], exc)
        return False


def remove_owned() -> int:
    """Remove every container this process created, at every daemon it used (bulk, by
    owner label).  Runs at interpreter exit and on SIGTERM.  Blocking; never raises."""
    removed = 0
    for daemon in list(_daemons.values()):  # no lock: this may run in a signal handler
        try:
            mine = daemon.client.containers(
                all=True, filters={"label": f"{LABEL_OWNER}={_owner()}"}
            )
        except Exception as exc:
            log.warning("cannot list containers at %s to clean up: %s", daemon.url, exc)
            continue
        for c in mine:
            removed += _remove_quietly(daemon.client, c["Id"])
    return removed


_atexit_installed = False
_sigterm_installed = False


def _install_atexit() -> None:
    global _atexit_installed
    if not _atexit_installed:
        _atexit_installed = True
        atexit.register(remove_owned)


def _install_sigterm() -> None:
    """On SIGTERM with the default action (which skips atexit), remove this process's
    containers first.  An application that handles SIGTERM itself (the worker does) shuts
    down normally and atexit runs.  Only from the main thread (signal handlers live there)."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_installed = True
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: object) -> None:
        remove_owned()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


# ---------------------------------------------------------------------------------------
# images


def ensure_base_image(docker_host: str | None = None) -> str:
    """Create ``DEFAULT_IMAGE`` (an empty image, made offline) if the daemon lacks it."""
    import docker.errors

    daemon = _daemon(DockerOptions(docker_host=docker_host))
    client = daemon.client
    with _docker_errors(daemon.url, "creating the base image"):
        try:
            client.inspect_image(DEFAULT_IMAGE)
        except docker.errors.ImageNotFound:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w"):
                pass
            repo, tag = DEFAULT_IMAGE.rsplit(":", 1)
            client.import_image_from_data(buf.getvalue(), repository=repo, tag=tag)
            log.info("created the base image %s (empty; host runtime mounted)", DEFAULT_IMAGE)
    return DEFAULT_IMAGE


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


# ---------------------------------------------------------------------------------------
# containers and pools


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


async def close_pools() -> None:
    """Remove the warm containers of this event loop's pools (call before the loop ends;
    what is left is removed at interpreter exit)."""
    pools = _pools.pop(asyncio.get_running_loop(), {})
    await asyncio.gather(*(p.close() for p in pools.values()), return_exceptions=True)


# ---------------------------------------------------------------------------------------
# the sandbox


class DockerSandbox(Sandbox):
    """A container per episode (from a warm pool); see the module docstring.

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
