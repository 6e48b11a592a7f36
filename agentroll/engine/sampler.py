"""Seeded per-request sampling with exact logprobs.

Invariants: a request's token depends only on its logits row, its ``SamplingParams`` and its
own ``torch.Generator`` (never on the other rows of the batch); every step consumes the
same amount of randomness whatever the distribution, so a generator's state after n steps is
a function of n and the seed alone (snapshots restore it exactly); logprobs are those of the
distribution actually sampled from (after temperature, top-k and top-p), computed in fp32.
"""

from __future__ import annotations

import torch

from agentroll.backends.base import SamplingParams

_NEG_INF = float("-inf")


class RequestSampler:
    """The sampling state of one request: its params and its generator (on the CPU, so the
    stream of random numbers is the same on every device)."""

    __slots__ = ("generator", "params")

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)

    def get_state(self) -> torch.Tensor:
        """The generator state (a uint8 tensor) for snapshots."""
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities (fp32, rows of ``logits``) of the distribution that is sampled from:
    temperature-scaled, then restricted to the top-k and the top-p nucleus (``-inf``
    elsewhere).  With temperature 0 it is the plain softmax (greedy picks its argmax)."""
    x = logits.float()
    if params.temperature > 0 and params.temperature != 1.0:
        x = x / params.temperature
    if params.temperature > 0 and (params.top_k > 0 or params.top_p < 1.0):
        x = x.clone()
        if 0 < params.top_k < x.shape[-1]:
            kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
            x[x < kth] = _NEG_INF
        if params.top_p < 1.0:
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # drop a token when the mass before it already reaches top_p (the first one stays)
            drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            x[drop] = _NEG_INF
    return torch.log_softmax(x, dim=-1)


def sample(logits: torch.Tensor, samplers: list[RequestSampler]) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` ([n, vocab]) with each row's own sampler.

    Uses the exponential race (argmax of p / E with E ~ Exp(1) drawn from the request's
    generator), which draws exactly ``vocab`` numbers per step.  Returns token ids and
    their logprobs.
    """
    logits = logits.detach().to("cpu", torch.float32)
    tokens: list[int] = []
    logprobs: list[float] = []
    for row, sampler in zip(logits, samplers, strict=True):
        lp = filtered_logprobs(row, sampler.params)
        noise = torch.empty_like(lp).exponential_(generator=sampler.generator)
        if sampler.params.temperature == 0:
            token = int(torch.argmax(lp))
        else:
            token = int(torch.argmax(lp.exp() / noise))
        tokens.append(token)
        logprobs.append(float(lp[token]))
    return tokens, logprobs
