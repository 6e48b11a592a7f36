"""Engine-level pause: quiesce every in-flight episode for a weight sync, then resume.

Invariants (DESIGN.md 3, 4): environment code never sees a pause (its ``await`` just takes
longer); a sync never makes an episode or a generation time out; the policy of every paused
request is explicit (``keep``, ``recompute`` or ``restart``); pause/resume are idempotent and
serialised; the gate, the policies and the deadline arithmetic are pure logic with no I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

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


def freeze_deadlines(
    timeouts: Iterable[asyncio.Timeout], now: float
) -> dict[asyncio.Timeout, float]:
    """Disarm every armed, unexpired ``asyncio.Timeout`` in ``timeouts``; returns the seconds
    each had left at ``now`` (loop time).  A disarmed timeout cannot fire while paused."""
    frozen: dict[asyncio.Timeout, float] = {}
    for t in list(timeouts):
        when = t.when()
        if when is not None and not t.expired():
            frozen[t] = when - now
            t.reschedule(None)
    return frozen


def thaw_deadlines(frozen: Mapping[asyncio.Timeout, float], now: float) -> None:
    """Re-arm each timeout ``freeze_deadlines`` disarmed, with the time it had left."""
    for t, left in frozen.items():
        if t.when() is None and not t.expired():
            t.reschedule(now + left)


class PauseController:
    """Pauses one backend and the turns of the episodes that use it.

    ``views`` is called (on the event loop, while paused) to describe the episodes whose
    generation is in flight; the policy function turns each into a resume policy.

    The rollout engine owns one.  ``pause`` closes the turn gate (no episode starts a new
    generation) and pauses the backend, which stops every generation at a token boundary; tool
    calls already running go on and their results are kept.  ``resume`` resumes the backend
    with a resume policy per request (chosen per episode by a ``PolicyFn``) and reopens the
    gate.  Every tracked deadline is frozen while paused (disarmed at ``pause``, re-armed at
    ``resume`` with the time it had left), however long the sync lasts.
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
        self.timeouts: set[asyncio.Timeout] = set()  # register with track() / untrack()
        self._frozen: dict[asyncio.Timeout, float] = {}
        self._views = views or (lambda: [])
        self._clock = clock
        self._lock = asyncio.Lock()
        self.policy: PolicyFn = fixed_policy("keep")
        self.last_policies: dict[str, ResumePolicy] = {}
        self.durations: list[float] = []  # seconds each pause lasted

    @property
    def paused(self) -> bool:
        return not self.gate.is_open

    def track(self, timeout: asyncio.Timeout) -> None:
        """Exclude paused time from an entered ``asyncio.Timeout`` (frozen now if paused)."""
        self.timeouts.add(timeout)
        if self.paused:
            self._frozen.update(freeze_deadlines((timeout,), asyncio.get_running_loop().time()))

    def untrack(self, timeout: asyncio.Timeout) -> None:
        """Forget a timeout (call before or right after leaving its ``async with``)."""
        self.timeouts.discard(timeout)
        self._frozen.pop(timeout, None)

    async def pause(self, policy: ResumePolicy | PolicyFn = "keep") -> None:
        """Close the gate and stop the backend at a token boundary.  Idempotent."""
        fn = as_policy_fn(policy)
        async with self._lock:
            self.policy = fn
            if self.paused:
                return
            self.gate.close(self._clock())
            loop = asyncio.get_running_loop()
            # frozen before awaiting the backend: its step in flight may take a while
            self._frozen = freeze_deadlines(self.timeouts, loop.time())
            try:
                await self.backend.pause("keep")
            except BaseException:
                thaw_deadlines(self._frozen, loop.time())
                self._frozen = {}
                self.gate.open(self._clock())
                raise

    def policies(
        self, target_version: int | None = None, policy: PolicyFn | None = None
    ) -> dict[str, ResumePolicy]:
        """The resume policy of every in-flight request, by request id, under ``policy``
        (default: the one given to ``pause``)."""
        choose = policy or self.policy
        out: dict[str, ResumePolicy] = {}
        for view in self._views():
            if target_version is not None:
                view = msgspec.structs.replace(view, target_version=target_version)
            out[view.request_id] = check_policy(choose(view))
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
            thaw_deadlines(self._frozen, asyncio.get_running_loop().time())
            self._frozen = {}
            closed_for = self.gate.open(self._clock())
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
    "freeze_deadlines",
    "staleness_policy",
    "thaw_deadlines",
]
