"""Training side of the loop: the ``Trainer`` protocol, GRPO advantages, batching of
trajectories into padded tensors (plus a torch ``IterableDataset`` over a stream) and the
reference torch trainer ``GRPOTrainer``.

Invariant: the trainer sees exactly the token ids and behaviour logprobs the rollout
recorded; its exports are the ``WeightUpdate``s replicas apply bit-exactly.
"""

from agentroll.trainer.advantages import group_advantages
from agentroll.trainer.base import Trainer, TrainStats
from agentroll.trainer.batch import Batch, TrajectoryDataset, collate
from agentroll.trainer.grpo import GRPOConfig, GRPOTrainer
from agentroll.trainer.objective import kv_lag_terms, ppo_objective

__all__ = [
    "Batch",
    "GRPOConfig",
    "GRPOTrainer",
    "TrainStats",
    "Trainer",
    "TrajectoryDataset",
    "collate",
    "group_advantages",
    "kv_lag_terms",
    "ppo_objective",
]
