"""Placement of rollout and training in one process: colocated (the engine sleeps while the
trainer steps on the same cores) or separate (both run at once).

Invariants: in the colocated placement the engine never generates while the trainer steps;
a phase switch pauses the episodes in flight (partial rollouts) and they continue first
after the update, their old tokens keeping their versions; without partial rollouts a phase
admits one batch of groups and waits for the last of them.  A trajectory is trained on only
within ``max_staleness`` of the trainer's version (exactly; the others are counted).  When
the trainer does not deliver weights within ``wake_timeout`` the engine wakes on its last
good weights and says so.  Separate: the rollout runs at most ``rollout_ahead`` batches
ahead of the trainer, and a ``CapacityMover`` may move capacity between them at step
boundaries (``agentroll.run.capacity``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from agentroll._mem import rss_bytes
from agentroll.backends.base import ReportsBusy, SupportsSleep
from agentroll.errors import ConfigError
from agentroll.rollout.pause import PolicyFn, fixed_policy
from agentroll.run.capacity import BusyClock, CapacityMover, Move, Window
from agentroll.types import Task, Trajectory

if TYPE_CHECKING:
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.run.placement")

Mode = Literal["separate", "colocated"]


class PlacementConfig(msgspec.Struct, kw_only=True, frozen=True):
    """``mode``: colocated or separate; ``partial_rollouts``: a colocated phase ends once a
    batch is complete, pausing the stragglers (else it waits for them); ``sleep_level``: 1
    releases the KV cache, 2 the weights too; ``wake_timeout``: seconds the sleeping engine
    waits for the trainer's weights before it wakes on its last good ones;
    ``rollout_ahead``: batches a separate rollout may run ahead of the trainer (it then
    waits: the staleness stays bounded); ``window_steps``: steps per measurement window of
    the idle fractions (separate mode, the autoscaler's input)."""

    mode: Mode = "separate"
    partial_rollouts: bool = True
    sleep_level: int = 1
    wake_timeout: float = 600.0
    max_staleness: int = 4
    rollout_ahead: int = 1
    window_steps: int = 2

    def __post_init__(self) -> None:
        if self.mode not in ("separate", "colocated"):
            raise ConfigError(f"placement.mode {self.mode!r}: use 'colocated' or 'separate'")
        if self.sleep_level not in (1, 2):
            raise ConfigError(f"placement.sleep_level={self.sleep_level}: use 1 or 2")
        if not self.wake_timeout > 0:
            raise ConfigError("placement.wake_timeout must be > 0 seconds")
        if self.max_staleness < 0:
            raise ConfigError("placement.max_staleness must be >= 0")
        if self.rollout_ahead < 1 or self.window_steps < 1:
            raise ConfigError("placement.rollout_ahead and window_steps must be >= 1")


class Switch(msgspec.Struct, kw_only=True):
    """One colocated phase switch: when the engine slept and woke, what it freed, the
    version it woke on and the requests it parked."""

    step: int
    slept_at: float
    woke_at: float
    version: int
    freed_bytes: int
    rss_freed_bytes: int
    wake_ms: float
    parked: int
    fallback: bool = False


class PlacementStats(msgspec.Struct, kw_only=True):
    """What a placement run measured (seconds are wall time)."""

    mode: str
    partial_rollouts: bool
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0  # generated tokens of the trajectories trained on
    trained: int = 0
    dropped_stale: int = 0
    failed: int = 0
    tail_wait_s: float = 0.0
    rollout_busy_s: float = 0.0
    rollout_capacity_s: float = 0.0  # replica-seconds offered (0: ``seconds``, one engine)
    trainer_busy_s: float = 0.0
    restarted: int = 0
    switches: list[Switch] = []
    windows: list[Window] = []
    moves: list[Move] = []

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def rollout_idle(self) -> float:
        offered = self.rollout_capacity_s or self.seconds
        return max(0.0, 1.0 - self.rollout_busy_s / offered) if offered else 0.0

    @property
    def trainer_idle(self) -> float:
        return max(0.0, 1.0 - self.trainer_busy_s / self.seconds) if self.seconds else 0.0


TrainFn = Callable[[list[Trajectory], int], "WeightUpdate"]
"""``train(batch, base_version) -> update``: one training step on ``batch`` and the weights
after it as an update for a replica at ``base_version`` (runs in a thread)."""


class _Phases:
    """Admission of groups: without partial rollouts, a phase admits ``per_phase`` groups and
    then waits for the next phase; with them, every group is admitted when a slot is free,
    up to ``ahead`` groups not yet handed to the trainer (None: no bound)."""

    def __init__(self, per_phase: int | None, ahead: int | None = None) -> None:
        self.per_phase = per_phase
        self.ahead = ahead
        self.admitted = 0
        self.outstanding = 0  # admitted groups not yet in a training batch
        self.open = asyncio.Event()
        self.open.set()

    def _full(self) -> bool:
        if self.per_phase is not None and self.admitted >= self.per_phase:
            return True
        return self.ahead is not None and self.outstanding >= self.ahead

    async def admit(self, n: int) -> None:
        while self._full():
            self.open.clear()
            await self.open.wait()
        self.admitted += 1
        self.outstanding += 1

    def handed(self, groups: int) -> None:
        self.outstanding = max(0, self.outstanding - groups)
        self.open.set()

    def next_phase(self) -> None:
        self.admitted = 0
        self.open.set()


def forever(tasks: list[Task]) -> Iterator[Task]:
    """The tasks over and over (a run of ``steps`` batches takes what it needs)."""
    if not tasks:
        raise ConfigError("the environment has no tasks")
    return itertools.cycle(tasks)


async def run_placement(
    engine: RolloutEngine,
    train: TrainFn,
    tasks: Iterable[Task],
    *,
    steps: int,
    batch_groups: int,
    config: PlacementConfig,
    policy: PolicyFn | None = None,
    on_step: Callable[[int, list[Trajectory], PlacementStats], None] | None = None,
    on_switch: Callable[[Switch], None] | None = None,
    capacity: CapacityMover | None = None,
    on_move: Callable[[Move], None] | None = None,
) -> PlacementStats:
    """Train ``steps`` batches of ``batch_groups`` groups on the episodes of ``engine``.

    Colocated: each rollout phase ends once a batch is whole (partial rollouts: the episodes
    still running are paused and parked with ``policy``, default ``keep``; otherwise the
    phase admitted exactly that batch and waits for its last episode), the engine sleeps,
    ``train`` runs, the engine wakes on the update and the parked episodes go first.
    Separate: episodes never stop (but wait to be admitted while the rollout is
    ``rollout_ahead`` batches ahead); each update is synced in with a pause (``policy``);
    ``capacity`` (a fleet's ``CapacityMover``) measures the idle fractions every
    ``window_steps`` steps and carries out its autoscaler's moves, each reported to
    ``on_move``.  ``on_step(step, batch, stats)`` follows each step, ``on_switch(switch)``
    each colocated switch (times on ``time.perf_counter``).  Returns the measurements."""
    backend = engine.backend
    colocated = config.mode == "colocated"
    if colocated and not isinstance(backend, SupportsSleep):
        raise ConfigError(
            f"placement.mode='colocated' needs a backend that can sleep; {backend.name} cannot"
        )
    if capacity is not None and colocated:
        raise ConfigError(
            "autoscale moves capacity between a rollout and a trainer that run at once: "
            "use it with placement.mode='separate'"
        )
    partial = config.partial_rollouts or not colocated
    choose = policy or fixed_policy("keep")
    stats = PlacementStats(mode=config.mode, partial_rollouts=partial)
    phases = _Phases(
        None if partial else batch_groups,
        None if colocated else config.rollout_ahead * batch_groups,
    )
    concurrency = engine.config.concurrency
    version = backend.policy_version
    tail = _TailMeter(engine, concurrency)
    trainer_clock = capacity.trainer if capacity is not None else BusyClock()
    # a step past wake_timeout goes on in its thread: the next one waits for it, so the
    # trainer never runs two steps at once
    train_lock = threading.Lock()
    threads = (lambda: capacity.trainer_threads) if capacity is not None else (lambda: None)
    busy0 = await _busy(backend)
    trained0 = trainer_clock.seconds()
    t0 = time.perf_counter()
    if capacity is not None:
        await capacity.begin_window()
    pending: list[list[Trajectory]] = []
    training: asyncio.Task[WeightUpdate] | None = None  # separate mode: the step in flight
    try:
        tail.start()
        groups = engine.run_groups(forever(list(tasks)), admit=phases.admit)
        async with contextlib.aclosing(groups):  # type: ignore[type-var]
            async for group in groups:
                pending.append(group)
                if len(pending) < batch_groups:
                    continue
                batch_groups_now, pending = pending[:batch_groups], pending[batch_groups:]
                phases.handed(len(batch_groups_now))
                batch = _fresh([t for g in batch_groups_now for t in g], version, config, stats)
                step = stats.steps
                if colocated:
                    tail.phase_over()
                    version = await _switch(
                        engine,
                        train,
                        batch,
                        version,
                        step,
                        config,
                        choose,
                        stats,
                        trainer_clock,
                        train_lock,
                    )
                    if on_switch is not None:
                        on_switch(stats.switches[-1])
                    phases.next_phase()
                    tail.phase_begins()
                else:
                    if training is not None:  # one step in flight: the pools overlap, no more
                        version = await _sync_separate(engine, await training, choose, stats)
                    if capacity is not None and step and step % config.window_steps == 0:
                        # between steps: the trainer is not stepping, the fleet is at `version`
                        move = await capacity.step(step)
                        if move is not None and on_move is not None:
                            on_move(move)
                    training = asyncio.create_task(
                        _timed_train(train, batch, version, trainer_clock, train_lock, threads())
                    )
                stats.steps += 1
                _account(batch, stats)
                if on_step is not None:
                    on_step(step, batch, stats)
                if stats.steps >= steps:
                    break
            if training is not None:
                version = await _sync_separate(engine, await training, choose, stats)
    finally:
        tail.stop()
        if training is not None and not training.done():
            training.cancel()
    if capacity is not None:
        await capacity.end_window(stats.steps)
    stats.seconds = time.perf_counter() - t0
    stats.trainer_busy_s = trainer_clock.seconds() - trained0
    stats.tail_wait_s = tail.total
    if capacity is not None:
        stats.rollout_busy_s = capacity.serving_seconds
        stats.rollout_capacity_s = capacity.replica_seconds
        stats.windows = list(capacity.windows)
        stats.moves = list(capacity.moves)
    else:
        stats.rollout_busy_s = await _busy(backend) - busy0
    stats.restarted = int(engine.stats.get("restarted_turns", 0))
    return stats


def _fresh(
    batch: list[Trajectory], version: int, config: PlacementConfig, stats: PlacementStats
) -> list[Trajectory]:
    """The trajectories within the staleness bound of the trainer's ``version`` (exactly:
    the oldest token's version); the others are counted as dropped."""
    keep = []
    for t in batch:
        oldest = t.min_policy_version()
        if oldest >= 0 and version - oldest > config.max_staleness:
            stats.dropped_stale += 1
            continue
        keep.append(t)
    return keep


def _account(batch: list[Trajectory], stats: PlacementStats) -> None:
    stats.trained += len(batch)
    stats.failed += sum(t.status == "failed" for t in batch)
    stats.tokens += sum(t.num_generated for t in batch)


async def _timed_train(
    train: TrainFn,
    batch: list[Trajectory],
    version: int,
    clock: BusyClock,
    lock: threading.Lock,
    threads: int | None = None,
) -> WeightUpdate:
    def step() -> WeightUpdate:
        if threads is not None:
            import torch

            # per thread (OpenMP): the engines' own threads keep their settings
            torch.set_num_threads(threads)
        with lock:
            return train(batch, version)

    clock.begin()
    try:
        return await asyncio.to_thread(step)
    finally:
        clock.end()


async def _sync_separate(
    engine: RolloutEngine, update: WeightUpdate, choose: PolicyFn, stats: PlacementStats
) -> int:
    await engine.sync(update, policy=choose)
    return update.version


async def _switch(
    engine: RolloutEngine,
    train: TrainFn,
    batch: list[Trajectory],
    version: int,
    step: int,
    config: PlacementConfig,
    choose: PolicyFn,
    stats: PlacementStats,
    clock: BusyClock,
    lock: threading.Lock,
) -> int:
    """Pause the episodes in flight, sleep, train, wake on the update (or, past
    ``wake_timeout``, on the last good weights), resume the parked episodes first."""
    backend = engine.backend
    assert isinstance(backend, SupportsSleep)
    await engine.pause(choose)
    policies = engine.pauses.policies()
    rss0 = rss_bytes()
    slept_at = time.perf_counter()
    report = await backend.sleep(config.sleep_level, policies=policies)
    rss_freed = max(0, rss0 - rss_bytes())
    fallback = False
    try:
        update: WeightUpdate | None = await asyncio.wait_for(
            _timed_train(train, batch, version, clock, lock), config.wake_timeout
        )
    except TimeoutError:
        logger.warning(
            "no weights from the trainer within %.0f s: waking on the last good weights "
            "(version %d)",
            config.wake_timeout,
            version,
        )
        update, fallback = None, True
    t_wake = time.perf_counter()
    # the backend was paused before it slept: engine.resume below applies the policies
    wake = await backend.wake(update, fallback=fallback)
    woke_at = time.perf_counter()
    await engine.resume(policies)
    stats.switches.append(
        Switch(
            step=step,
            slept_at=slept_at,
            woke_at=woke_at,
            version=wake.version,
            freed_bytes=report.freed_bytes,
            rss_freed_bytes=rss_freed,
            wake_ms=(woke_at - t_wake) * 1000.0,
            parked=report.parked,
            fallback=fallback,
        )
    )
    return int(wake.version)


async def _busy(backend: Any) -> float:
    """Seconds the backend served calls (a fleet: the mean over its replicas)."""
    from agentroll.fleet.backend import FleetBackend

    if isinstance(backend, FleetBackend):
        served = await backend.replica_seconds(list(backend.replicas))
        return sum(served.values()) / max(1, len(served))
    return float(backend.generating_seconds) if isinstance(backend, ReportsBusy) else 0.0


class _TailMeter:
    """Seconds a rollout phase spends with fewer than half its episode slots running while
    it waits to end: the wait on the longest trajectories.  Sampled every ``every`` s."""

    def __init__(self, engine: RolloutEngine, concurrency: int, every: float = 0.005) -> None:
        self.engine = engine
        self.threshold = concurrency / 2
        self.every = every
        self.total = 0.0
        self._task: asyncio.Task[None] | None = None
        self._measuring = True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="agentroll-tail-meter")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def phase_over(self) -> None:
        self._measuring = False

    def phase_begins(self) -> None:
        self._measuring = True

    async def _run(self) -> None:
        last = time.perf_counter()
        started = False
        while True:
            await asyncio.sleep(self.every)
            now = time.perf_counter()
            live = self.engine.live_episodes
            started = started or live >= self.threshold
            if self._measuring and started and live < self.threshold:
                self.total += now - last
            last = now
