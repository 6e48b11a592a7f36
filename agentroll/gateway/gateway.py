"""The gateway: sessions of outside agents as token-exact episodes on a backend.

Invariants: a weight sync pauses calls in flight and resumes them under the policy (a
streamed call that already sent tokens resumes with ``recompute`` where ``restart`` was
asked: sent text cannot be taken back); ended sessions go to ``publish`` group by group;
leaving the gateway ends the live sessions as abandoned and publishes them.  The calls
themselves are ``CallHandler``'s (agentroll.gateway.calls).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from agentroll.backends.base import Backend, UpdatesInRotation
from agentroll.chat import ChatTokenizer, get_tool_parser
from agentroll.errors import ConfigError
from agentroll.gateway.calls import CallHandler, _Call
from agentroll.gateway.config import GatewayConfig
from agentroll.gateway.session import Group, Session, session_clock
from agentroll.gateway.wire import (
    RequestError,
)
from agentroll.rollout.episode_loop import episode_seed
from agentroll.rollout.pause import EpisodeView, PauseController, PolicyFn, as_policy_fn
from agentroll.types import (
    ResumePolicy,
    Status,
    Strategy,
    SyncReport,
    Task,
    ToolSpec,
    Trajectory,
)

logger = logging.getLogger("agentroll.gateway")

Publish = Callable[[list[Trajectory]], Awaitable[None]]
_ENDED_MEMORY = 65_536  # ended session ids remembered (a late call gets 409, not 404)
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF
_TOOLS_CACHE = 1024  # distinct tool lists whose checked form is kept


class Gateway(CallHandler):
    """Sessions of outside agents over one backend (or fleet).

    ``async with Gateway(backend, publish=...) as gw:`` then serve ``gw.app()`` (see
    ``agentroll.gateway.serve``) or call ``chat`` / ``completion`` in process.  ``publish``
    receives each released group's trajectories (a spool, a buffer); without it they
    collect in ``finished``.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        tokenizer: ChatTokenizer | None = None,
        config: GatewayConfig | None = None,
        publish: Publish | None = None,
        clock: Callable[[], float] = session_clock,
    ) -> None:
        tok = tokenizer or backend.tokenizer
        if tok is None:
            raise ConfigError("Gateway needs a ChatTokenizer (pass tokenizer=...)")
        self.backend = backend
        self.tokenizer: ChatTokenizer = tok
        self.config = config or GatewayConfig()
        self.parser = get_tool_parser(self.config.tool_parser)
        self.publish = publish
        self.finished: list[Trajectory] = []
        self._clock = clock
        self.sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # sid -> status
        self._groups: dict[str, Group] = {}
        self._calls: dict[str, _Call] = {}
        self._tools_cache: dict[bytes, list[ToolSpec]] = {}
        self.pauses = PauseController(backend, self._views)
        self._reaper: asyncio.Task[None] | None = None  # owned: cancelled on exit
        self.stats = {"calls": 0, "failed_calls": 0, "sessions": 0, "abandoned": 0, "forks": 0}

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Gateway:
        self._reaper = asyncio.create_task(self._reap(), name="agentroll-gateway-reaper")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        reaper, self._reaper = self._reaper, None
        try:
            for session in list(self.sessions.values()):
                await self.end(session, status="abandoned", reason="gateway_closed")
        finally:
            if reaper is not None:
                reaper.cancel()
                await asyncio.wait([reaper])
                failure = None if reaper.cancelled() else reaper.exception()
                if failure is not None:  # it ended sessions: publishing one of them failed
                    raise failure

    async def _reap(self) -> None:
        """End sessions idle for longer than ``idle_timeout`` as abandoned."""
        timeout = self.config.idle_timeout
        while True:
            await asyncio.sleep(min(timeout / 4, 5.0))
            cutoff = self._clock() - timeout
            for session in list(self.sessions.values()):
                if session.last_active < cutoff and not session.in_flight:
                    await self.end(session, status="abandoned", reason="idle_timeout")

    def open_session(
        self,
        *,
        task_id: str = "",
        group_id: str = "",
        group_size: int = 0,
        seed: int | None = None,
        metadata: dict[str, Any] | None = None,
        task: Task | None = None,
    ) -> Session:
        """A new session; ``group_id``/``group_size`` make it one sample of a group."""
        if len(self.sessions) >= self.config.max_sessions:
            raise RequestError(
                429,
                f"{len(self.sessions)} sessions are open (GatewayConfig.max_sessions); end "
                "some or raise the limit",
                kind="rate_limit_error",
            )
        if group_size < 0:
            raise RequestError(400, "group_size must be >= 0", param="group_size")
        group = None
        if group_id:
            group = self._groups.get(group_id)
            if group is None:
                group = self._groups[group_id] = Group(group_size)
            elif group.full():
                raise RequestError(
                    409,
                    f"group {group_id!r} already has its {group.size} sessions; use a new group id",
                    param="group_id",
                )
        index = group.join() if group is not None else 0
        task = task or Task(id=task_id or "gateway")
        session = Session(
            self.tokenizer,
            task=task,
            group_id=group_id,
            sample_index=index,
            seed=seed if seed is not None else episode_seed(self.config.seed, task.id, index),
            metadata=dict(metadata or {}),
            clock=self._clock(),
        )
        self.sessions[session.id] = session
        self.stats["sessions"] += 1
        return session

    def session(self, sid: str) -> Session:
        """The live session ``sid``; ``RequestError`` 404 (unknown) or 409 (ended)."""
        session = self.sessions.get(sid)
        if session is not None:
            return session
        if sid in self._ended:
            raise RequestError(
                409,
                f"session {sid} has ended ({self._ended[sid]}); create a new one with "
                "POST /sessions",
                code="session_ended",
            )
        raise RequestError(
            404, f"no session {sid!r}; create one with POST /sessions", code="unknown_session"
        )

    async def end(
        self, session: Session, *, status: Status = "ok", reason: str = "ended"
    ) -> list[Trajectory]:
        """End ``session``: calls in flight are aborted, its samples become trajectories,
        its group is released when complete.  Idempotent."""
        if session.ended:
            return []
        session.ended = True
        pending = list(session.in_flight.values())
        for task in pending:
            task.cancel()
        if pending:  # wait for them to settle; this task's own cancellation still propagates
            await asyncio.wait(pending)
        self.sessions.pop(session.id, None)
        self._ended[session.id] = status
        if len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
        session.status, session.stop_reason = status, reason
        self.stats["abandoned"] += status == "abandoned"
        self.stats["forks"] += session.capture.num_forks
        self.backend.end_episode(session.id)
        trajs = session.trajectories(
            backend=self.backend.name, keep_messages=self.config.keep_messages
        )
        group = self._groups.get(session.group_id) if session.group_id != session.id else None
        if group is None:
            await self._release(trajs)
            return trajs
        group.ended += 1
        group.trajectories.extend(trajs)
        if group.complete():
            del self._groups[session.group_id]
            await self._release(group.trajectories)
        return trajs

    async def _release(self, trajs: list[Trajectory]) -> None:
        if not trajs:
            return
        if self.publish is not None:
            await self.publish(trajs)
        else:
            self.finished.extend(trajs)

    # -- sync ----------------------------------------------------------------------------

    def _views(self) -> list[EpisodeView]:
        version = self.backend.policy_version
        views = []
        for call in self._calls.values():
            b = call.session.capture.samples[call.plan.sample].builder
            sampled = np.frombuffer(b.mask, dtype=np.uint8).view(bool)
            any_sampled = bool(sampled.any())
            min_pol = int(np.frombuffer(b.policy, np.int32)[sampled].min()) if any_sampled else None
            min_kv = int(np.frombuffer(b.kv, np.int32)[sampled].min()) if any_sampled else None
            views.append(
                EpisodeView(
                    episode_id=call.session.id,
                    request_id=call.request_id,
                    turn=call.session.capture.calls,
                    tokens_generated=len(b) - call.plan.gen_start,
                    min_policy_version=min_pol,
                    min_kv_version=min_kv,
                    policy_version=version,
                )
            )
        return views

    def _policy(self, choose: PolicyFn) -> PolicyFn:
        def pick(view: EpisodeView) -> ResumePolicy:
            policy = choose(view)
            call = self._calls.get(view.request_id)
            if policy == "restart" and call is not None and call.streamed and call.sent:
                return "recompute"  # what was streamed cannot be taken back
            return policy

        return pick

    async def sync(
        self,
        update: Any,
        *,
        policy: ResumePolicy | PolicyFn = "keep",
        strategy: Strategy | None = None,
    ) -> SyncReport:
        """Install a ``WeightUpdate`` while calls go on (as ``RolloutEngine.sync``): calls in
        flight pause at a token boundary and resume under ``policy``; clients only wait."""
        choose = self._policy(as_policy_fn(policy))
        backend = self.backend
        if isinstance(backend, UpdatesInRotation):
            return await backend.update(
                update,
                strategy=strategy,
                policies=lambda: self.pauses.policies(update.version, choose),
            )
        if strategy not in (None, "pause"):
            raise ConfigError(f"strategy {strategy!r} needs a fleet; a backend syncs by pause")
        t0 = time.perf_counter()
        await self.pauses.pause(choose)
        try:
            await backend.apply(update)
        finally:
            paused_for = await self.pauses.resume()
        return SyncReport(
            strategy="pause",
            version=update.version,
            seconds=time.perf_counter() - t0,
            pause_ms=[paused_for * 1000.0],
        )

    def track(self, session: Session, key: str, task: asyncio.Task[Any]) -> None:
        """Register a call's task (``end`` cancels it)."""
        session.in_flight[key] = task
        task.add_done_callback(lambda _t: session.in_flight.pop(key, None))

    def status(self) -> dict[str, Any]:
        return {
            "sessions_live": len(self.sessions),
            "groups_waiting": len(self._groups),
            "calls_in_flight": len(self._calls),
            "policy_version": self.backend.policy_version,
            "paused": self.pauses.paused,
            **self.stats,
        }


__all__ = ["Gateway", "GatewayConfig", "Publish"]
