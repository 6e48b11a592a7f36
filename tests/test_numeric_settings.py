"""NaN is refused wherever a number is configured (a check written ``x <= 0`` lets NaN through:
every comparison with NaN is false).  Each of these used to be taken: a NaN temperature made
every sampling probability NaN, a NaN exec timeout killed each command at once."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import pytest

from agentroll.backends.base import SamplingParams
from agentroll.backends.mock import MockBackend
from agentroll.errors import ConfigError
from agentroll.model.tokenizer import tiny_chat_tokenizer
from agentroll.rollout.engine import RolloutConfig
from agentroll.sandbox import open_sandbox
from agentroll.sandbox._ratelimit import TokenBucket
from agentroll.sandbox.base import SandboxConfig
from agentroll.trainer.advantages import group_advantages
from agentroll.trainer.grpo import GRPOConfig

NAN = math.nan


async def _exec_with_timeout(timeout: float) -> None:
    async with open_sandbox(SandboxConfig(backend="local")) as sandbox:
        await sandbox.exec("true", timeout=timeout)


CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("temperature", lambda: SamplingParams(temperature=NAN), ValueError, "temperature"),
    ("temperature inf", lambda: SamplingParams(temperature=math.inf), ValueError, "finite"),
    ("sandbox timeout", lambda: SandboxConfig(timeout=NAN), ValueError, "timeout"),
    ("exec timeout", lambda: asyncio.run(_exec_with_timeout(NAN)), ValueError, "timeout"),
    ("creation rate", lambda: TokenBucket(NAN, 1, 0.0), ValueError, "rate"),
    ("episode timeout", lambda: RolloutConfig(episode_timeout=NAN), ConfigError, "episode"),
    ("advantage eps", lambda: group_advantages([1.0, 2.0], ["g", "g"], eps=NAN), ValueError, "eps"),
    ("weight decay", lambda: GRPOConfig(weight_decay=NAN), ConfigError, "weight_decay"),
    (
        "mock latency",
        lambda: MockBackend(["x"], tokenizer=tiny_chat_tokenizer(), latency=NAN),
        ConfigError,
        "latency",
    ),
]


@pytest.mark.parametrize(("what", "make", "error", "match"), CASES, ids=[c[0] for c in CASES])
def test_nan_is_refused(
    what: str, make: Callable[[], Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make()
