"""Trajectory buffer between rollout episodes and the trainer (admission: agentroll.rollout.admission).

Invariants: nothing is lost (put + restored = acked + dropped_stale + queued + leased);
groups are handed out whole, FIFO; with ``on_stale="drop"`` no trajectory is handed out more
than ``max_staleness`` versions stale; held trajectories never exceed ``capacity`` except
through ``restore``.  Pure logic on asyncio primitives, an injected clock; no I/O, no threads.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from agentroll.errors import ConfigError
from agentroll.types import Trajectory, new_id

Clock = Callable[[], float]


class BufferConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Static settings of a ``TrajectoryBuffer``; invalid values raise ``ConfigError``."""

    capacity: int = 1024  # trajectories held (queued + leased); producers wait beyond it
    max_staleness: int | None = 1  # None: no bound (fully async); 0: on-policy
    on_stale: Literal["drop", "keep"] = "drop"  # keep: hand out anyway, counted as kept_stale
    group_size: int = 1  # samples per task; a group is released whole
    lease_ttl: float = 60.0  # seconds before an unacknowledged lease is offered again

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int):
            raise ConfigError(f"BufferConfig.capacity must be an int, got {self.capacity!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ConfigError(f"BufferConfig.group_size must be an int, got {self.group_size!r}")
        if self.group_size < 1:
            raise ConfigError(f"BufferConfig.group_size must be >= 1, got {self.group_size}")
        if self.capacity < self.group_size:
            raise ConfigError(
                f"BufferConfig.capacity ({self.capacity}) must be >= group_size "
                f"({self.group_size}), or no group would ever fit; raise capacity"
            )
        if self.max_staleness is not None and (
            isinstance(self.max_staleness, bool)
            or not isinstance(self.max_staleness, int)
            or self.max_staleness < 0
        ):
            raise ConfigError(
                f"BufferConfig.max_staleness must be None (no bound) or an int >= 0, "
                f"got {self.max_staleness!r}"
            )
        if self.on_stale not in ("drop", "keep"):
            raise ConfigError(
                f"BufferConfig.on_stale must be 'drop' or 'keep', got {self.on_stale!r}"
            )
        if not (isinstance(self.lease_ttl, int | float) and 0 < self.lease_ttl < math.inf):
            raise ConfigError(
                f"BufferConfig.lease_ttl must be a finite number of seconds > 0, "
                f"got {self.lease_ttl!r}"
            )


class Lease(msgspec.Struct, kw_only=True):
    """What one ``lease()`` hands out: whole groups, in FIFO order."""

    id: str
    trajectories: list[Trajectory]
    expires_at: float  # on the buffer's clock
    trainer_version: int  # the version staleness was checked against


class BufferStats(msgspec.Struct, kw_only=True):
    """A snapshot of a buffer; trajectory counts unless the name says otherwise."""

    queued: int
    leased: int
    capacity: int
    put: int  # accepted by put/try_put (stale ones dropped at once included)
    acked: int
    expired_leases: int  # leases (not trajectories) that expired
    dropped_stale: int
    kept_stale: int
    put_wait_seconds: float  # total time producers waited in put (buffer clock)
    staleness: dict[int, int]  # staleness at each hand-out -> count (sampled trajectories)
    trainer_version: int
    restored: int = 0  # accepted by restore
    waiting_producers: int = 0
    open_leases: int = 0


@dataclass(slots=True, eq=False)  # identity: deque.remove must find this very group
class _Group:
    seq: int  # put order; expired leases go back in this order
    group_id: str
    items: list[Trajectory]
    versions: list[int]  # min_policy_version of each item (-1: nothing sampled)
    lease_id: str | None = None
    handed_out: bool = False  # was in a lease once: a late ack still counts
    kept: bool = False  # found stale with on_stale="keep" (counted once)

    def min_version(self) -> int:
        sampled = [v for v in self.versions if v >= 0]
        return min(sampled) if sampled else -1


@dataclass(slots=True)
class _LeaseState:
    id: str
    groups: list[_Group]
    expires_at: float


@dataclass(slots=True)
class _Notifier:
    """An edge-triggered wake-up: waiters grab ``event`` and ``fire`` replaces it."""

    event: asyncio.Event = field(default_factory=asyncio.Event)

    def fire(self) -> None:
        self.event.set()
        self.event = asyncio.Event()


class TrajectoryBuffer:
    """Bounded FIFO of trajectory groups with leases, acks and a strict staleness bound.

    ``on_drop`` is called with the trajectories of each group dropped as stale (e.g. to
    move them to the spool's dropped segment); it runs after the buffer's state is
    consistent.

    It holds finished groups (all samples of one task) until a trainer leases and acknowledges
    them; a group is never split across leases.  Stale means ``trainer_version - min
    policy_version > max_staleness``; held trajectories are queued + leased.
    """

    def __init__(
        self,
        config: BufferConfig,
        *,
        clock: Clock = time.monotonic,
        on_drop: Callable[[list[Trajectory]], None] | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._on_drop = on_drop
        self._queue: deque[_Group] = deque()
        self._leases: dict[str, _LeaseState] = {}
        self._index: dict[str, _Group] = {}  # id of every held trajectory -> its group
        self._seq = itertools.count()
        self._put_waiters: deque[object] = deque()
        self._data = _Notifier()
        self._space = _Notifier()
        self._trainer_version = 0
        self._num_queued = 0
        self._num_leased = 0
        self._put = self._restored = self._acked = self._expired = 0
        self._dropped = self._kept = 0
        self._put_wait = 0.0
        self._hist: dict[int, int] = {}

    def __len__(self) -> int:
        """Trajectories held (queued + leased): what ``capacity`` bounds."""
        return self._num_queued + self._num_leased

    # -- producers -------------------------------------------------------------------------

    async def put(self, group: Sequence[Trajectory]) -> None:
        """Add one group (``group_size`` trajectories sharing a ``group_id``), waiting while
        it does not fit; producers are served in arrival order.

        Raises ValueError for a malformed group or an id already held.  On cancellation
        while waiting, nothing of the group is inserted.  A group already stale is dropped
        at once (counted, ``on_drop`` called) under ``on_stale="drop"``.
        """
        g = self._make_group(group, exact=True)
        if not self._put_waiters and self._fits(len(g.items)):
            self._insert(g)
            self._put += len(g.items)
            return
        token = object()
        self._put_waiters.append(token)
        start = self._clock()
        try:
            while True:
                event = self._space.event
                if self._put_waiters[0] is token and self._fits(len(g.items)):
                    break
                await event.wait()
        finally:
            self._put_waiters.remove(token)
            self._put_wait += self._clock() - start
            self._space.fire()  # the next producer in line may fit now
        self._insert(g)  # no await since the check: the space is still there
        self._put += len(g.items)

    def try_put(self, group: Sequence[Trajectory]) -> bool:
        """Add one group if it fits now and no producer is waiting; returns whether it did.
        Raises ValueError like ``put``."""
        g = self._make_group(group, exact=True)
        if self._put_waiters or not self._fits(len(g.items)):
            return False
        self._insert(g)
        self._put += len(g.items)
        return True

    def restore(self, groups: Iterable[Sequence[Trajectory]]) -> int:
        """Queue groups recovered from a spool at start-up, without waiting and beyond
        ``capacity`` if need be.  A group may be partial (1..group_size trajectories: some
        were acknowledged before the restart).  Stale groups are handled as in ``put``.
        Restored groups count as handed out: a trainer may hold them from a lease before the
        restart, and its ack takes them out of the buffer as it takes them out of the spool.

        Returns how many trajectories were accepted; raises ValueError like ``put``.
        """
        made = [self._make_group(group, exact=False) for group in groups]
        total = 0
        for g in made:
            g.handed_out = True
            self._insert(g)
            total += len(g.items)
        self._restored += total
        return total

    # -- trainer ---------------------------------------------------------------------------

    def set_trainer_version(self, version: int) -> None:
        """Record the trainer's version and re-check queued groups against it: stale groups
        are dropped (``on_drop``, counted) or marked kept.  Raises ValueError when the
        version goes backwards (versions are monotonic)."""
        if version < self._trainer_version:
            raise ValueError(
                f"trainer version went back from {self._trainer_version} to {version}; "
                "trainer versions must not decrease"
            )
        if version == self._trainer_version:
            return
        self._trainer_version = version
        keep: deque[_Group] = deque()
        dropped: list[_Group] = []
        for g in self._queue:
            (dropped if self._check_stale(g) else keep).append(g)
        if dropped:
            self._queue = keep
            self._forget(dropped)
        self._call_on_drop(dropped)

    def try_lease(
        self, max_trajectories: int, *, trainer_version: int | None = None
    ) -> Lease | None:
        """``lease`` without waiting: None when nothing can be handed out now."""
        if max_trajectories < 1:
            raise ValueError(f"max_trajectories must be >= 1, got {max_trajectories}")
        if trainer_version is not None and trainer_version > self._trainer_version:
            self.set_trainer_version(trainer_version)
        self.expire()
        taken: list[_Group] = []
        dropped: list[_Group] = []
        count = 0
        while self._queue:
            g = self._queue[0]
            if self._check_stale(g):
                self._queue.popleft()
                dropped.append(g)
                continue
            if taken and count + len(g.items) > max_trajectories:
                break
            self._queue.popleft()
            taken.append(g)
            count += len(g.items)
        self._forget(dropped)
        lease = None
        if taken:
            lease = self._hand_out(taken, count)
        self._call_on_drop(dropped)
        return lease

    async def lease(
        self,
        max_trajectories: int,
        *,
        timeout: float | None = None,
        trainer_version: int | None = None,
    ) -> Lease | None:
        """Hand out whole groups, FIFO, up to ``max_trajectories`` (at least one group even
        if it is bigger), waiting up to ``timeout`` seconds (event-loop time; None: forever)
        for one.  Leases past their ttl are re-offered first (``expire``).

        ``trainer_version`` above the one set is recorded (``set_trainer_version``);
        staleness is checked against the resulting version.  Returns None on timeout;
        raises ValueError when ``max_trajectories < 1``.  Cancellation hands out nothing.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            event = self._data.event
            got = self.try_lease(max_trajectories, trainer_version=trainer_version)
            if got is not None:
                return got
            wait = None if deadline is None else deadline - loop.time()
            if wait is not None and wait <= 0:
                return None
            if self._leases:  # wake up when the next lease expires (its groups come back)
                nxt = min(s.expires_at for s in self._leases.values()) - self._clock()
                wait = nxt if wait is None else min(wait, nxt)
            try:
                async with asyncio.timeout(wait):
                    await event.wait()
            except TimeoutError:
                pass

    def ack(self, ids: Iterable[str]) -> int:
        """Acknowledge handed-out trajectories: they leave the buffer and free capacity
        (waking producers).  Ids that are unknown, acknowledged already or never handed
        out are ignored.  A late ack of a trajectory whose lease expired still counts.
        The rest of a partly acknowledged lease stays leased.  Returns how many left."""
        num = 0
        for tid in ids:
            g = self._index.get(tid)
            if g is None or not g.handed_out:
                continue
            del self._index[tid]
            i = next(i for i, t in enumerate(g.items) if t.id == tid)
            del g.items[i]
            del g.versions[i]
            num += 1
            if g.lease_id is not None:
                self._num_leased -= 1
                if not g.items:
                    state = self._leases[g.lease_id]
                    state.groups.remove(g)
                    if not state.groups:
                        del self._leases[state.id]
            else:
                self._num_queued -= 1
                if not g.items:
                    self._queue.remove(g)
        if num:
            self._acked += num
            self._space.fire()
        return num

    def expire(self) -> int:
        """Put the groups of every lease past its ttl back at the front of the queue, in
        their original put order (before every group put after them), re-checking their
        staleness.  Returns how many leases expired."""
        now = self._clock()
        expired = [s for s in self._leases.values() if now >= s.expires_at]
        if not expired:
            return 0
        groups = sorted((g for s in expired for g in s.groups), key=lambda g: g.seq)
        for s in expired:
            del self._leases[s.id]
        back: list[_Group] = []
        dropped: list[_Group] = []
        for g in groups:
            g.lease_id = None
            self._num_leased -= len(g.items)
            self._num_queued += len(g.items)
            (dropped if self._check_stale(g) else back).append(g)
        # the queue stays in put order: these go back before every group put after them
        self._queue = deque(heapq.merge(back, self._queue, key=lambda g: g.seq))
        self._forget(dropped)
        self._expired += len(expired)
        if back:
            self._data.fire()
        self._call_on_drop(dropped)
        return len(expired)

    def statistics(self) -> BufferStats:
        """A snapshot of depths and counters."""
        return BufferStats(
            queued=self._num_queued,
            leased=self._num_leased,
            capacity=self.config.capacity,
            put=self._put,
            acked=self._acked,
            expired_leases=self._expired,
            dropped_stale=self._dropped,
            kept_stale=self._kept,
            put_wait_seconds=self._put_wait,
            staleness=dict(sorted(self._hist.items())),
            trainer_version=self._trainer_version,
            restored=self._restored,
            waiting_producers=len(self._put_waiters),
            open_leases=len(self._leases),
        )

    # -- internals -------------------------------------------------------------------------

    def _make_group(self, group: Sequence[Trajectory], *, exact: bool) -> _Group:
        items = list(group)
        size = self.config.group_size
        if (exact and len(items) != size) or not 1 <= len(items) <= size:
            want = f"exactly {size}" if exact else f"1 to {size}"
            raise ValueError(
                f"a group must hold {want} trajectories (BufferConfig.group_size), got {len(items)}"
            )
        gid = items[0].group_id
        if any(t.group_id != gid for t in items):
            raise ValueError(f"a group's trajectories must share one group_id ({gid!r})")
        if len({t.id for t in items}) != len(items):
            raise ValueError(f"group {gid!r} holds the same trajectory id twice")
        versions = [t.min_policy_version() for t in items]
        return _Group(seq=-1, group_id=gid, items=items, versions=versions)

    def _fits(self, num: int) -> bool:
        return self._num_queued + self._num_leased + num <= self.config.capacity

    def _insert(self, g: _Group) -> None:
        for t in g.items:
            if t.id in self._index:
                raise ValueError(f"trajectory {t.id!r} is already in the buffer")
        g.seq = next(self._seq)
        for t in g.items:
            self._index[t.id] = g
        self._num_queued += len(g.items)
        if self._check_stale(g):
            self._forget([g])
            self._call_on_drop([g])
            return
        self._queue.append(g)
        self._data.fire()

    def _check_stale(self, g: _Group) -> bool:
        """Whether the queued group ``g`` must be dropped now; marks (and counts) it kept
        when it breaks the bound under ``on_stale="keep"``."""
        k = self.config.max_staleness
        low = g.min_version()
        if k is None or low < 0 or self._trainer_version - low <= k:
            return False
        if self.config.on_stale == "drop":
            return True
        if not g.kept:
            g.kept = True
            self._kept += len(g.items)
        return False

    def _forget(self, dropped: list[_Group]) -> None:
        """Account for queued groups already taken out of the queue as stale."""
        for g in dropped:
            for t in g.items:
                del self._index[t.id]
            self._num_queued -= len(g.items)
            self._dropped += len(g.items)
        if dropped:
            self._space.fire()

    def _call_on_drop(self, dropped: list[_Group]) -> None:
        if self._on_drop is None:
            return
        error: BaseException | None = None
        for g in dropped:  # every group is reported even if one callback raises
            try:
                self._on_drop(list(g.items))
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    def _hand_out(self, groups: list[_Group], count: int) -> Lease:
        lease_id = new_id()
        expires_at = self._clock() + self.config.lease_ttl
        for g in groups:
            g.lease_id = lease_id
            g.handed_out = True
            for v in g.versions:
                if v >= 0:
                    s = self._trainer_version - v
                    self._hist[s] = self._hist.get(s, 0) + 1
        self._num_queued -= count
        self._num_leased += count
        self._leases[lease_id] = _LeaseState(lease_id, groups, expires_at)
        return Lease(
            id=lease_id,
            trajectories=[t for g in groups for t in g.items],
            expires_at=expires_at,
            trainer_version=self._trainer_version,
        )


__all__ = ["BufferConfig", "BufferStats", "Lease", "TrajectoryBuffer"]
