"""collate: padding, masks, behaviour logprobs and versions per token, advantages and
truncation, against hand-built trajectories."""

import numpy as np
import pytest
import torch

from agentroll.trainer.advantages import group_advantages
from agentroll.trainer.batch import collate
from agentroll.types import Trajectory


def traj(
    id: str, prompt: int, gen: int, *, group: str = "g", reward: float = 0.0, pv: int = 3
) -> Trajectory:
    n = prompt + gen
    sampled = np.arange(n) >= prompt
    return Trajectory(
        id=id,
        task_id="t",
        group_id=group,
        reward=reward,
        token_ids=np.arange(10, 10 + n),
        logprobs=np.where(sampled, -0.25 * np.arange(n), np.nan),
        loss_mask=sampled.astype(np.uint8),
        policy_version=np.where(sampled, pv, -1),
        kv_version=np.where(sampled, pv - 1, -1),
    )


def test_padding_masks_and_provenance() -> None:
    trajs = [
        traj("a", 3, 4, reward=1.0),
        traj("b", 2, 2, reward=0.0),
        traj("c", 1, 5, group="h", reward=2.0),
    ]
    b = collate(trajs, pad_id=7)
    assert b.input_ids.shape == (3, 7) and b.input_ids.dtype == torch.int64
    assert b.lengths.tolist() == [7, 4, 6] and b.num_truncated == 0
    assert b.trajectory_ids == ["a", "b", "c"] and b.group_ids == ["g", "g", "h"]
    for i, t in enumerate(trajs):
        n = t.num_tokens
        assert b.input_ids[i, :n].tolist() == t.token_ids.tolist()  # the exact ids
        assert bool((b.input_ids[i, n:] == 7).all())
        assert b.attention_mask[i].tolist() == [True] * n + [False] * (7 - n)
        assert b.loss_mask[i, :n].tolist() == t.loss_mask.astype(bool).tolist()
        assert not bool(b.loss_mask[i, n:].any())
        m = t.loss_mask.astype(bool)
        # behaviour logprobs bit-exact on sampled tokens, 0 elsewhere (never NaN)
        assert b.behaviour_logprobs[i, :n][torch.from_numpy(m)].numpy().tobytes() == (
            t.logprobs[m].tobytes()
        )
        assert bool((b.behaviour_logprobs[i][~b.loss_mask[i]] == 0).all())
        assert bool((b.policy_version[i][b.loss_mask[i]] == 3).all())
        assert bool((b.kv_version[i][b.loss_mask[i]] == 2).all())
        assert bool((b.policy_version[i][~b.loss_mask[i]] == -1).all())
        assert bool((b.kv_version[i][~b.loss_mask[i]] == -1).all())
    want = group_advantages([1.0, 0.0, 2.0], ["g", "g", "h"])
    assert b.advantages.numpy().tobytes() == want.tobytes()
    assert b.rewards.tolist() == [1.0, 0.0, 2.0]


def test_explicit_advantages_and_truncation() -> None:
    trajs = [traj("a", 3, 4), traj("b", 2, 2)]
    b = collate(trajs, advantages=np.array([0.5, -1.5]), max_len=5)
    assert b.advantages.tolist() == [0.5, -1.5]
    assert b.input_ids.shape == (2, 5) and b.lengths.tolist() == [5, 4]
    assert b.num_truncated == 2
    assert b.input_ids[0].tolist() == trajs[0].token_ids[:5].tolist()  # the prefix is kept
    assert b.loss_mask[0].tolist() == [False, False, False, True, True]


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no trajectories"):
        collate([])
    with pytest.raises(ValueError, match="one value per trajectory"):
        collate([traj("a", 1, 1)], advantages=np.zeros(2))
    with pytest.raises(ValueError, match="max_len"):
        collate([traj("a", 1, 1)], max_len=0)


def test_nan_behaviour_logprob_on_a_loss_token_stays_visible() -> None:
    t = traj("a", 1, 2)
    t.logprobs[:] = np.nan  # a demonstration without logprobs
    b = collate([t])
    assert bool(torch.isnan(b.behaviour_logprobs[b.loss_mask]).all())
    assert bool((b.behaviour_logprobs[~b.loss_mask] == 0).all())
