"""Group-normalised advantages on synthetic rewards: per-group baselines, zero for groups
with nothing to compare, and agreement with a direct per-group computation."""

import numpy as np
import pytest

from agentroll.trainer.advantages import group_advantages


def test_values_per_group_with_interleaved_ids() -> None:
    rewards = [1.0, 5.0, 0.0, 2.0, 1.0, 0.0, 7.0, 2.0, 2.0]
    groups = ["a", "s", "a", "e", "a", "a", "x", "e", "e"]
    adv = group_advantages(rewards, groups)
    assert adv.dtype == np.float32 and adv.shape == (9,)
    std = np.std([1.0, 0.0, 1.0, 0.0], ddof=1)
    expected_a = (np.array([1.0, 0.0, 1.0, 0.0]) - 0.5) / (std + 1e-6)
    np.testing.assert_allclose(adv[[0, 2, 4, 5]], expected_a, rtol=1e-6)
    assert adv[1] == 0.0 and adv[6] == 0.0  # singleton groups
    assert np.all(adv[[3, 7, 8]] == 0.0)  # all-equal rewards: exactly zero


def test_matches_a_direct_computation_and_sums_to_zero() -> None:
    rng = np.random.default_rng(3)
    rewards = rng.normal(size=200)
    groups = [f"g{i}" for i in rng.integers(0, 30, size=200)]
    for normalize in (True, False):
        adv = group_advantages(rewards, groups, normalize_std=normalize, eps=1e-4)
        for g in set(groups):
            idx = [i for i, x in enumerate(groups) if x == g]
            r = rewards[idx]
            want = np.zeros(len(r)) if len(r) < 2 else r - r.mean()
            if normalize and len(r) > 1:
                want = want / (r.std(ddof=1) + 1e-4)
            np.testing.assert_allclose(adv[idx], want, rtol=1e-5, atol=1e-6)
            assert abs(float(adv[idx].astype(np.float64).sum())) < 1e-4


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="group ids"):
        group_advantages([1.0, 2.0], ["a"])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")], ["a", "a"])
    with pytest.raises(ValueError, match="eps"):
        group_advantages([1.0], ["a"], eps=-1)
    assert group_advantages([], []).shape == (0,)
