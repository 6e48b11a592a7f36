"""The ``Trainer`` protocol every trainer implements, and the statistics a step reports.

Invariants: ``version`` is the version of the trainer's current weights and grows by one per
``step``; ``export(base_version)`` describes exactly those weights (a delta when the caller
holds ``base_version`` and the trainer still has it as a base, a full update otherwise);
``TrainStats`` is a msgspec Struct, so it goes to metric traces as JSON or msgpack unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from agentroll.trainer.batch import Batch
    from agentroll.weights.update import WeightUpdate


class TrainStats(msgspec.Struct, kw_only=True):
    """What one training step did.

    ``version``: weights version after the step; ``loss``: the value minimised; ``tokens``:
    loss tokens in the batch; ``clip_fraction``: share of loss tokens whose PPO clip was
    active; ``ratio_mean`` / ``ratio_max``: ``exp(logp - behaviour_logp)`` over loss tokens
    before the update; ``kl``: k3 estimate of KL(behaviour || current) over loss tokens;
    ``grad_norm``: total gradient norm before clipping; ``kv_lagged_tokens``: loss tokens whose
    ``kv_version`` lags their ``policy_version``; ``seconds``: wall time of the step.
    Statistics that do not apply (e.g. ratios in a supervised step without behaviour
    logprobs) are 0.
    """

    version: int
    loss: float
    trajectories: int
    tokens: int
    reward_mean: float
    reward_std: float
    clip_fraction: float
    ratio_mean: float
    ratio_max: float
    kl: float
    grad_norm: float
    kv_lagged_tokens: int
    seconds: float
    extra: dict[str, float] = {}


@runtime_checkable
class Trainer(Protocol):
    """A trainer consumes batches and produces weight updates for the rollout replicas."""

    version: int

    def step(self, batch: Batch) -> TrainStats:
        """One optimizer step on ``batch``; ``version`` grows by one.  Returns statistics."""
        ...

    def export(self, base_version: int | None = None) -> WeightUpdate:
        """The current weights as an update: a delta against ``base_version`` when possible
        (``None``: against the previous export), a full update otherwise."""
        ...
