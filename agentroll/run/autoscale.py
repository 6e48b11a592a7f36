"""Moving capacity between rollout and training from their idle fractions (pure logic, no I/O).

The controller sees, per measurement window, the idle fraction of the rollout replicas and of
the trainer, and answers with the capacity to run next: rollout replicas and trainer threads.
Invariants: a move happens only when the mean imbalance of the last ``patience`` windows
lies outside the band (one noisy window does not move it, nor do windows that disagree), and
at least ``cooldown`` windows after the previous move; the capacity stays within its bounds and
within ``cores`` threads; a move that undoes the previous one is made only when that one made
the imbalance worse, so the capacity settles instead of oscillating.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from agentroll.errors import ConfigError

Direction = Literal["to_rollout", "to_trainer"]


class AutoscaleConfig(msgspec.Struct, kw_only=True, frozen=True):
    """``band``: an imbalance ``trainer_idle - rollout_idle`` within ``±band`` is balanced;
    ``patience``: windows whose mean imbalance decides (all measured since the last move);
    ``cooldown``:
    windows after a move that are not acted on (the move's effect settles); the bounds of
    the replicas and trainer threads; ``cores``: threads the machine runs at once (a
    replica takes ``replica_threads``; a replica that leaves hands its threads to the
    trainer, one that comes takes them back when the cores are all taken)."""

    band: float = 0.15
    patience: int = 2
    cooldown: int = 1
    min_replicas: int = 1
    max_replicas: int = 8
    min_trainer_threads: int = 1
    max_trainer_threads: int = 64
    cores: int = 2
    replica_threads: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.band < 1.0:
            raise ConfigError(f"autoscale band={self.band}: use 0 <= band < 1")
        if self.patience < 1 or self.cooldown < 0:
            raise ConfigError("autoscale patience must be >= 1 and cooldown >= 0")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ConfigError(
                f"autoscale replicas: need 1 <= min ({self.min_replicas}) <= max "
                f"({self.max_replicas})"
            )
        if not 1 <= self.min_trainer_threads <= self.max_trainer_threads:
            raise ConfigError(
                f"autoscale trainer threads: need 1 <= min ({self.min_trainer_threads}) <= max "
                f"({self.max_trainer_threads})"
            )
        if self.cores < 1 or self.replica_threads < 1:
            raise ConfigError("autoscale cores and replica_threads must be >= 1")


class Capacity(msgspec.Struct, frozen=True):
    """Rollout replicas and trainer threads."""

    replicas: int
    trainer_threads: int


class Decision(msgspec.Struct, kw_only=True, frozen=True):
    """A move: the capacity before and after, the idle fractions it rests on (the means of
    the windows that decided) and why."""

    window: int
    direction: Direction
    before: Capacity
    after: Capacity
    rollout_idle: float
    trainer_idle: float
    reason: str


class Autoscaler:
    """``Autoscaler(config, Capacity(1, 2))``; ``observe(rollout_idle, trainer_idle)`` once
    per window returns a ``Decision`` to carry out (then ``capacity`` is its ``after``) or
    None.  The trainer idling while rollout works means rollout is short of capacity: it
    gets a replica and, when the cores are all taken, the trainer gives up a thread; the
    other way round the trainer gets the thread of a replica that leaves."""

    def __init__(self, config: AutoscaleConfig, capacity: Capacity) -> None:
        self.config = config
        self.capacity = capacity
        self.window = 0
        self.decisions: list[Decision] = []
        self._seen: list[tuple[float, float]] = []  # (rollout, trainer) idle since the last move
        self._quiet = 0  # windows still to sit out after a move

    def imbalance(self, rollout_idle: float, trainer_idle: float) -> float:
        """> 0: the trainer waits for rollout; < 0: rollout waits for the trainer."""
        return trainer_idle - rollout_idle

    def observe(self, rollout_idle: float, trainer_idle: float) -> Decision | None:
        for name, v in (("rollout_idle", rollout_idle), ("trainer_idle", trainer_idle)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name}={v} is not a fraction in [0, 1]")
        self.window += 1
        if self._quiet:
            self._quiet -= 1
            return None
        self._seen.append((rollout_idle, trainer_idle))
        recent = self._seen[-self.config.patience :]
        if len(recent) < self.config.patience:
            return None
        # the decision rests on the means of the recent windows, and so does its record
        rollout_idle = sum(r for r, _ in recent) / len(recent)
        trainer_idle = sum(t for _, t in recent) / len(recent)
        gap = self.imbalance(rollout_idle, trainer_idle)
        if abs(gap) <= self.config.band:
            return None
        direction: Direction = "to_rollout" if gap > 0 else "to_trainer"
        after = self._target(direction)
        if after is None:
            return None
        previous = self.decisions[-1] if self.decisions else None
        if previous is not None and previous.direction != direction:
            before_gap = self.imbalance(previous.rollout_idle, previous.trainer_idle)
            if abs(gap) <= abs(before_gap):
                # undoing the last move would bring back a larger imbalance: stay here
                return None
        decision = Decision(
            window=self.window,
            direction=direction,
            before=self.capacity,
            after=after,
            rollout_idle=rollout_idle,
            trainer_idle=trainer_idle,
            reason=(
                f"trainer idle {trainer_idle:.0%} vs rollout idle {rollout_idle:.0%}: "
                + ("rollout is short of capacity" if gap > 0 else "the trainer is short of it")
            ),
        )
        self.capacity = after
        self.decisions.append(decision)
        self._seen = []
        self._quiet = self.config.cooldown
        return decision

    def _target(self, direction: Direction) -> Capacity | None:
        """The capacity after one step in ``direction``, or None at the bounds."""
        c, cap = self.config, self.capacity
        replicas, threads = cap.replicas, cap.trainer_threads
        if direction == "to_rollout":
            if replicas >= c.max_replicas:
                return None
            replicas += 1
            while (
                replicas * c.replica_threads + threads > c.cores and threads > c.min_trainer_threads
            ):
                threads -= 1
        else:
            if replicas <= c.min_replicas:
                return None
            replicas -= 1  # its threads go to the trainer
            threads = min(c.max_trainer_threads, c.cores, threads + c.replica_threads)
            threads = max(threads, cap.trainer_threads)
        new = Capacity(replicas, threads)
        return None if new == cap else new


__all__ = ["AutoscaleConfig", "Autoscaler", "Capacity", "Decision", "Direction"]
