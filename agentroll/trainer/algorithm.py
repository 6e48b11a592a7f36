"""Trainer algorithms: the advantage estimator and per-token objective of the reference trainer.

Invariants: ``grpo`` is ``group_advantages`` with ``ppo_objective`` (the defaults of
``collate`` and ``GRPOTrainer``); another name is an ``Algorithm`` registered in entry point
group ``agentroll.trainers``; advantages are one value per trajectory, in order, for whole
groups at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from agentroll.errors import ConfigError
from agentroll.plugins import TRAINERS
from agentroll.trainer.advantages import group_advantages
from agentroll.trainer.batch import Batch, collate
from agentroll.trainer.objective import Objective, ppo_objective
from agentroll.types import Trajectory

AdvantageFn = Callable[[Sequence[Trajectory]], np.ndarray]


def grpo_advantages(trajectories: Sequence[Trajectory]) -> np.ndarray:
    """``group_advantages`` over the trajectories' rewards and group ids."""
    return group_advantages([t.reward for t in trajectories], [t.group_id for t in trajectories])


@dataclass(frozen=True)
class Algorithm:
    """What a trainer plugin supplies: ``advantages`` maps a batch of trajectories (whole
    groups) to one advantage each; ``objective`` is the per-token objective to maximise, with
    ``ppo_objective``'s signature and returns.  Either keeps the GRPO default."""

    name: str
    advantages: AdvantageFn = grpo_advantages
    objective: Objective = ppo_objective

    def collate(
        self, trajectories: Sequence[Trajectory], *, pad_id: int = 0, max_len: int | None = None
    ) -> Batch:
        """``collate`` with this algorithm's advantages."""
        adv = self.advantages(trajectories)
        return collate(trajectories, pad_id=pad_id, advantages=adv, max_len=max_len)


GRPO = Algorithm("grpo")


def trainer_algorithm(name: str, *, field: str | None = None) -> Algorithm:
    """The algorithm called ``name``: ``grpo``, or the ``Algorithm`` an installed package
    registers under that name.  Raises ``ConfigError`` (naming ``field``) when there is
    none, or when the entry point names something else."""
    if name == GRPO.name:
        return GRPO
    algorithm = TRAINERS.load(name, field=field)
    if not isinstance(algorithm, Algorithm):
        raise ConfigError(
            f"{field or 'trainer algorithm'} {name!r} names a {type(algorithm).__name__}; "
            "its entry point must name an agentroll.trainer.algorithm.Algorithm"
        )
    return algorithm
