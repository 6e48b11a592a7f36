"""The HTTP server's connection budget: caps per client and in all, eviction, descriptors.

Invariants: a new connection over a cap takes the place of the oldest idle one that never
sent the right token, else it is refused (503); the caps stay below ``RLIMIT_NOFILE``
(``nofile_plan``: the soft limit is raised, or the caps lowered with a warning), so the
spool never runs out of descriptors; the planning functions are pure.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import TYPE_CHECKING

import msgspec

from agentroll.errors import ConfigError

if TYPE_CHECKING:
    from agentroll.stream.http import App, HTTPConfig, _Connection

logger = logging.getLogger("agentroll.stream.http")


#: descriptors kept free of connections for the rest of the process (the spool's segment and
#: ack files, sandboxes' pipes, model files), and the most one connection holds at once (its
#: socket, a dup of it during sendfile, the spool files a lease response reads)
_FDS_RESERVED = 512
_FDS_PER_CONNECTION = 3


class _Server:
    def __init__(self, app: App, config: HTTPConfig) -> None:
        self.app = app
        self.config = config
        # held connections, oldest first (dicts keep insertion order), in all and per client
        self.connections: dict[_Connection, None] = {}
        self.by_client: dict[str, dict[_Connection, None]] = {}
        self.active = 0  # handlers running
        self.idle = asyncio.Event()
        self.closing = False
        self.refused = 0  # connections answered 503 (over a cap)
        self.evicted = 0  # idle connections without the token closed for a new one

    def admit(self, conn: _Connection) -> str | None:
        """Count ``conn`` in, making room by evicting the oldest evictable connection where
        a cap is reached; the 503 message when there is no room."""
        cfg = self.config
        mine = self.by_client.get(conn.client, {})
        if len(mine) >= cfg.max_connections_per_client and not self._evict(mine):
            self.refused += 1
            return (
                f"too many connections from {conn.client} (HTTPConfig."
                f"max_connections_per_client={cfg.max_connections_per_client}); close idle "
                "ones and retry"
            )
        if len(self.connections) >= cfg.max_connections and not self._evict(self.connections):
            self.refused += 1
            return (
                f"the server holds its most connections (HTTPConfig.max_connections="
                f"{cfg.max_connections}); retry later"
            )
        conn.counted = True
        self.connections[conn] = None
        self.by_client.setdefault(conn.client, {})[conn] = None
        return None

    def _evict(self, pool: dict[_Connection, None]) -> bool:
        victim = next((c for c in pool if c.evictable), None)
        if victim is None:
            return False
        self.forget(victim)
        self.evicted += 1
        victim._abort()
        return True

    def forget(self, conn: _Connection) -> None:
        """Stop counting ``conn`` (idempotent)."""
        if not conn.counted:
            return
        conn.counted = False
        self.connections.pop(conn, None)
        mine = self.by_client.get(conn.client)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.by_client[conn.client]


def _bulk_sndbuf() -> int | None:
    """The send buffer to ask for: ``net.core.wmem_max`` when setting it explicitly (the
    kernel doubles it) gives more than autotuning may reach (``tcp_wmem``'s max), so that a
    whole lease body fits while the client decodes the one before; None (autotuning stays
    on) otherwise, or where ``/proc`` says nothing."""
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            wmem_max = int(f.read())
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            auto_max = int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return None
    return sndbuf_choice(wmem_max, auto_max)


def sndbuf_choice(wmem_max: int, autotune_max: int) -> int | None:
    """``SO_SNDBUF`` to set given the sysctls (pure; see ``_bulk_sndbuf``)."""
    return wmem_max if 2 * wmem_max > autotune_max else None


def nofile_plan(max_connections: int, soft: int, hard: int) -> tuple[int, int]:
    """``(soft RLIMIT_NOFILE to set, connections to allow)`` so that ``max_connections``
    connections leave ``_FDS_RESERVED`` descriptors to the rest of the process: the soft
    limit rises toward what is needed (up to ``hard``; ``resource.RLIM_INFINITY``: no bound),
    and the cap falls to what the result allows (pure).  Raises ``ConfigError`` when the
    hard limit leaves no room for one connection."""
    need = _FDS_RESERVED + _FDS_PER_CONNECTION * max_connections
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft, max_connections
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    target = max(target, soft)
    allowed = min(max_connections, (target - _FDS_RESERVED) // _FDS_PER_CONNECTION)
    if allowed < 1:
        raise ConfigError(
            f"RLIMIT_NOFILE (soft {soft}, hard {hard}) leaves no descriptors for connections "
            f"beside the {_FDS_RESERVED} kept for the spool and the rest; raise it "
            f"(ulimit -n {need})"
        )
    return target, allowed


def _fit_nofile(config: HTTPConfig, what: str) -> HTTPConfig:
    """``config`` with its caps lowered to what RLIMIT_NOFILE allows, after raising the soft
    limit as far as needed and the hard limit lets it (see ``nofile_plan``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target, allowed = nofile_plan(config.max_connections, soft, hard)
    if target != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.info("raised the soft RLIMIT_NOFILE from %d to %d for %s", soft, target, what)
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the soft RLIMIT_NOFILE to %d: %s", target, exc)
            target, allowed = nofile_plan(config.max_connections, soft, soft)
    if allowed < config.max_connections:
        logger.warning(
            "serving %s with at most %d connections, not HTTPConfig.max_connections=%d: "
            "RLIMIT_NOFILE (soft %d, hard %d) has no room for more beside the spool; raise "
            "`ulimit -n` to allow them",
            what,
            allowed,
            config.max_connections,
            target,
            hard,
        )
        config = msgspec.structs.replace(
            config,
            max_connections=allowed,
            max_connections_per_client=min(config.max_connections_per_client, allowed),
        )
    return config
