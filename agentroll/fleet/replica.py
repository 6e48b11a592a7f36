"""Replicas: one generation engine each, behind one async interface (``Replica``).

Invariants: a replica's ``version`` is the version its next token is sampled with and
changes only inside ``apply``/``swap``/``wake``, while paused; streams follow the Backend chunk
contract (agentroll.backends.base); ``busy_seconds`` only grows; a replica that raised
``ReplicaDown`` is never used again.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from agentroll.backends.base import (
    Backend,
    GenerationChunk,
    GenerationRequest,
    ReportsBusy,
    ReportsInflight,
    ResumePolicy,
    SupportsAbort,
    SupportsSleep,
    SupportsSnapshot,
    SupportsSnapshotMany,
    SupportsStaging,
)
from agentroll.errors import BackendError
from agentroll.types import SleepReport, WakeReport

if TYPE_CHECKING:
    from agentroll.chat import ChatTokenizer
    from agentroll.weights.update import WeightUpdate


class ReplicaDown(BackendError):
    """The replica is gone (its process died or it was killed); its calls move elsewhere."""


class Replica(abc.ABC):
    """A generation engine the fleet can route to, pause, update and migrate from.

    The router and the update strategies talk to ``Replica`` only, so the same fleet code drives
    replicas in this process (``LocalReplica`` over any ``Backend``) and replicas in Ray actors
    (``agentroll.fleet.ray.RayReplica``).  ``apply``/``swap`` run while the replica is paused,
    so no forward pass mixes two versions; ``busy_seconds`` counts wall time spent in forward
    passes.
    """

    name: str = "replica"

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version new tokens are sampled with (cached, no round trip)."""

    @property
    def supports_snapshots(self) -> bool:
        """Whether ``snapshot``/``restore`` work (requests can migrate with their KV)."""
        return False

    @property
    def can_hold_kv(self) -> bool:
        """Whether this replica's snapshots can hold their KV for an in-process move."""
        return False

    @property
    def tokenizer(self) -> ChatTokenizer | None:
        """The model's tokenizer, when this process holds it."""
        return None

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load the model."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine.  Idempotent."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream ``request``'s tokens (raises ``ReplicaDown`` if the replica dies)."""

    def restore(self, snapshot: Any) -> AsyncIterator[GenerationChunk]:
        """Continue a request from a ``RequestSnapshot``."""
        raise BackendError(f"replica {self.name} cannot restore snapshots")

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop at a token boundary; in-flight requests wait (their KV is kept)."""

    @abc.abstractmethod
    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> None:
        """Continue; each request under its policy in ``policies`` (default ``keep``)."""

    @abc.abstractmethod
    async def apply(self, update: WeightUpdate) -> int:
        """Apply a ``WeightUpdate`` while paused; returns the new version."""

    async def snapshot(self, request_id: str, *, with_kv: bool = True) -> Any:
        """A ``RequestSnapshot`` of a paused request."""
        raise BackendError(f"replica {self.name} cannot snapshot requests")

    async def snapshot_many(
        self, request_ids: list[str], *, with_kv: bool = True
    ) -> dict[str, Any]:
        """Snapshots of several paused requests (those still unfinished), in one go."""
        out = {}
        for rid in request_ids:
            try:
                out[rid] = await self.snapshot(rid, with_kv=with_kv)
            except ReplicaDown:
                raise
            except Exception:
                continue  # finished meanwhile
        return out

    async def abort(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Drop a request (after its snapshot was taken, when migrating)."""

    async def inflight(self) -> dict[str, int]:
        """Generated-token count of every unfinished request."""
        return {}

    async def stage(self, update: WeightUpdate, *, max_bytes: int | None = None) -> None:
        """Load ``update`` into a second copy while generating (background strategy)."""
        raise BackendError(f"replica {self.name} cannot stage updates in the background")

    async def swap(self) -> int:
        """Install the staged update at a token boundary; returns the new version."""
        raise BackendError(f"replica {self.name} cannot stage updates in the background")

    async def sleep(
        self, level: int = 1, policies: Mapping[str, ResumePolicy] | None = None
    ) -> SleepReport:
        """Release the engine's KV cache (level 1) and weights (level 2); see
        ``SupportsSleep``."""
        raise BackendError(f"replica {self.name} cannot sleep (its backend has no sleep mode)")

    async def wake(
        self,
        update: WeightUpdate | None = None,
        *,
        fallback: bool = False,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> WakeReport:
        """Wake after ``sleep``, installing ``update``."""
        raise BackendError(f"replica {self.name} cannot sleep (its backend has no sleep mode)")

    async def busy_seconds(self) -> float:
        """Wall time spent in forward passes so far."""
        return 0.0

    async def steps(self) -> int:
        """Forward passes (engine steps) so far."""
        return 0

    async def generating_seconds(self) -> float:
        """Wall time spent serving requests (not paused, requests in the engine) so far."""
        return 0.0


class LocalReplica(Replica):
    """A replica in this process over a ``Backend`` (``TorchBackend`` for every feature;
    any backend with pause/resume/apply for the basic ones)."""

    def __init__(self, backend: Backend, name: str = "local") -> None:
        self.backend = backend
        self.name = name
        self._version = backend.policy_version
        self._dead: str | None = None

    @property
    def version(self) -> int:
        return self._version

    @property
    def supports_snapshots(self) -> bool:
        return isinstance(self.backend, SupportsSnapshot)

    @property
    def tokenizer(self) -> ChatTokenizer | None:
        return self.backend.tokenizer

    async def start(self) -> None:
        await self.backend.start()
        self._version = self.backend.policy_version

    async def close(self) -> None:
        await self.backend.close()

    def kill(self, reason: str = "killed") -> None:
        """Fault injection: every call from now on raises ``ReplicaDown``, as a dead actor
        would; streams in flight fail at their next token."""
        self._dead = reason

    def _check(self) -> None:
        if self._dead is not None:
            raise ReplicaDown(f"replica {self.name} is down ({self._dead})")

    async def _guard(
        self, stream: AsyncIterator[GenerationChunk]
    ) -> AsyncIterator[GenerationChunk]:
        self._check()
        try:
            async for chunk in stream:
                self._check()
                yield chunk
        finally:
            aclose = getattr(stream, "aclose", None)  # an async generator's, when it is one
            if aclose is not None:
                await aclose()

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        return self._guard(self.backend.generate(request))

    def restore(self, snapshot: Any) -> AsyncIterator[GenerationChunk]:
        if not isinstance(self.backend, SupportsSnapshot):
            raise BackendError(f"backend {self.backend.name} cannot restore snapshots")
        return self._guard(self.backend.restore(snapshot))

    async def pause(self) -> None:
        self._check()
        await self.backend.pause("keep")

    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> None:
        self._check()
        await self.backend.resume(policies)

    async def apply(self, update: WeightUpdate) -> int:
        self._check()
        await self.backend.apply(update)
        self._version = self.backend.policy_version
        return self._version

    async def snapshot(self, request_id: str, *, with_kv: bool = True) -> Any:
        self._check()
        if not isinstance(self.backend, SupportsSnapshot):
            raise BackendError(f"backend {self.backend.name} cannot snapshot requests")
        return await self.backend.snapshot(request_id, with_kv=with_kv)

    async def snapshot_many(
        self, request_ids: list[str], *, with_kv: bool = True, hold_kv: bool = False
    ) -> dict[str, Any]:
        """As ``Replica.snapshot_many``; ``hold_kv`` (a backend that can, in-process moves
        only): the KV stays held here and the replica that restores a snapshot reads it."""
        if not isinstance(self.backend, SupportsSnapshotMany):
            return await super().snapshot_many(request_ids, with_kv=with_kv)
        self._check()
        return dict(await self.backend.snapshot_many(request_ids, with_kv=with_kv, hold_kv=hold_kv))

    @property
    def can_hold_kv(self) -> bool:
        """Whether this replica's snapshots can hold their KV for an in-process move."""
        return isinstance(self.backend, SupportsSnapshotMany)

    async def abort(self, request_id: str) -> None:
        if self._dead is None and isinstance(self.backend, SupportsAbort):
            await self.backend.abort(request_id)

    async def inflight(self) -> dict[str, int]:
        self._check()
        if isinstance(self.backend, ReportsInflight):
            return dict(self.backend.inflight())
        return {}

    async def stage(self, update: WeightUpdate, *, max_bytes: int | None = None) -> None:
        self._check()
        if not isinstance(self.backend, SupportsStaging):
            await super().stage(update)
        else:
            await self.backend.stage(update, max_bytes=max_bytes)

    async def swap(self) -> int:
        self._check()
        if not isinstance(self.backend, SupportsStaging):
            return await super().swap()
        self._version = int(await self.backend.swap())
        return self._version

    async def sleep(
        self, level: int = 1, policies: Mapping[str, ResumePolicy] | None = None
    ) -> SleepReport:
        self._check()
        if not isinstance(self.backend, SupportsSleep):
            return await super().sleep(level, policies)
        return await self.backend.sleep(level, policy="keep", policies=policies)

    async def wake(
        self,
        update: WeightUpdate | None = None,
        *,
        fallback: bool = False,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> WakeReport:
        self._check()
        if not isinstance(self.backend, SupportsSleep):
            return await super().wake(update, fallback=fallback, policies=policies)
        report = await self.backend.wake(update, fallback=fallback, policies=policies)
        self._version = self.backend.policy_version
        return report

    async def busy_seconds(self) -> float:
        return float(self.backend.busy_seconds) if isinstance(self.backend, ReportsBusy) else 0.0

    async def steps(self) -> int:
        return int(self.backend.steps) if isinstance(self.backend, ReportsBusy) else 0

    async def generating_seconds(self) -> float:
        if isinstance(self.backend, ReportsBusy):
            return float(self.backend.generating_seconds)
        return 0.0


__all__ = ["LocalReplica", "Replica", "ReplicaDown"]
