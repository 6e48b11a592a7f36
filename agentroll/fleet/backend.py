"""A fleet of replicas behind the ``Backend`` protocol: routing, moving calls, weight updates.

Invariants: every call is served by exactly one replica at a time; the tokens a consumer
receives are never repeated or skipped when a call moves; a call is lost only when no
replica is left; a replica whose update failed keeps its old version and leaves the
rotation; nothing is routed to a replica that is not ``active``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from agentroll.backends.base import (
    Backend,
    GenerationChunk,
    GenerationRequest,
    ResumePolicy,
    SupportsSleep,
    UpdatesInRotation,
    check_sleep,
    check_wake,
)
from agentroll.errors import BackendError, ConfigError, WeightSyncError
from agentroll.fleet.replica import Replica, ReplicaDown
from agentroll.fleet.router import ReplicaStatus, Router
from agentroll.types import SleepReport, Strategy, SyncReport, WakeReport

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.fleet")

STRATEGIES: tuple[Strategy, ...] = ("pause", "rolling", "drain", "background")
PolicySource = Callable[[], Mapping[str, ResumePolicy]]


class FleetStats(msgspec.Struct, kw_only=True):
    calls: int = 0
    tokens: int = 0  # sampled tokens streamed to consumers
    migrated: int = 0
    failovers: int = 0
    tokens_discarded: int = 0  # delivered tokens a consumer was told to drop (restart)
    tokens_recomputed: int = 0  # tokens re-prefilled (recompute policy, moves without KV)
    pin_breaks: int = 0  # pinned episodes whose version disappeared from the fleet
    episodes_restarted: int = 0  # episodes with at least one dropped partial generation


class _Call:
    __slots__ = (
        "episode_id",
        "ids",
        "kv_version",
        "logprobs",
        "policy_version",
        "pump",
        "queue",
        "replica",
        "request",
    )

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.episode_id = request.episode_id or request.request_id
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.replica: Replica | None = None
        self.pump: asyncio.Task[None] | None = None
        self.ids: list[int] = []  # tokens pumped to the consumer (net of rollbacks)
        self.logprobs: list[float] = []
        self.policy_version = -1
        self.kv_version = -1

    @property
    def delivered(self) -> int:
        return len(self.ids)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)


def _release_hold(snapshot: Any) -> None:
    """Hand back the KV blocks a snapshot holds on its source replica (``hold_kv``), if
    any: a snapshot that will not be restored must not wait for the garbage collector
    (an exception's traceback, or a log record, may keep it for long)."""
    hold = getattr(snapshot, "kv_hold", None)
    if hold is not None:
        hold.release()


class FleetBackend(Backend, UpdatesInRotation, SupportsSleep):
    """``FleetBackend([LocalReplica(TorchBackend(m)), ...], strategy="rolling")``.

    ``pin_versions``: an episode stays on the version its first call got (the rolling
    strategy waits for pinned episodes before retiring their version).  ``in_flight``: what a
    rolling group does with calls in flight, ``migrate`` them (with their KV) or ``finish``
    them first.

    Each generation call goes to a replica (``agentroll.fleet.router``) and can move between
    replicas: migration with the KV, or failover from a dead replica by recomputing from the
    tokens already delivered.  Weights are updated with a strategy
    (``agentroll.fleet.strategies``) while episodes keep running.  One pump task per call copies
    the replica's stream into the call's queue; a move continues from the snapshot truncated to
    what was delivered, and sampling is counter-based, so the continuation is the same as
    staying.
    """

    name = "fleet"

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        strategy: Strategy = "pause",
        group_size: int = 1,
        in_flight: Literal["migrate", "finish"] = "migrate",
        drain_timeout: float = 5.0,
        pin_versions: bool = False,
        migrate_with_kv: bool = True,
        affinity_slack: int = 2,
        capacity: int = 64,
        background_max_bytes: int | None = None,
        stage_updates: bool = True,
        pin_timeout: float = 600.0,
    ) -> None:
        if not replicas:
            raise ConfigError("a fleet needs at least one replica")
        names = [r.name for r in replicas]
        if len(set(names)) != len(names):
            raise ConfigError(f"replica names must be unique, got {names}")
        if strategy not in STRATEGIES:
            raise ConfigError(f"unknown update strategy {strategy!r}; use one of {STRATEGIES}")
        if group_size < 1:
            raise ConfigError("group_size must be >= 1")
        self.replicas = {r.name: r for r in replicas}
        self.strategy: Strategy = strategy
        self.group_size = group_size
        if in_flight not in ("migrate", "finish"):
            raise ConfigError(f"in_flight must be 'migrate' or 'finish', not {in_flight!r}")
        if not drain_timeout >= 0:
            raise ConfigError("drain_timeout must be >= 0 seconds")
        self.in_flight = in_flight
        self.drain_timeout = drain_timeout
        self.pin_versions = pin_versions
        self.migrate_with_kv = migrate_with_kv
        # every replica in this process and able to: a moved call's KV is held where it was
        # and read by the replica it moves to, not copied out while its replica stands paused
        self.hold_kv = all(r.can_hold_kv for r in replicas)
        self.background_max_bytes = background_max_bytes
        self.stage_updates = stage_updates
        self.pin_timeout = pin_timeout
        self.router = Router(affinity_slack=affinity_slack)
        self._capacity = capacity
        self._calls: dict[str, _Call] = {}
        self._changed = asyncio.Event()
        self._update_lock = asyncio.Lock()
        self.stats = FleetStats()
        self.reports: list[SyncReport] = []
        self.paused_replicas: set[str] = set()
        self._restarted: set[str] = set()
        self.tokenizer = replicas[0].tokenizer
        self._asleep: dict[str, int] = {}  # replica -> sleep level

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        versions = self.router.versions(("active", "draining", "updating"))
        return max(versions) if versions else -1

    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas.values()))
        for r in self.replicas.values():
            if r.name not in self.router.slots:
                self.router.add(r.name, r.version, self._capacity)

    async def close(self) -> None:
        for call in list(self._calls.values()):
            if call.pump is not None:
                call.pump.cancel()
        await asyncio.gather(*(r.close() for r in self.replicas.values()), return_exceptions=True)

    def status(self, name: str) -> ReplicaStatus:
        return self.router.slots[name].status

    def _set_status(self, name: str, status: ReplicaStatus) -> None:
        if self.router.slots[name].status == "down":
            return
        self.router.set_status(name, status)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def calls_on(self, name: str) -> list[_Call]:
        return [c for c in self._calls.values() if c.replica is not None and c.replica.name == name]

    def end_episode(self, episode_id: str) -> None:
        self.router.forget(episode_id)
        self._notify()

    # -- membership (capacity that moves) ---------------------------------------------------

    async def add_replica(self, replica: Replica, weights: WeightUpdate | None = None) -> int:
        """Start ``replica`` and put it in rotation at the fleet's version: ``weights`` (a full
        update at that version) is applied first when the replica starts on other weights.
        Returns its version.  Raises ``ConfigError`` for a name already in the fleet,
        ``BackendError`` while the fleet sleeps, ``WeightSyncError`` when the replica would
        serve another version than the fleet (it is closed again; nothing else changed)."""
        if replica.name in self.replicas:
            raise ConfigError(f"replica name {replica.name!r} is already in the fleet")
        async with self._update_lock:
            if self._asleep:
                raise BackendError("the fleet is asleep; wake it before adding a replica")
            target = self.policy_version
            await replica.start()
            try:
                if weights is not None and weights.version != target:
                    raise WeightSyncError(
                        f"the weights for replica {replica.name} are version {weights.version}; "
                        f"the fleet serves {target}: pass a full update at {target}"
                    )
                version = replica.version
                if weights is not None:
                    await replica.pause()  # nothing runs on it yet: the pause is immediate
                    version = await replica.apply(weights)
                    await replica.resume()
                if target >= 0 and version != target:
                    raise WeightSyncError(
                        f"replica {replica.name} serves version {version} and the fleet {target}: "
                        f"pass the fleet's weights (a full update at {target})"
                    )
            except BaseException:
                with contextlib.suppress(Exception):
                    await replica.close()
                raise
            self.replicas[replica.name] = replica
            self.hold_kv = all(r.can_hold_kv for r in self.replicas.values())
            self.router.add(replica.name, version, self._capacity)
            self._notify()
            return version

    async def remove_replica(self, name: str, *, timeout: float = 60.0) -> Replica:
        """Take ``name`` out of the fleet: nothing new is routed to it, its calls move to the
        others with their KV where a replica can take it (recomputed otherwise; none is
        restarted), a call that may not move (pinned to a version only it serves) finishes
        there within ``timeout`` seconds or then moves recomputed; then the replica is closed
        and forgotten, and returned.  Raises ``ConfigError`` for an unknown name or the last
        replica in rotation, ``BackendError`` while the fleet sleeps."""
        async with self._update_lock:
            if name not in self.replicas:
                raise ConfigError(f"no replica {name!r} in the fleet ({sorted(self.replicas)})")
            if self._asleep:
                raise BackendError("the fleet is asleep; wake it before removing a replica")
            others = [n for n in self.router.active() if n != name]
            if not others:
                raise ConfigError(
                    f"replica {name} is the last one in rotation; add another before removing it"
                )
            replica = self.replicas[name]
            was_down = self.router.slots[name].status == "down"
            if not was_down:
                self._set_status(name, "draining")
                await self._evacuate(name)
            deadline = time.monotonic() + timeout
            while calls := self.calls_on(name):
                left = deadline - time.monotonic()
                if left <= 0:
                    for call in calls:  # the KV stays: recomputed from what was delivered
                        await self._failover(call, replica, is_down=False)
                    continue
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, 0.5))
            del self.replicas[name]
            self.paused_replicas.discard(name)
            self.router.remove(name)
            self.hold_kv = all(r.can_hold_kv for r in self.replicas.values())
            self._notify()
        with contextlib.suppress(Exception):
            await replica.close()
        return replica

    # -- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if request.request_id in self._calls:
            raise BackendError(f"request {request.request_id!r} is already streaming")
        call = _Call(request)
        self._calls[request.request_id] = call
        self.stats.calls += 1
        try:
            await self._launch(call, None)
            while True:
                item = await call.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            await self._drop(call)

    async def _drop(self, call: _Call) -> None:
        self._calls.pop(call.request.request_id, None)
        pump = call.pump
        if pump is not None and not pump.done():
            pump.cancel()
            with contextlib.suppress(BaseException):
                await pump
        if call.replica is not None:
            self.router.finished(call.replica.name)
            call.replica = None
            self._notify()

    async def _place(self, call: _Call, exclude: set[str] | None = None) -> Replica:
        """Wait for a replica that may take ``call`` and count it there."""
        exclude = exclude or set()
        while True:
            alive = [
                s
                for s in self.router.slots.values()
                if s.status not in ("down", "failed") and s.name not in exclude
            ]
            if not alive:
                raise BackendError(
                    "no replica is left in the fleet (all down or failed); "
                    "check the replica errors in the log"
                )
            pin = self.router.pinned_version(call.episode_id)
            if pin is not None and all(s.version != pin for s in alive):
                self.router.unpin(call.episode_id)  # its version is gone for good
                self.stats.pin_breaks += 1
            name = self.router.pick(
                call.episode_id,
                exclude,
                prefer_newest=self.pin_versions,
                group_id=call.request.group_id,
            )
            if name is not None:
                self.router.started(call.episode_id, name, group_id=call.request.group_id)
                replica = self.replicas[name]
                if self.pin_versions:
                    self.router.pin(call.episode_id, replica.version)
                return replica
            await self._changed.wait()

    async def _launch(self, call: _Call, snapshot: Any, exclude: set[str] | None = None) -> None:
        exclude = set(exclude or ())
        if snapshot is not None and call.policy_version >= 0:
            # A moved call goes to a replica at least as new as the weights that sampled its
            # last token (its versions never go back within a turn), when one may take it.
            older = {s.name for s in self.router.slots.values() if s.version < call.policy_version}
            if self.router.candidates(call.episode_id, exclude | older):
                exclude |= older
        replica = await self._place(call, exclude)
        if call.request.request_id not in self._calls:
            # its consumer left while a move waited for a replica: start nothing for nobody
            self.router.finished(replica.name)
            self._notify()
            return
        call.replica = replica
        if snapshot is not None:
            stream = replica.restore(snapshot)
        else:
            stream = replica.generate(call.request)
        with_kv = snapshot is not None and getattr(snapshot, "has_kv", False)
        call.pump = asyncio.create_task(self._pump(call, replica, stream, with_kv))

    async def _pump(
        self,
        call: _Call,
        replica: Replica,
        stream: AsyncIterator[GenerationChunk],
        restoring_kv: bool = False,
    ) -> None:
        try:
            async for chunk in stream:
                restoring_kv = False
                if chunk.rollback:
                    n = chunk.rollback
                    del call.ids[len(call.ids) - n :], call.logprobs[len(call.logprobs) - n :]
                    self._count_discard(call, n)
                call.ids.extend(chunk.token_ids)
                call.logprobs.extend(chunk.logprobs)
                self.stats.tokens += len(chunk.token_ids)
                call.policy_version, call.kv_version = chunk.policy_version, chunk.kv_version
                call.queue.put_nowait(chunk)
                if chunk.finish_reason is not None:
                    return
            call.queue.put_nowait(BackendError("replica stream ended without a finish_reason"))
        except asyncio.CancelledError:
            raise
        except ReplicaDown as exc:
            logger.warning("replica %s is down (%s); moving its calls", replica.name, exc)
            self._mark_down(replica.name)
            if call.replica is replica:
                asyncio.get_running_loop().call_soon(self._start_failover, call, replica)
        except BackendError as exc:
            if not restoring_kv:
                call.queue.put_nowait(exc)
                return
            # The target refused the moved KV (e.g. too few free blocks now): continue from
            # the delivered tokens instead, which it admits like any request, KV recomputed.
            logger.info("replica %s refused a snapshot (%s); recomputing it", replica.name, exc)
            asyncio.get_running_loop().call_soon(self._start_failover, call, replica, False)
        except BaseException as exc:
            call.queue.put_nowait(exc)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()

    def _mark_down(self, name: str) -> None:
        """The replica is gone: never route to it again and move every call it held (a
        paused replica, or one found dead by a control call, streams nothing that would
        tell its calls)."""
        if self.router.slots[name].status != "down":
            self.router.set_status(name, "down")
            self.paused_replicas.discard(name)
            self._notify()
            dead = self.replicas[name]
            for call in self.calls_on(name):
                asyncio.get_running_loop().call_soon(self._start_failover, call, dead)

    def _start_failover(self, call: _Call, dead: Replica, is_down: bool = True) -> None:
        if call.request.request_id not in self._calls or call.replica is not dead:
            return
        asyncio.get_running_loop().create_task(self._failover(call, dead, is_down))

    async def _failover(self, call: _Call, dead: Replica, is_down: bool = True) -> None:
        """Continue ``call`` on another replica (any, when ``dead`` is not down) from what
        it delivered (KV recomputed)."""
        if call.request.request_id not in self._calls or call.replica is not dead:
            return  # moved already (its pump and the replica's mark-down both asked)
        self.router.finished(dead.name)
        call.replica = None
        pump = call.pump
        if pump is not None and not pump.done():  # still waiting on the dead replica
            pump.cancel()
            with contextlib.suppress(BaseException):
                await pump
        if is_down:
            self.stats.failovers += 1
        try:
            snapshot = self._delivered_snapshot(call)
            if snapshot is None:  # no snapshot support: regenerate the turn
                self._roll_back(call)
            else:
                self.stats.tokens_recomputed += call.prompt_len + call.delivered
            await self._launch(call, snapshot)
        except BaseException as exc:
            call.queue.put_nowait(exc)

    def _delivered_snapshot(self, call: _Call) -> Any:
        if not any(r.supports_snapshots for r in self.replicas.values()):
            return None
        from agentroll.engine.snapshot import RequestSnapshot

        req = call.request
        return RequestSnapshot(
            request_id=req.request_id,
            token_ids=[*req.prompt_ids, *call.ids],
            num_prompt_tokens=call.prompt_len,
            num_computed_tokens=0,
            kv_version=max(call.kv_version, 0),
            min_kv_version=max(call.kv_version, 0),
            params=req.sampling,
            seed=req.sampling.seed or 0,
            logprobs=list(call.logprobs),
            block_size=0,
            model_fingerprint="",
        )

    async def migrate(
        self,
        call: _Call,
        exclude: set[str],
        *,
        with_kv: bool | None = None,
        restart: bool = False,
        snapshot: Any = None,
    ) -> bool:
        """Move a call off its (paused) replica onto another that may take it now; returns
        False when no other replica may (the call stays).  ``with_kv=False`` recomputes its
        KV there; ``restart`` drops its partial generation and starts it over (the
        baseline peers use), telling the consumer to roll back what it received.
        ``snapshot``: the call's snapshot, when the caller took it already (in bulk); a
        KV it holds on the source is handed back when the call does not move (else the
        target hands it back once it has read it)."""
        try:
            moved = await self._migrate(call, exclude, with_kv, restart, snapshot)
        except BaseException:
            _release_hold(snapshot)
            raise
        if not moved:
            _release_hold(snapshot)
        return moved

    async def _migrate(
        self,
        call: _Call,
        exclude: set[str],
        with_kv: bool | None,
        restart: bool,
        snapshot: Any,
    ) -> bool:
        src = call.replica
        if src is None or call.pump is None or call.pump.done():
            return False
        if not src.supports_snapshots:
            return False
        pin = self.router.pinned_version(call.episode_id)
        targets = [
            s
            for s in self.router.candidates(call.episode_id, exclude | {src.name})
            if pin is None or s.version == pin
        ]
        if not targets:
            return False
        if with_kv is None:
            with_kv = self.migrate_with_kv
        if restart:
            return await self._restart_elsewhere(call, src, exclude)
        snap = snapshot
        if snap is None:
            try:
                snap = await src.snapshot(call.request.request_id, with_kv=with_kv)
            except ReplicaDown:
                raise
            except KeyError:
                # the replica no longer knows it: it finished (its last chunk is on the way)
                return False
            except Exception:
                if call.pump.done():
                    return False  # it finished meanwhile
                raise
        pump = call.pump
        pump.cancel()
        with contextlib.suppress(BaseException):
            await pump
        if call.request.request_id not in self._calls:
            return False
        snap = snap.truncated(call.delivered)
        if snap.k is None and not with_kv:
            # its KV stays behind and is computed again there; asked for with its KV and
            # without any, the call had not been prefilled yet: moving it costs nothing
            self.stats.tokens_recomputed += call.prompt_len + call.delivered
        self.router.finished(src.name)
        call.replica = None
        self.stats.migrated += 1
        await self._launch(call, snap, exclude | {src.name})
        return True

    async def _restart_elsewhere(self, call: _Call, src: Replica, exclude: set[str]) -> bool:
        pump = call.pump
        if pump is not None:
            pump.cancel()
            with contextlib.suppress(BaseException):
                await pump
        if call.request.request_id not in self._calls:
            return False
        self._roll_back(call)
        self.router.finished(src.name)
        call.replica = None
        self.stats.migrated += 1
        await self._launch(call, None, exclude | {src.name})
        return True

    def _roll_back(self, call: _Call) -> None:
        """Tell the consumer to drop what the call delivered: it starts over."""
        if not call.delivered:
            return
        call.queue.put_nowait(
            GenerationChunk(
                token_ids=[],
                logprobs=[],
                policy_version=call.policy_version,
                kv_version=call.kv_version,
                rollback=call.delivered,
            )
        )
        self._count_discard(call, call.delivered)
        call.ids.clear()
        call.logprobs.clear()

    def _count_discard(self, call: _Call, n: int) -> None:
        self.stats.tokens_discarded += n
        if call.episode_id not in self._restarted:
            self._restarted.add(call.episode_id)
            self.stats.episodes_restarted += 1

    # -- pause / resume (engine-level pause of the whole fleet) -----------------------------

    async def pause_replica(self, name: str) -> None:
        """Pause one replica; one found dead is marked down (its calls move) instead."""
        try:
            await self.replicas[name].pause()
        except ReplicaDown as exc:
            logger.warning("replica %s is down (%s); moving its calls", name, exc)
            self._mark_down(name)
            return
        self.paused_replicas.add(name)

    async def resume_replica(
        self, name: str, policies: Mapping[str, ResumePolicy] | None = None
    ) -> None:
        if name not in self.paused_replicas:
            return
        if policies:
            for call in self.calls_on(name):
                if policies.get(call.request.request_id) == "recompute":
                    self.stats.tokens_recomputed += call.prompt_len + call.delivered
        try:
            await self.replicas[name].resume(policies)
        except ReplicaDown as exc:
            logger.warning("replica %s is down (%s); moving its calls", name, exc)
            self._mark_down(name)
        self.paused_replicas.discard(name)

    def _live(self) -> list[str]:
        return [n for n, s in self.router.slots.items() if s.status not in ("down",)]

    async def pause(self, policy: ResumePolicy = "keep") -> None:
        await asyncio.gather(*(self.pause_replica(n) for n in self._live()))

    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> None:
        await asyncio.gather(
            *(self.resume_replica(n, policies) for n in list(self.paused_replicas))
        )

    # -- sleep / wake (colocated placement) --------------------------------------------------

    @property
    def asleep(self) -> int:
        return max(self._asleep.values(), default=0)

    async def sleep(
        self,
        level: int = 1,
        *,
        policy: ResumePolicy | None = None,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> SleepReport:
        """Every live replica sleeps (in parallel); calls in flight stay where they are and
        continue at wake, each under ``policies[request_id]``, else ``policy``, else the
        replica's default.  The report sums the replicas'.  Raises ``BackendError`` when a
        replica cannot (those that slept are woken again on their weights)."""
        check_sleep(self.asleep, level, policy)
        if self._update_lock.locked():
            raise BackendError("a weight update is rolling through the fleet; sleep after it")
        if policy is not None:  # the default of every call in flight, ``policies`` first
            policies = {**dict.fromkeys(self._calls, policy), **(policies or {})}
        async with self._update_lock:
            names = self._live()
            got = await asyncio.gather(
                *(self.replicas[n].sleep(level, policies) for n in names), return_exceptions=True
            )
            failed = [
                (n, r) for n, r in zip(names, got, strict=True) if isinstance(r, BaseException)
            ]
            slept = [n for n, r in zip(names, got, strict=True) if not isinstance(r, BaseException)]
            if failed:
                for n in slept:
                    with contextlib.suppress(Exception):
                        await self.replicas[n].wake(fallback=True)
                n, exc = failed[0]
                raise BackendError(f"replica {n} cannot sleep: {exc}") from exc
            reports = [r for r in got if isinstance(r, SleepReport)]
            self._asleep = dict.fromkeys(names, level)
            return SleepReport(
                level=level,
                version=self.policy_version,
                freed_bytes=sum(r.freed_bytes for r in reports),
                kv_bytes=sum(r.kv_bytes for r in reports),
                weight_bytes=sum(r.weight_bytes for r in reports),
                kept_bytes=sum(r.kept_bytes for r in reports),
                parked=sum(r.parked for r in reports),
                seconds=max((r.seconds for r in reports), default=0.0),
            )

    async def wake(
        self,
        update: WeightUpdate | None = None,
        *,
        fallback: bool = False,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> WakeReport:
        """Every sleeping replica wakes with ``update``.  One that refuses it wakes on its
        last good weights and leaves the rotation (its calls move), as in ``update``; raises
        ``WeightSyncError`` when none took it (then all still sleep, as they were)."""
        check_wake(self.asleep, update, fallback)
        async with self._update_lock:
            names = list(self._asleep)
            got = await asyncio.gather(
                *(
                    self.replicas[n].wake(update, fallback=fallback, policies=policies)
                    for n in names
                ),
                return_exceptions=True,
            )
            ok = {n: r for n, r in zip(names, got, strict=True) if isinstance(r, WakeReport)}
            bad = {n: r for n, r in zip(names, got, strict=True) if not isinstance(r, WakeReport)}
            if bad and not ok and all(isinstance(r, WeightSyncError) for r in bad.values()):
                raise WeightSyncError(f"no replica took update at wake: {bad}")
            self._asleep = {}
            for n, r in ok.items():
                self.router.set_version(n, r.version)
            for n, exc in bad.items():
                logger.error("replica %s could not wake with the update: %s", n, exc)
                with contextlib.suppress(Exception):
                    await self.replicas[n].wake(fallback=True)
                self._set_status(n, "failed")
            self._notify()
        for n in bad:
            await self._evacuate(n)
        reports = list(ok.values())
        return WakeReport(
            level=max((r.level for r in reports), default=0),
            version=self.policy_version,
            updated=any(r.updated for r in reports),
            fallback=any(r.fallback for r in reports),
            restored=sum(r.restored for r in reports),
            seconds=max((r.seconds for r in reports), default=0.0),
            failed={n: f"{type(e).__name__}: {e}" for n, e in bad.items()},
        )

    async def inflight_calls(self) -> dict[str, int]:
        return {rid: c.delivered for rid, c in self._calls.items()}

    # -- weight updates --------------------------------------------------------------------

    async def apply(self, update: WeightUpdate) -> None:
        await self.update(update)

    async def update(
        self,
        update: WeightUpdate,
        *,
        strategy: Strategy | None = None,
        policies: PolicySource | None = None,
    ) -> SyncReport:
        """Install ``update`` on every replica in rotation with ``strategy`` (default: the
        fleet's); ``policies`` gives the resume policy of each in-flight request (default
        ``keep``).  Replicas whose update fails leave the rotation (``report.failed``) and
        their calls move to the others; raises ``WeightSyncError`` only when no replica took
        the update, and then every replica goes on serving the version it had."""
        from agentroll.fleet import strategies

        chosen = strategy or self.strategy
        if chosen not in STRATEGIES:
            raise ConfigError(f"unknown update strategy {chosen!r}; use one of {STRATEGIES}")
        async with self._update_lock:
            names = [n for n, s in self.router.slots.items() if s.status not in ("down", "failed")]
            if not names:
                raise WeightSyncError(
                    f"no replica is left to take update {update.version} (all down or failed)"
                )
            t_busy = time.perf_counter()
            busy0 = await self.replica_seconds(names)
            steps0 = await self.replica_seconds(names, "busy_seconds")
            t0 = time.perf_counter()
            report = SyncReport(strategy=chosen, version=update.version)
            migrated0, recomputed0 = self.stats.migrated, self.stats.tokens_recomputed
            try:
                await getattr(strategies, chosen)(self, update, names, report, policies)
            except BaseException:
                await self._recover(names)
                raise
            report.seconds = time.perf_counter() - t0
            busy1 = await self.replica_seconds(names)
            steps1 = await self.replica_seconds(names, "busy_seconds")
            # the same window brackets both samples of every replica (a remote replica's
            # sample takes a round trip), so the fraction is at most 1
            window = time.perf_counter() - t_busy
            alive = [n for n in names if n in busy1 and n in busy0]
            if alive and window > 0:
                span = len(alive) * window
                report.busy_fraction = sum(busy1[n] - busy0[n] for n in alive) / span
                alive = [n for n in alive if n in steps0 and n in steps1]
                report.step_fraction = sum(steps1[n] - steps0[n] for n in alive) / span
            report.migrated = self.stats.migrated - migrated0
            report.tokens_recomputed = self.stats.tokens_recomputed - recomputed0
            self.reports.append(report)
            self._notify()
            failed = [n for n in report.failed if self.router.slots[n].status == "failed"]
            if len(report.failed) == len(names):
                # Refused everywhere (a corrupt update, a wrong base): every replica kept its
                # weights, so the fleet goes on serving the old version rather than nothing.
                for n in failed:
                    self._set_status(n, "active")
                raise WeightSyncError(f"no replica took update {update.version}: {report.failed}")
            for n in failed:
                await self._evacuate(n)
            return report

    async def _recover(self, names: list[str]) -> None:
        """After a strategy broke off: resume what it paused and put what it took out of
        routing back (each replica serves the version it has), so the fleet is not wedged."""
        for n in names:
            if n in self.paused_replicas:
                with contextlib.suppress(Exception):
                    await self.resume_replica(n)
            if self.router.slots[n].status in ("draining", "updating"):
                self._set_status(n, "active")

    async def replica_seconds(
        self, names: list[str], what: str = "generating_seconds"
    ) -> dict[str, float]:
        """Per replica: seconds spent serving requests (default) or inside engine steps."""
        got = await asyncio.gather(
            *(getattr(self.replicas[n], what)() for n in names), return_exceptions=True
        )
        out = {}
        for n, busy in zip(names, got, strict=True):
            if isinstance(busy, ReplicaDown):
                continue
            if isinstance(busy, BaseException):
                raise busy
            out[n] = busy
        return out

    async def apply_on(
        self, name: str, update: WeightUpdate, report: SyncReport, *, staged: bool = False
    ) -> bool:
        """Apply on one paused replica (``staged``: install the copy ``stage`` verified
        earlier, a memcpy); on failure it keeps its old weights and leaves the rotation
        (status ``failed``); ``update`` moves its calls once the others are done."""
        replica = self.replicas[name]
        if self.router.slots[name].status == "down":  # found dead while pausing
            report.failed[name] = "down"
            return False
        try:
            version = await (replica.swap() if staged else replica.apply(update))
        except ReplicaDown as exc:
            report.failed[name] = f"down: {exc}"
            self._mark_down(name)
            return False
        except Exception as exc:
            report.failed[name] = f"{type(exc).__name__}: {exc}"
            logger.error("update %s failed on replica %s: %s", update.version, name, exc)
            self._set_status(name, "failed")
            return False
        self.router.set_version(name, version)
        return True

    async def _evacuate(self, name: str) -> None:
        """Move the calls of a replica that left the rotation to the active ones; a call
        with nowhere to go finishes where it is (on the weights it started with)."""
        calls = self.calls_on(name)
        if not calls:
            return
        await self.pause_replica(name)
        try:
            for call in calls:
                with contextlib.suppress(ReplicaDown):
                    await self.migrate(call, {name})
        finally:
            await self.resume_replica(name)


__all__ = ["STRATEGIES", "FleetBackend", "FleetStats", "Strategy", "SyncReport"]
