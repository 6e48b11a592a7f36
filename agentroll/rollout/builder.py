"""Per-token arrays of an episode in progress, without per-token Python work.

Invariants: the five arrays always have equal length; context (prompt, environment) tokens
carry logprob NaN, loss mask 0 and versions -1; sampled tokens carry the backend's logprob,
loss mask 1 and the chunk's versions; ``fill`` copies each array once.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import numpy as np

from agentroll.types import Trajectory

_NAN = array("f", [math.nan])
_MINUS1 = array("i", [-1])
_ZERO = array("B", [0])
_ONE = array("B", [1])


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """How many leading token ids ``a`` and ``b`` share (vectorised: forks compare whole
    trajectories)."""
    n = min(len(a), len(b))
    if not n:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n


class TrajectoryBuilder:
    """Accumulates per-token arrays without per-token Python work."""

    __slots__ = ("kv", "logprobs", "mask", "policy", "token_ids")

    def __init__(self) -> None:
        self.token_ids = array("i")
        self.logprobs = array("f")
        self.mask = array("B")
        self.policy = array("i")
        self.kv = array("i")

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_context(self, ids: list[int]) -> None:
        """Prompt or environment tokens: not trained on, no provenance."""
        n = len(ids)
        self.token_ids.extend(ids)
        self.logprobs.extend(_NAN * n)
        self.mask.extend(_ZERO * n)
        self.policy.extend(_MINUS1 * n)
        self.kv.extend(_MINUS1 * n)

    def add_sampled(
        self, ids: list[int], logprobs: list[float], policy_version: int, kv_version: int
    ) -> None:
        n = len(ids)
        if len(logprobs) != n:
            raise ValueError(f"backend returned {n} tokens but {len(logprobs)} logprobs")
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.mask.extend(_ONE * n)
        self.policy.extend(array("i", [policy_version]) * n)
        self.kv.extend(array("i", [kv_version]) * n)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (a backend rolled back part of a turn)."""
        for arr in (self.token_ids, self.logprobs, self.mask, self.policy, self.kv):
            del arr[n:]

    def fill(self, traj: Trajectory) -> Trajectory:
        """Copy the accumulated arrays into ``traj`` (one vectorised copy per array)."""
        traj.token_ids = np.frombuffer(self.token_ids, dtype=np.int32).copy()
        traj.logprobs = np.frombuffer(self.logprobs, dtype=np.float32).copy()
        traj.loss_mask = np.frombuffer(self.mask, dtype=np.uint8).copy()
        traj.policy_version = np.frombuffer(self.policy, dtype=np.int32).copy()
        traj.kv_version = np.frombuffer(self.kv, dtype=np.int32).copy()
        return traj
