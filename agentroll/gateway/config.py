"""Static settings of a gateway (per-call parameters come with each call).

Invariant: a ``GatewayConfig`` is valid once constructed; a bad value raises
``ConfigError`` saying what to change.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from agentroll.errors import ConfigError


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Static settings of a gateway; invalid values raise ``ConfigError``.

    ``tool_parser``: how tool calls are read from the model's text; ``idle_timeout``:
    seconds without a call after which a session ends as abandoned; ``max_tokens``: a call's
    limit when it names none, ``max_tokens_limit`` the most a call may ask; ``fork_policy``:
    ``fork`` starts a new sample when a call rewrites the history, ``refuse`` answers 409;
    ``model``: the name ``/v1/models`` lists."""

    tool_parser: str = "hermes"
    idle_timeout: float = 600.0
    max_tokens: int = 512
    max_tokens_limit: int = 32_768
    max_sessions: int = 65_536
    max_body_bytes: int = 8 << 20
    fork_policy: Literal["fork", "refuse"] = "fork"
    model: str = "agentroll"
    keep_messages: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.idle_timeout, int | float) and 0 < self.idle_timeout < math.inf):
            raise ConfigError(f"gateway idle_timeout={self.idle_timeout!r}; use seconds > 0")
        for name in ("max_tokens", "max_tokens_limit", "max_sessions", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"gateway {name}={value!r}; use an int >= 1")
        if self.max_tokens > self.max_tokens_limit:
            raise ConfigError("gateway max_tokens exceeds max_tokens_limit; lower it")
        if self.fork_policy not in ("fork", "refuse"):
            raise ConfigError(f"gateway fork_policy={self.fork_policy!r}; use fork or refuse")


__all__ = ["GatewayConfig"]
