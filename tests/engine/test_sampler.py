import math

import pytest
import torch

from agentroll.backends.base import SamplingParams
from agentroll.engine.sampler import RequestSampler, filtered_logprobs, sample


def logits(n: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    x = logits(8)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
    alone = [sample(x[i : i + 1], [RequestSampler(params, seed=i)]) for i in range(8)]
    together = sample(x, [RequestSampler(params, seed=i) for i in range(8)])
    assert [a[0][0] for a in alone] == together[0]
    assert [a[1][0] for a in alone] == together[1]


def test_logprobs_are_of_the_filtered_distribution() -> None:
    x = logits(1)[0]
    params = SamplingParams(temperature=0.5, top_k=5)
    lp = filtered_logprobs(x, params)
    kept = torch.isfinite(lp)
    assert int(kept.sum()) == 5
    assert math.isclose(float(lp[kept].exp().sum()), 1.0, rel_tol=1e-5)
    token, logprob = sample(x[None], [RequestSampler(params, seed=3)])
    assert kept[token[0]] and logprob[0] == float(lp[token[0]])


def test_top_p_keeps_the_smallest_nucleus() -> None:
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    lp = filtered_logprobs(x, SamplingParams(top_p=0.8))
    assert torch.isfinite(lp).tolist() == [True, True, False, False]
    lp = filtered_logprobs(x, SamplingParams(top_p=0.81))
    assert torch.isfinite(lp).tolist() == [True, True, True, False]


def test_greedy_is_argmax_and_consumes_randomness_like_sampling() -> None:
    x = logits(1)
    s = RequestSampler(SamplingParams(temperature=0), seed=1)
    before = s.get_state().clone()
    token, lp = sample(x, [s])
    assert token[0] == int(x[0].argmax()) and lp[0] == pytest.approx(
        float(torch.log_softmax(x[0], -1).max())
    )
    other = RequestSampler(SamplingParams(temperature=1.0), seed=1)
    sample(x, [other])
    assert torch.equal(s.get_state(), other.get_state()) and not torch.equal(before, s.get_state())


def test_state_snapshot_restores_the_stream() -> None:
    params = SamplingParams(temperature=1.0)
    s = RequestSampler(params, seed=7)
    x = logits(1, seed=2)
    for _ in range(3):
        sample(x, [s])
    state = s.get_state().clone()
    expected = [sample(x, [s])[0][0] for _ in range(5)]
    t = RequestSampler(params, seed=999)
    t.set_state(state)
    assert [sample(x, [t])[0][0] for _ in range(5)] == expected


def test_sampling_follows_the_distribution() -> None:
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = RequestSampler(SamplingParams(temperature=1.0), seed=0)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sample(x, [s])[0][0]] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03
