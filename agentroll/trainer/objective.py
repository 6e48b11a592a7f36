"""The GRPO loss as pure tensor functions: PPO's clip against the behaviour logprobs, a
truncated importance weight (``ppo_objective``), and kv-lag aware token terms.

Invariants: inputs are 1-D over loss tokens; gradients flow through ``logp`` only; ``exp``
of the log ratio stays finite without cutting the gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from agentroll.trainer.grpo import GRPOConfig


class Objective(Protocol):
    """A per-token objective as ``ppo_objective``: ``(J, detached ratio, clip-active mask)``
    from 1-D tensors over loss tokens; the trainer maximises ``J``."""

    def __call__(
        self,
        logp: Tensor,
        behaviour_logp: Tensor,
        advantages: Tensor,
        cap: Tensor | float,
        *,
        clip_low: float,
        clip_high: float,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


_MAX_LOG_RATIO = 80.0  # exp(80) is finite in fp32; beyond it the token is hopeless anyway


def kv_lag_terms(
    policy_version: Tensor, kv_version: Tensor, config: GRPOConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token ``(weight, cap, lagged)`` from the versions of loss tokens.

    A token whose ``kv_version`` lags its ``policy_version`` attended to KV computed under
    older weights; by ``config.kv_lag`` it is left out of the loss (``mask``), given
    ``C_t = kv_lag_cap`` (``cap``) or weighted by ``kv_lag_weight ** lag`` (``weight``: a
    weight, not a renormalisation; the denominator still counts it).

    A token is lagged when ``0 <= kv_version < policy_version`` (a negative kv_version means
    the backend did not record it: not lagged).  ``weight`` is 0 for lagged tokens under
    ``mask``, ``kv_lag_weight ** lag`` under ``weight``, else 1; ``cap`` is ``kv_lag_cap`` for
    lagged tokens under ``cap``, else ``is_cap``.  All float32 but ``lagged`` (bool).
    """
    pv, kv = policy_version.long(), kv_version.long()
    lagged = (kv >= 0) & (kv < pv)
    weight = torch.ones(pv.shape, dtype=torch.float32, device=pv.device)
    cap = torch.full(pv.shape, config.is_cap, dtype=torch.float32, device=pv.device)
    if config.kv_lag == "mask":
        weight = torch.where(lagged, 0.0, weight)
    elif config.kv_lag == "weight":
        lag = torch.where(lagged, pv - kv, 0).float()
        weight = torch.pow(torch.tensor(config.kv_lag_weight, device=pv.device), lag)
    else:
        cap = torch.where(lagged, config.kv_lag_cap, cap)
    return weight, cap, lagged


def ppo_objective(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    cap: Tensor | float,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token objective ``J`` (to maximise), the detached ratio ``r`` and a bool mask of
    tokens whose PPO clip is active (zero gradient).

    Per loss token t of a sequence with advantage A (``r = exp(logp_t - mu_t)``, ``mu`` the
    behaviour logprob the sampler recorded, ``sg`` stop-gradient)::

        J_t = sg(min(1, C_t / r)) * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)

    PPO's clipped surrogate with the behaviour policy as the old policy (the clip is the
    trust region around what was sampled), times IMPALA/V-trace's truncated importance
    weight: where the clip is inactive the gradient is ``min(r, C_t) * A * grad(logp_t)``,
    where it is active 0.  The truncation bounds the one term PPO leaves unbounded (A < 0, r
    large) like dual-clip PPO, but keeps a gradient of weight C there instead of none.
    ``C_t`` is ``cap`` (``is_cap``, or ``kv_lag_cap`` for a kv-lagged token: see
    ``kv_lag_terms``).  All inputs are 1-D over loss tokens; gradients flow through ``logp``
    only.
    """
    log_ratio = logp - behaviour_logp
    # keep exp() finite without cutting the gradient (value clamped, derivative kept)
    log_ratio = log_ratio - (log_ratio - _MAX_LOG_RATIO).clamp(min=0).detach()
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    truncation = (torch.as_tensor(cap, dtype=ratio.dtype) / ratio.detach()).clamp(max=1.0)
    r = ratio.detach()
    clip_active = ((r > 1.0 + clip_high) & (advantages > 0)) | (
        (r < 1.0 - clip_low) & (advantages < 0)
    )
    return truncation.detach() * surrogate, r, clip_active
