"""Engine-level pause: quiesce every in-flight episode for a weight sync, then resume.

Role: the rollout engine owns one ``PauseController``.  ``pause`` closes the turn gate (no
episode starts a new generation) and pauses the backend, which stops every generation at a
token boundary; tool calls already running go on and their results are kept.  ``resume``
resumes the backend with a resume policy per request (chosen per episode by a
``PolicyFn``), reopens the gate and pushes every registered deadline back by the time spent
paused, so a sync never makes an episode or a generation time out.

Invariants (DESIGN.md 3, 4): environment code never sees a pause (its ``await`` just takes
longer); the policy of every paused request is explicit (``keep``, ``recompute`` or
``restart``); pause/resume are idempotent and serialised (one pause at a time); the gate,
the policies and the deadline arithmetic are pure logic with no I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from agentroll.backends.base import ResumePolicy

if TYPE_CHECKING:
    from agentroll.backends.base import Backend

RESUME_POLICIES: tuple[ResumePolicy, ...] = ("keep", "recompute", "restart")


class EpisodeView(msgspec.Struct, kw_only=True, frozen=True):
    """What a resume policy sees of one paused episode."""

    episode_id: str
    request_id: str
    turn: int
    tokens_generated: int  # sampled tokens delivered in this turn so far
    min_policy_version: int | None  # over every sampled token of the episode (None: none yet)
    min_kv_version: int | None  # over every sampled token of the episode (None: none yet)
    policy_version: int  # the backend's version when the episode was paused
    target_version: int | None = None  # the version the sync installs, when known


PolicyFn = Callable[[EpisodeView], ResumePolicy]


def fixed_policy(policy: ResumePolicy) -> PolicyFn:
    """The same policy for every episode."""
    check_policy(policy)
    return lambda view: policy


def staleness_policy(max_kv_lag: int, *, after: ResumePolicy = "recompute") -> PolicyFn:
    """``keep`` while the KV an episode would keep is at most ``max_kv_lag`` versions behind
    the weights it resumes under, ``after`` (default ``recompute``) beyond that."""
    if max_kv_lag < 0:
        raise ValueError("max_kv_lag must be >= 0")
    check_policy(after)

    def choose(view: EpisodeView) -> ResumePolicy:
        target = view.target_version if view.target_version is not None else view.policy_version
        oldest = view.min_kv_version if view.min_kv_version is not None else view.policy_version
        return "keep" if target - oldest <= max_kv_lag else after

    return choose


def check_policy(policy: ResumePolicy) -> ResumePolicy:
    if policy not in RESUME_POLICIES:
        raise ValueError(f"unknown resume policy {policy!r}; use keep, recompute or restart")
    return policy


def as_policy_fn(policy: ResumePolicy | PolicyFn) -> PolicyFn:
    return fixed_policy(policy) if isinstance(policy, str) else policy


class PauseGate:
    """Open/closed gate for new turns, with the paused time it has accumulated."""

    __slots__ = ("_open", "closed_at", "paused_seconds", "pauses")

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.closed_at: float | None = None
        self.paused_seconds = 0.0
        self.pauses = 0

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self, at: float) -> None:
        if self._open.is_set():
            self._open.clear()
            self.closed_at = at
            self.pauses += 1

    def open(self, at: float) -> float:
        """Open; returns how long it was closed (0 when it was open)."""
        if self._open.is_set() or self.closed_at is None:
            return 0.0
        closed_for = max(0.0, at - self.closed_at)
        self.paused_seconds += closed_for
        self.closed_at = None
        self._open.set()
        return closed_for

    async def wait(self) -> None:
        """Return when the gate is open (immediately when it is)."""
        if not self._open.is_set():
            await self._open.wait()


def shift_deadlines(timeouts: Any, by: float) -> None:
    """Push every armed ``asyncio.Timeout`` in ``timeouts`` back by ``by`` seconds."""
    if by <= 0:
        return
    for t in list(timeouts):
        when = t.when()
        if when is not None and not t.expired():
            t.reschedule(when + by)


class PauseController:
    """Pauses one backend and the turns of the episodes that use it.

    ``views`` is called (on the event loop, while paused) to describe the episodes whose
    generation is in flight; the policy function turns each into a resume policy.
    """

    def __init__(
        self,
        backend: Backend,
        views: Callable[[], list[EpisodeView]] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.gate = PauseGate()
        self.timeouts: set[asyncio.Timeout] = set()
        self._views = views or (lambda: [])
        self._clock = clock
        self._lock = asyncio.Lock()
        self.policy: PolicyFn = fixed_policy("keep")
        self.last_policies: dict[str, ResumePolicy] = {}
        self.durations: list[float] = []  # seconds each pause lasted

    @property
    def paused(self) -> bool:
        return not self.gate.is_open

    async def pause(self, policy: ResumePolicy | PolicyFn = "keep") -> None:
        """Close the gate and stop the backend at a token boundary.  Idempotent."""
        fn = as_policy_fn(policy)
        async with self._lock:
            self.policy = fn
            if self.paused:
                return
            self.gate.close(self._clock())
            try:
                await self.backend.pause("keep")
            except BaseException:
                self.gate.open(self._clock())
                raise

    def policies(self, target_version: int | None = None) -> dict[str, ResumePolicy]:
        """The resume policy of every in-flight request, by request id."""
        out: dict[str, ResumePolicy] = {}
        for view in self._views():
            if target_version is not None:
                view = msgspec.structs.replace(view, target_version=target_version)
            out[view.request_id] = check_policy(self.policy(view))
        return out

    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> float:
        """Resume the backend (each request under its policy) and reopen the gate; returns
        the seconds spent paused.  Idempotent."""
        async with self._lock:
            if not self.paused:
                return 0.0
            chosen = dict(policies) if policies is not None else self.policies()
            self.last_policies = chosen
            await self.backend.resume(chosen)
            closed_for = self.gate.open(self._clock())
            shift_deadlines(self.timeouts, closed_for)
            self.durations.append(closed_for)
            return closed_for


__all__ = [
    "RESUME_POLICIES",
    "EpisodeView",
    "PauseController",
    "PauseGate",
    "PolicyFn",
    "as_policy_fn",
    "check_policy",
    "fixed_policy",
    "shift_deadlines",
    "staleness_policy",
]
