import math

import torch

from agentroll.backends.base import SamplingParams
from agentroll.engine.sampler import filtered_logprobs, sample, uniform


def logits(n: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    x = logits(8)
    mixed = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20),
        SamplingParams(temperature=1.0),
    ] * 4
    alone = [sample(x[i : i + 1], [mixed[i]], [i], [3]) for i in range(8)]
    together = sample(x, mixed, list(range(8)), [3] * 8)
    assert [a[0][0] for a in alone] == together[0]
    assert [a[1][0] for a in alone] == together[1]


def test_logprobs_are_of_the_filtered_distribution() -> None:
    x = logits(1)[0]
    params = SamplingParams(temperature=0.5, top_k=5)
    lp = filtered_logprobs(x, params)
    kept = torch.isfinite(lp)
    assert int(kept.sum()) == 5
    assert math.isclose(float(lp[kept].exp().sum()), 1.0, rel_tol=1e-5)
    for step in range(20):
        token, logprob = sample(x[None], [params], [3], [step])
        assert kept[token[0]] and logprob[0] == float(lp[token[0]])


def test_top_p_keeps_the_smallest_nucleus() -> None:
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(filtered_logprobs(x, SamplingParams(top_p=0.8))).tolist() == [
        True,
        True,
        False,
        False,
    ]
    assert torch.isfinite(filtered_logprobs(x, SamplingParams(top_p=0.81))).tolist() == [
        True,
        True,
        True,
        False,
    ]


def test_greedy_is_argmax() -> None:
    x = logits(3)
    tokens, lps = sample(x, [SamplingParams(temperature=0)] * 3, [1, 2, 3], [0, 0, 0])
    assert tokens == x.argmax(-1).tolist()
    assert lps == torch.log_softmax(x, -1).max(-1).values.tolist()


def test_randomness_is_a_function_of_seed_and_step() -> None:
    assert uniform(7, 3) == uniform(7, 3)
    assert len({uniform(7, s) for s in range(1000)}) == 1000
    assert len({uniform(s, 0) for s in range(1000)}) == 1000
    values = [uniform(11, s) for s in range(20000)]
    assert all(0 <= v < 1 for v in values) and abs(sum(values) / len(values) - 0.5) < 0.01


def test_sampling_follows_the_distribution() -> None:
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = [0, 0, 0]
    for step in range(4000):
        counts[sample(x, [SamplingParams()], [0], [step])[0][0]] += 1
    assert abs(counts[0] / 4000 - 0.7) < 0.03 and abs(counts[2] / 4000 - 0.1) < 0.02
