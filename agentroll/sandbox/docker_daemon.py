"""The docker daemon side: one SDK client per URL, and cleanup of containers by label.

Invariants: every blocking docker call runs on the daemon's bounded thread pool and its
errors become ``SandboxError``; a stopped container is removed by its sandbox, by the
owner's exit/SIGTERM handler (bulk, by owner label) or by the reaper that runs when a
process first uses a daemon (past its TTL, or its owner process is gone).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import io
import logging
import os
import signal
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlparse

from agentroll.errors import SandboxError
from agentroll.sandbox._owner import HOST, me, owner_alive
from agentroll.sandbox._ratelimit import (
    LABEL,
    LABEL_CREATED,
    LABEL_EPISODE,
    LABEL_OWNER,
    LABEL_RUN,
    TokenBucket,
    reap_reason,
)
from agentroll.sandbox.docker_options import DEFAULT_IMAGE, DockerOptions

log = logging.getLogger("agentroll.sandbox")

T = TypeVar("T")


_DOCKER_HINT = (
    "start a daemon (`scripts/dockerd.sh start` starts a private one and prints its "
    "DOCKER_HOST), or set sandbox option docker_host / $DOCKER_HOST"
)


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
# the base image


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
