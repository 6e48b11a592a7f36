"""Episode admission control under a staleness bound (pure logic, injected clock, no I/O).

``AdmissionController`` says whether a new group of episodes may start now, so that it will
very likely be consumed within ``max_staleness`` versions of the weights it starts with.
Invariants: the quota rule is exact for a trainer that consumes ``batch_size`` trajectories
per step in order; the duration rule cannot starve a trainer that waits for data.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

import msgspec

from agentroll.errors import ConfigError
from agentroll.rollout.buffer import _Notifier

Clock = Callable[[], float]


class Admission(msgspec.Struct, frozen=True, kw_only=True):
    """An admission decision; ``predicted_staleness`` is the larger of the two rules'
    predictions (the duration rule's only once it has enough observations)."""

    ok: bool
    reason: str
    predicted_staleness: int


class AdmissionController:
    """Decides whether a new task (``group_size`` episodes) may start under ``max_staleness``.

    Rule 1 (quota, exact when the trainer consumes in order, ``batch_size`` per step): with
    ``outstanding`` trajectories started and not yet consumed, the new group's last sample is
    consumed at trainer version ``t + (outstanding + group_size - 1) // batch_size``; it must
    be at most ``p + k``, i.e. ``outstanding + group_size <= (p + k - t + 1) * batch_size``.
    Rule 2 (duration): the trainer version predicted at the episode's finish,
    ``t + step_rate * quantile(durations)``, must be at most ``p + k``.  It applies once
    ``min_observations`` durations and trainer steps were seen, and only while at least one
    batch is outstanding: refusing then cannot starve a trainer that waits for data.
    """

    def __init__(
        self,
        *,
        max_staleness: int | None,
        batch_size: int,
        group_size: int = 1,
        quantile: float = 0.9,
        min_observations: int = 8,
        clock: Clock = time.monotonic,
        window: int = 256,
    ) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ConfigError(f"max_staleness must be None or >= 0, got {max_staleness}")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1 trajectories, got {batch_size}")
        if group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {group_size}")
        if not 0.0 < quantile <= 1.0:
            raise ConfigError(f"quantile must be in (0, 1], got {quantile}")
        if min_observations < 1:
            raise ConfigError(f"min_observations must be >= 1, got {min_observations}")
        if window < max(2, min_observations):
            raise ConfigError(f"window must be >= max(2, min_observations), got {window}")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.group_size = group_size
        self.quantile = quantile
        self.min_observations = min_observations
        self._clock = clock
        self._durations: deque[float] = deque(maxlen=window)
        self._steps: deque[tuple[float, int]] = deque(maxlen=window)  # (time, version)
        self._num_steps = 0
        self._admitted = self._refused = 0
        self._waited = 0.0
        self._changed = _Notifier()

    def observe_episode(self, duration: float) -> None:
        """Record how many seconds an episode took (from start to finish)."""
        if duration >= 0 and math.isfinite(duration):
            self._durations.append(float(duration))
            self._changed.fire()

    def observe_trainer_version(self, version: int) -> None:
        """Record the trainer's version at ``clock()``; increases give the step rate, a
        repeated or older version is ignored."""
        if self._steps and version <= self._steps[-1][1]:
            return
        if self._steps:
            self._num_steps += version - self._steps[-1][1]
        self._steps.append((self._clock(), version))
        self._changed.fire()

    def duration_quantile(self) -> float | None:
        """The ``quantile`` of observed episode durations (nearest rank), None if none."""
        if not self._durations:
            return None
        ordered = sorted(self._durations)
        return ordered[max(0, math.ceil(self.quantile * len(ordered)) - 1)]

    def step_rate(self) -> float | None:
        """Trainer steps per second over the observed window, counting the time since the
        last step (a trainer that stops stepping slows the rate); None before two versions."""
        if len(self._steps) < 2:
            return None
        (t0, v0), (t1, v1) = self._steps[0], self._steps[-1]
        span = max(self._clock(), t1) - t0
        return (v1 - v0) / span if span > 0 else None

    def decide(self, *, policy_version: int, trainer_version: int, outstanding: int) -> Admission:
        """Whether a group that would start now at ``policy_version`` may start, with
        ``outstanding`` trajectories (in flight + queued + leased, not counting this group)
        not yet consumed by the trainer at ``trainer_version``.  Each call is counted."""
        decision = self._evaluate(policy_version, trainer_version, outstanding)
        if decision.ok:
            self._admitted += 1
        else:
            self._refused += 1
        return decision

    async def wait(
        self,
        *,
        policy_version: Callable[[], int],
        trainer_version: Callable[[], int],
        outstanding: Callable[[], int],
        poll: float = 0.05,
    ) -> float:
        """Wait until a group may start, re-deciding at every observation and at least every
        ``poll`` seconds; counts one admission.  Returns the seconds waited (clock).
        Cancellation leaves nothing behind."""
        start = self._clock()
        while True:
            event = self._changed.event
            decision = self._evaluate(policy_version(), trainer_version(), outstanding())
            if decision.ok:
                break
            try:
                async with asyncio.timeout(poll):
                    await event.wait()
            except TimeoutError:
                pass
        self._admitted += 1
        waited = self._clock() - start
        self._waited += waited
        return waited

    def statistics(self) -> dict[str, float]:
        """Counters and estimates (0.0 where not observed yet)."""
        return {
            "admitted": float(self._admitted),
            "refused": float(self._refused),
            "waited_seconds": self._waited,
            "duration_quantile": self.duration_quantile() or 0.0,
            "step_rate": self.step_rate() or 0.0,
            "durations_observed": float(len(self._durations)),
            "steps_observed": float(self._num_steps),
        }

    def _evaluate(self, p: int, t: int, outstanding: int) -> Admission:
        k = self.max_staleness
        b = self.batch_size
        quota_staleness = t + (outstanding + self.group_size - 1) // b - p
        if k is None:
            return Admission(
                ok=True, reason="no staleness bound", predicted_staleness=quota_staleness
            )
        if quota_staleness > k:
            quota = max(0, (p + k - t + 1) * b)
            return Admission(
                ok=False,
                reason=(
                    f"quota: {outstanding} + {self.group_size} trajectories outstanding > "
                    f"{quota} that trainer version {t} consumes by version {p + k}"
                ),
                predicted_staleness=quota_staleness,
            )
        rate, q = self.step_rate(), self.duration_quantile()
        if (
            rate is None
            or q is None
            or len(self._durations) < self.min_observations
            or self._num_steps < self.min_observations
            or outstanding < b  # the trainer needs this group to step: refusing would starve it
        ):
            return Admission(ok=True, reason="quota ok", predicted_staleness=quota_staleness)
        ahead = t + rate * q - p
        predicted = max(quota_staleness, math.ceil(ahead - 1e-9))
        if predicted > k:
            return Admission(
                ok=False,
                reason=(
                    f"duration: {q:.3g} s episodes at {rate:.3g} steps/s end near trainer "
                    f"version {t + rate * q:.1f} > {p + k}"
                ),
                predicted_staleness=predicted,
            )
        return Admission(ok=True, reason="quota and duration ok", predicted_staleness=predicted)


__all__ = ["Admission", "AdmissionController"]
