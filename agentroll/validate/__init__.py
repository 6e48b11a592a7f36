"""Learning-semantics checks (``agentroll validate``): each prints one ``check=`` line.

One module per group of checks (``parity``: a backend against references; ``checkpoint``
and ``fleet``: pauses and moves lose nothing; ``placement``: sleep and wake; ``vllm``).  The product never imports them.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

from agentroll.validate.common import CheckResult


def _layout_device(device: str) -> str:
    """NCCL needs one GPU per rank: on a single GPU the two ranks convert over gloo."""
    if device == "cuda":
        import torch

        return "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    return device


def run_checks(model: Path, device: str = "cpu") -> list[CheckResult]:
    """All checks, in order, with the engine on ``device``."""
    from agentroll.validate.checkpoint import check_episode_checkpoint_parity
    from agentroll.validate.fleet import check_provenance, check_rolling_versions
    from agentroll.validate.layout import check_layout_roundtrip
    from agentroll.validate.parity import (
        check_batch_invariance,
        check_bf16_parity,
        check_recompute_rescore,
        check_reference_parity,
        check_token_parity_migrate,
        check_token_parity_pause,
    )
    from agentroll.validate.placement import check_colocated_provenance, check_sleep_wake_parity

    out = [
        asyncio.run(check_token_parity_pause(model, device=device)),
        check_token_parity_migrate(model, device=device),
        asyncio.run(check_recompute_rescore(model, device=device)),
        check_reference_parity(model, device=device),
        asyncio.run(check_batch_invariance(model, device=device)),
        check_bf16_parity(model, device=device),
        check_episode_checkpoint_parity(model, device=device),
        asyncio.run(check_provenance(model, device=device)),
        asyncio.run(check_rolling_versions(model, device=device)),
        asyncio.run(check_sleep_wake_parity(model, device=device)),
        asyncio.run(check_colocated_provenance(model, device=device)),
        check_layout_roundtrip(model, device=_layout_device(device)),
    ]
    for r in out:
        if not r.passed:
            for k, v in r.figures.items():
                if isinstance(v, float) and math.isnan(v):
                    r.figures[k] = "nan"
    return out
