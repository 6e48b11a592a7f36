"""The Backend protocol: where tokens come from.

A backend turns a ``GenerationRequest`` (prompt token ids + sampling) into a stream of
``GenerationChunk``s.  Invariants: chunks carry exactly the sampled ids; every chunk's tokens
share one ``policy_version`` and one ``kv_version``; the last chunk has ``finish_reason``
set; ``logprobs`` are those of the distribution actually sampled from.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

import msgspec

from agentroll.errors import BackendError
from agentroll.types import (
    FinishReason,
    ResumePolicy,
    SamplingParams,
    SleepReport,
    Strategy,
    SyncReport,
    WakeReport,
)

if TYPE_CHECKING:
    from agentroll.chat import ChatTokenizer
    from agentroll.engine.snapshot import RequestSnapshot
    from agentroll.weights.update import WeightUpdate


class GenerationRequest(msgspec.Struct, kw_only=True):
    """One generation call: continue ``prompt_ids`` under ``sampling``."""

    request_id: str
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    episode_id: str = ""
    turn_index: int = 0
    group_id: str = ""  # the episode's group (its task's samples): a fleet keeps it together


class GenerationChunk(msgspec.Struct, kw_only=True):
    """Newly sampled tokens, with provenance.  ``finish_reason`` is set on the last chunk.
    ``rollback`` > 0 tells the consumer to drop that many previously streamed tokens of this
    request first (a ``restart`` resume regenerates the turn).

    A backend starts a new chunk when either version changes, so every chunk's tokens share
    one ``policy_version`` and one ``kv_version``.
    """

    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    kv_version: int
    finish_reason: FinishReason | None = None
    rollback: int = 0


class Backend(abc.ABC):
    """Base class of generation backends (mock, torch, vllm, http).

    Lifecycle: ``async with backend:`` (or ``start()`` / ``close()``).  ``generate`` may be
    called concurrently from many episodes.
    """

    name: str = "backend"
    #: the model's tokenizer and chat template, when the backend knows them (the engine
    #: renders prompts with it unless given one)
    tokenizer: ChatTokenizer | None = None

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """Version of the weights new tokens are sampled with."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load the model / connect."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources.  Idempotent."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the tokens sampled for ``request``.

        Raises ``BackendError`` on failure.  On cancellation the request is aborted in the
        backend and no further tokens are sampled for it.
        """

    async def pause(self, policy: ResumePolicy = "keep") -> None:
        """Stop sampling at a token boundary; in-flight requests wait.  Default: unsupported."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause")

    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> None:
        """Continue after ``pause``.  ``policies`` overrides the pause policy per request id
        (a request not named gets the policy given to ``pause``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume")

    async def apply(self, update: WeightUpdate) -> None:
        """Apply a ``WeightUpdate``.  Default: unsupported."""
        raise NotImplementedError(f"{type(self).__name__} cannot apply weight updates")

    def end_episode(self, episode_id: str) -> None:  # noqa: B027 - optional hook
        """The episode will send no more requests (routers drop its affinity and pin)."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---------------------------------------------------------------------------------------
# Capabilities beyond the base class.  A backend that has one subclasses its Protocol
# (so mypy checks the signatures); callers test for it with ``isinstance``.


@runtime_checkable
class SupportsSnapshot(Protocol):
    """Takes a paused request out (its tokens and, optionally, its KV) and continues it
    later, on this backend or another one of the same model."""

    async def snapshot(self, request_id: str, *, with_kv: bool = True) -> RequestSnapshot: ...

    def restore(self, snapshot: RequestSnapshot) -> AsyncIterator[GenerationChunk]: ...


@runtime_checkable
class SupportsSnapshotMany(SupportsSnapshot, Protocol):
    """Snapshots many requests in one call; with ``hold_kv`` the KV stays where it is until
    the backend that restores a snapshot (in this process) has read it."""

    async def snapshot_many(
        self, request_ids: list[str], *, with_kv: bool = True, hold_kv: bool = False
    ) -> dict[str, RequestSnapshot]: ...


@runtime_checkable
class SupportsSleep(Protocol):
    """Gives its memory back between rollout phases (colocated placement).

    ``sleep(1)`` releases the KV cache, ``sleep(2)`` the weights as well; requests in flight
    are paused first and parked (a ``keep`` request with its KV on the host, the others to
    be recomputed or restarted at wake, per ``policy`` / ``policies``).  ``wake(update)``
    installs the next version before generation continues (required after level 2 unless
    ``fallback``: the last good weights).  Generation requests made meanwhile wait."""

    @property
    def asleep(self) -> int: ...

    async def sleep(
        self,
        level: int = 1,
        *,
        policy: ResumePolicy | None = None,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> SleepReport: ...

    async def wake(
        self,
        update: WeightUpdate | None = None,
        *,
        fallback: bool = False,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> WakeReport: ...


def check_sleep(asleep: int, level: int, policy: ResumePolicy | None = None) -> None:
    """Refuse a ``sleep(level, policy=...)`` call on a backend at sleep level ``asleep``:
    ``BackendError`` when asleep already, ``ValueError`` for a bad level or policy."""
    if asleep:
        raise BackendError(
            f"the backend sleeps already (level {asleep}); `await backend.wake()` first"
        )
    if level not in (1, 2):
        raise ValueError(f"sleep level {level}: use 1 (KV cache) or 2 (KV cache and weights)")
    if policy is not None and policy not in ("keep", "recompute", "restart"):
        raise ValueError(f"unknown resume policy {policy!r}; use keep, recompute or restart")


def check_wake(asleep: int, update: WeightUpdate | None, fallback: bool) -> None:
    """Refuse (``BackendError``) a ``wake(update, fallback=...)`` call on a backend at sleep
    level ``asleep``: when awake, or after level 2 without an update or ``fallback``."""
    if not asleep:
        raise BackendError("the backend is awake; wake() follows `await backend.sleep()`")
    if asleep == 2 and update is None and not fallback:
        raise BackendError(
            "after sleep(2) the weights are released: `wake(update)` installs the next "
            "version, `wake(fallback=True)` the last good one"
        )


@runtime_checkable
class SupportsStaging(Protocol):
    """Verifies an update beside the live weights while generating, then swaps it in at a
    token boundary (the ``background`` strategy)."""

    async def stage(self, update: WeightUpdate, *, max_bytes: int | None = None) -> None: ...

    async def swap(self) -> int: ...


@runtime_checkable
class ReportsInflight(Protocol):
    """Tells how many tokens each unfinished request has generated."""

    def inflight(self) -> dict[str, int]: ...


@runtime_checkable
class SupportsAbort(Protocol):
    """Drops one request (its stream ends with ``finish_reason='abort'``)."""

    async def abort(self, request_id: str) -> None: ...


@runtime_checkable
class ReportsBusy(Protocol):
    """Accounts its time: engine steps, serving time, step count (fleet busy fraction)."""

    @property
    def busy_seconds(self) -> float: ...

    @property
    def generating_seconds(self) -> float: ...

    steps: int


@runtime_checkable
class UpdatesInRotation(Protocol):
    """Installs an update replica by replica with a strategy (a fleet); ``policies``, asked
    when each replica pauses, gives the resume policy of each of its requests in flight."""

    async def update(
        self,
        update: WeightUpdate,
        *,
        strategy: Strategy | None = None,
        policies: Callable[[], Mapping[str, ResumePolicy]] | None = None,
    ) -> SyncReport: ...
