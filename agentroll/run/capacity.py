"""Carrying out the autoscaler's moves on a fleet and a trainer that run at once.

``CapacityMover`` measures each window's idle fractions (the replicas' serving seconds over
their replica-seconds; the trainer's step seconds over the window), asks the controller
(``agentroll.run.autoscale``) and carries out its decision: a replica added at the fleet's
version (a full update from the trainer) or removed (its calls migrate; none restarts), and
the trainer's thread count.  Invariants: a move is made between training steps only; a
move that fails leaves the capacity as it was, logged and recorded as failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from agentroll.run.autoscale import Autoscaler, Capacity, Decision

if TYPE_CHECKING:
    from agentroll.fleet.backend import FleetBackend
    from agentroll.fleet.replica import Replica
    from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.run.capacity")


class Window(msgspec.Struct, kw_only=True):
    """One measurement window: its end (``time.perf_counter``), length, the idle fractions
    and the capacity it ran with."""

    step: int
    end: float
    seconds: float
    rollout_idle: float
    trainer_idle: float
    replicas: int
    trainer_threads: int

    @property
    def imbalance(self) -> float:
        return abs(self.rollout_idle - self.trainer_idle)


class Move(msgspec.Struct, kw_only=True):
    """A move carried out (or tried: ``error``): the decision, when, and what it cost."""

    step: int
    at: float
    direction: str
    replicas_before: int
    replicas_after: int
    threads_before: int
    threads_after: int
    rollout_idle: float
    trainer_idle: float
    reason: str
    replica: str = ""
    seconds: float = 0.0
    migrated: int = 0
    error: str = ""


class BusyClock:
    """Seconds a component was busy, including a stretch still open (``begin``/``end``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._since: float | None = None

    def begin(self) -> None:
        self._since = time.perf_counter()

    def end(self) -> None:
        if self._since is not None:
            self.total += time.perf_counter() - self._since
            self._since = None

    def seconds(self) -> float:
        open_s = time.perf_counter() - self._since if self._since is not None else 0.0
        return self.total + open_s


class ServingMeter:
    """Each replica's serving and idle stretches, sampled every ``every`` s from the calls
    the fleet has on it: ``on_span(replica, busy, start, end)`` (``time.time`` seconds) at
    every change and, at ``stop``, for the stretches still open.  A replica that joins is
    measured from its first sample; one that leaves, up to its last."""

    def __init__(
        self,
        fleet: FleetBackend,
        on_span: Callable[[str, bool, float, float], None],
        every: float = 0.01,
    ) -> None:
        self.fleet, self.on_span, self.every = fleet, on_span, every
        self._open: dict[str, tuple[bool, float]] = {}  # replica -> (busy, since)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="agentroll-serving-meter")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.sample()
        now = time.time()
        for name, (busy, since) in self._open.items():
            self.on_span(name, busy, since, now)
        self._open.clear()

    def sample(self) -> None:
        now = time.time()
        slots = self.fleet.router.slots
        for name in list(self._open):
            if name not in slots:  # it left the fleet
                busy, since = self._open.pop(name)
                self.on_span(name, busy, since, now)
        for name, slot in slots.items():
            busy = slot.load > 0
            was = self._open.get(name)
            if was is None:
                self._open[name] = (busy, now)
            elif was[0] != busy:
                self.on_span(name, was[0], was[1], now)
                self._open[name] = (busy, now)

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.every)


ReplicaFactory = Callable[[int], "Replica"]
"""``make(index) -> replica``: a new, unstarted replica (a unique name per index)."""


class CapacityMover:
    """``CapacityMover(fleet, Autoscaler(...), make_replica, full_weights)``.

    ``full_weights()`` returns the trainer's weights as a full update at the fleet's
    version; it is called between training steps, when the trainer is not stepping.
    ``trainer_threads`` is what the trainer's next step should run with."""

    def __init__(
        self,
        fleet: FleetBackend,
        controller: Autoscaler | None,
        make_replica: ReplicaFactory | None = None,
        full_weights: Callable[[], WeightUpdate] | None = None,
        *,
        trainer_threads: int = 1,
    ) -> None:
        self.fleet = fleet
        self.controller = controller
        self.make_replica = make_replica
        self.full_weights = full_weights
        self.trainer_threads = trainer_threads
        self.trainer = BusyClock()
        self.windows: list[Window] = []
        self.moves: list[Move] = []
        self._added = 0
        self._t0 = 0.0
        self._busy0: dict[str, float] = {}
        self._trainer0 = 0.0
        self.replica_seconds = 0.0  # replica-seconds the fleet offered (all windows)
        self.serving_seconds = 0.0  # of which its replicas served calls

    async def begin_window(self) -> None:
        self._t0 = time.perf_counter()
        self._busy0 = await self.fleet.replica_seconds(self._names())
        self._trainer0 = self.trainer.seconds()

    def _names(self) -> list[str]:
        return [n for n in self.fleet.replicas if self.fleet.status(n) not in ("down", "failed")]

    async def end_window(self, step: int) -> Window:
        """Close the window that began last: measure it and record it."""
        now = time.perf_counter()
        busy1 = await self.fleet.replica_seconds(self._names())
        seconds = max(now - self._t0, 1e-9)
        names = [n for n in busy1 if n in self._busy0]
        served = sum(max(0.0, busy1[n] - self._busy0[n]) for n in names)
        offered = seconds * max(1, len(names))
        trained = self.trainer.seconds() - self._trainer0
        window = Window(
            step=step,
            end=now,
            seconds=seconds,
            rollout_idle=min(1.0, max(0.0, 1.0 - served / offered)),
            trainer_idle=min(1.0, max(0.0, 1.0 - trained / seconds)),
            replicas=len(names),
            trainer_threads=self.trainer_threads,
        )
        self.replica_seconds += offered
        self.serving_seconds += min(served, offered)
        self.windows.append(window)
        return window

    async def step(self, step: int) -> Move | None:
        """End the window at a step boundary and carry out the controller's decision."""
        window = await self.end_window(step)
        move = None
        if self.controller is not None:
            decision = self.controller.observe(window.rollout_idle, window.trainer_idle)
            if decision is not None:
                move = await self._carry_out(step, decision)
        await self.begin_window()  # after the move: the next window measures what runs now
        return move

    async def _carry_out(self, step: int, d: Decision) -> Move:
        assert self.controller is not None
        move = Move(
            step=step,
            at=time.perf_counter(),
            direction=d.direction,
            replicas_before=d.before.replicas,
            replicas_after=d.after.replicas,
            threads_before=d.before.trainer_threads,
            threads_after=d.after.trainer_threads,
            rollout_idle=d.rollout_idle,
            trainer_idle=d.trainer_idle,
            reason=d.reason,
        )
        migrated0 = self.fleet.stats.migrated
        t0 = time.perf_counter()
        try:
            live = len(self._names())
            if d.after.replicas > live:
                move.replica = await self._add()
            elif d.after.replicas < live:
                move.replica = await self._remove()
            self.trainer_threads = d.after.trainer_threads
        except Exception as exc:
            move.error = f"{type(exc).__name__}: {exc}"
            logger.error("autoscale could not move capacity (%s); it stays as it was", exc)
            # the controller's view goes back to what runs
            self.controller.capacity = Capacity(len(self._names()), self.trainer_threads)
        move.seconds = time.perf_counter() - t0
        move.migrated = self.fleet.stats.migrated - migrated0
        self.moves.append(move)
        if not move.error:
            logger.info(
                "autoscale at step %d: %d -> %d rollout replicas, %d -> %d trainer threads (%s)",
                step,
                move.replicas_before,
                move.replicas_after,
                move.threads_before,
                move.threads_after,
                move.reason,
            )
        return move

    async def _add(self) -> str:
        if self.make_replica is None or self.full_weights is None:
            raise RuntimeError("autoscale needs make_replica and full_weights to add replicas")
        index = len(self.fleet.replicas) + self._added
        while True:
            replica = self.make_replica(index)
            if replica.name not in self.fleet.replicas:
                break
            index += 1
        self._added += 1
        await self.fleet.add_replica(replica, self.full_weights())
        return replica.name

    async def _remove(self) -> str:
        # the replica carrying the fewest calls leaves (least to move), the newest on a tie
        names = self._names()
        loads = {n: self.fleet.router.slots[n].load for n in names}
        order = {n: i for i, n in enumerate(self.fleet.replicas)}
        name = min(names, key=lambda n: (loads[n], -order[n]))
        await self.fleet.remove_replica(name)
        return name


__all__ = ["BusyClock", "CapacityMover", "Move", "ReplicaFactory", "ServingMeter", "Window"]
