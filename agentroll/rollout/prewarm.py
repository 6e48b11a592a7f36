"""Sandbox pre-warm: sandboxes started ahead of the episodes that will take them.

The pool keeps ``target`` sandboxes started or starting: the forecast of the next groups'
samples, the ones admission lets in next.  An episode takes the oldest (waiting for its
start if it is still starting) and a replacement starts at once, so starts overlap what
runs before them: earlier episodes, an admission held back, a training step between runs.
A sandbox goes to one episode at most; one idle past ``max_idle`` seconds, or whose start
failed, is closed, never handed out.  ``close()`` closes every one, whatever its state.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable

from agentroll.sandbox import open_sandbox
from agentroll.sandbox.base import Sandbox, SandboxConfig
from agentroll.types import new_id

__all__ = ["MAX_IDLE", "WarmPool", "close_shielded", "run_shielded"]

logger = logging.getLogger("agentroll.rollout")

#: seconds a started sandbox may wait for an episode before it is replaced (well inside a
#: docker container's default TTL of an hour, so one handed out has most of it left)
MAX_IDLE = 600.0


class WarmPool:
    """Up to ``target`` sandboxes of ``config`` started ahead of their episodes."""

    def __init__(self, config: SandboxConfig, target: int, *, max_idle: float = MAX_IDLE):
        if target < 1:
            raise ValueError(f"a warm pool holds at least one sandbox, got target={target}")
        self.config, self.target, self.max_idle = config, target, max_idle
        self._starting: collections.deque[tuple[float, asyncio.Task[Sandbox]]] = collections.deque()
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False
        self.counters = {"started": 0, "taken": 0, "failed": 0, "expired": 0}

    def __len__(self) -> int:
        return len(self._starting)

    def fill(self) -> None:
        """Start sandboxes until ``target`` are started or starting (in a running loop)."""
        while not self._closed and len(self._starting) < self.target:
            task = asyncio.create_task(_start(self.config, f"warm-{new_id()}"))
            self._starting.append((time.monotonic(), task))
            self.counters["started"] += 1

    async def take(self) -> Sandbox | None:
        """A started sandbox for an episode, or None (the pool is empty or the start failed:
        the episode opens its own, which reports why a start fails); starts a replacement."""
        try:
            while self._starting:
                born, task = self._starting.popleft()
                if time.monotonic() - born > self.max_idle:
                    self.counters["expired"] += 1
                    self._discard(task)
                    continue
                try:
                    sandbox = await asyncio.shield(task)
                except asyncio.CancelledError:
                    # the episode was cancelled while waiting: the sandbox is nobody's
                    self._discard(task)
                    raise
                except Exception:
                    self.counters["failed"] += 1
                    logger.debug("a pre-warmed sandbox failed to start", exc_info=True)
                    return None
                self.counters["taken"] += 1
                return sandbox
            return None
        finally:
            self.fill()

    def _discard(self, task: asyncio.Task[Sandbox]) -> None:
        closing = asyncio.create_task(_discard(task))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every sandbox of the pool, started or starting; no more start after it."""
        self._closed = True
        while self._starting:
            self._discard(self._starting.popleft()[1])
        await asyncio.gather(*list(self._closing), return_exceptions=True)


async def run_shielded(aw: Awaitable[object], what: str) -> None:
    """Await ``aw`` to completion even if the caller is being cancelled (then re-raise the
    cancellation after it); its failure is logged as ``what`` failed, never raised."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise
    except Exception:
        logger.exception("%s failed", what)


async def close_shielded(sandbox: Sandbox) -> None:
    """Close ``sandbox`` to completion even if the caller is being cancelled."""
    await run_shielded(sandbox.close(), "sandbox close")


async def _start(config: SandboxConfig, label: str) -> Sandbox:
    """A started sandbox (closed again if its start fails or is cancelled)."""
    sandbox = open_sandbox(config, episode_id=label)
    try:
        await sandbox.start()
    except BaseException:
        await close_shielded(sandbox)
        raise
    return sandbox


async def _discard(task: asyncio.Task[Sandbox]) -> None:
    """Cancel a start or close the sandbox it started."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        await close_shielded(task.result())
