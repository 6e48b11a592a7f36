"""Group-normalised advantages (GRPO): pure numpy, no torch.

Invariants: a trajectory's advantage depends only on the rewards of its own group; within a
group the advantages sum to zero; a group of one, or a group whose rewards are all equal,
gets advantage 0 (there is nothing to compare it with); the result is float32 and finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def group_advantages(
    rewards: Sequence[float] | np.ndarray,
    group_ids: Sequence[str],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """Advantages ``(r - mean_group) / (std_group + eps)`` for each trajectory.

    ``std_group`` is the sample standard deviation (``ddof=1``, as ``torch.std`` in the GRPO
    reference implementations); with ``normalize_std=False`` the advantage is ``r - mean_group``
    (Dr. GRPO).  Returns a float32 array aligned with ``rewards``.  Raises ValueError when the
    lengths differ, a reward is not finite, or ``eps`` is negative.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or len(r) != len(group_ids):
        raise ValueError(
            f"group_advantages: got {r.size} rewards for {len(group_ids)} group ids; "
            "pass one reward and one group id per trajectory"
        )
    if not np.all(np.isfinite(r)):
        raise ValueError("group_advantages: every reward must be finite (got NaN or inf)")
    if not eps >= 0:
        raise ValueError(f"group_advantages: eps must be >= 0, got {eps}")
    out = np.zeros(len(r), dtype=np.float64)
    _, inverse = np.unique(np.asarray(list(group_ids), dtype=object), return_inverse=True)
    for g in range(int(inverse.max()) + 1 if len(r) else 0):
        idx = np.flatnonzero(inverse == g)
        if len(idx) < 2:
            continue  # a singleton group has no baseline to compare with: advantage 0
        values = r[idx]
        centred = values - values.mean()
        if np.all(values == values[0]):
            continue  # exact zero, not a rounding residue of (r - mean)
        if normalize_std:
            centred = centred / (values.std(ddof=1) + eps)
        out[idx] = centred
    return out.astype(np.float32)
