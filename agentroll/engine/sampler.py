"""Seeded, counter-based sampling with exact logprobs.

Invariants: the random number behind the token at generation step ``i`` of a request is a
pure function of ``(seed, i)`` (splitmix64), so a request's tokens never depend on the other
rows of the batch and a snapshot saves only the step count; logprobs are those of the
distribution actually sampled from (after temperature, top-k and top-p), in fp32.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from agentroll.types import SamplingParams

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1


def uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) from ``(seed, step)`` (splitmix64 over the pair)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities (fp32, along the last dim) of the distribution that is sampled
    from: temperature-scaled, then restricted to the top-k and the top-p nucleus (``-inf``
    elsewhere).  With temperature 0 it is the plain softmax (greedy takes its argmax)."""
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


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    steps: list[int],
    kernels: Any | None = None,
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` ([n, vocab]); row ``r`` uses ``params[r]`` and the
    random number ``uniform(seeds[r], steps[r])``.  Returns token ids and their logprobs.

    With ``kernels`` (the engine's C++ CPU kernels) the whole batch is one call of their
    ``sample``, which follows the same definition; its arithmetic differs in rounding (its
    own exp, the mass summed in blocks, ties in top-p ranked by token id), so the two paths
    may pick different tokens where the mass is split within rounding -- each is
    deterministic and per-row on its own.

    Sampling is by inverse CDF over the filtered distribution, vectorised over rows that share
    parameters, so a request's tokens depend only on its logits, its ``SamplingParams`` and its
    seed.
    """
    logits = logits.detach().to("cpu", torch.float32)
    if kernels is not None:
        f32 = np.float32  # numpy: torch.tensor of a short list costs 5x more
        bits = np.array([s & _MASK64 for s in seeds], dtype=np.uint64).view(np.int64)
        draws = kernels.uniform(torch.from_numpy(bits), torch.from_numpy(np.array(steps, np.int64)))
        tokens, logprobs = kernels.sample(
            logits.contiguous(),
            torch.from_numpy(np.array([p.temperature for p in params], dtype=f32)),
            torch.from_numpy(np.array([p.top_k for p in params], dtype=np.int64)),
            torch.from_numpy(np.array([p.top_p for p in params], dtype=f32)),
            draws,
        )
        return tokens.tolist(), logprobs.tolist()
    n = logits.shape[0]
    tokens = [0] * n
    logprobs = [0.0] * n
    # rows that filter the same way are sampled together (seeds and limits may differ)
    groups: dict[tuple[float, float, int], list[int]] = defaultdict(list)
    for r, p in enumerate(params):
        groups[(p.temperature, p.top_p, p.top_k)].append(r)
    for rows in groups.values():
        p = params[rows[0]]
        lp = filtered_logprobs(logits if len(rows) == n else logits[rows], p)
        if p.temperature == 0:
            chosen = torch.argmax(lp, dim=-1)
        else:
            cdf = torch.cumsum(lp.exp(), dim=-1)
            u = torch.tensor([uniform(seeds[r], steps[r]) for r in rows], dtype=torch.float32)
            target = (u * cdf[:, -1])[:, None]
            chosen = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=lp.shape[-1] - 1)
            # rounding at the very top of the CDF must not land on a filtered-out token
            bad = torch.isinf(lp.gather(1, chosen[:, None]))[:, 0]
            if bool(bad.any()):
                chosen[bad] = torch.argmax(lp[bad], dim=-1)
        picked = lp.gather(1, chosen[:, None])[:, 0]
        for r, t, v in zip(rows, chosen.tolist(), picked.tolist(), strict=True):
            tokens[r] = t
            logprobs[r] = v
    return tokens, logprobs
