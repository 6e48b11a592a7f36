"""A small OpenEnv environment server written with openenv's own server API (``[openenv]``).

Arithmetic questions answered with two MCP tools, ``calc`` and ``submit``; ``submit`` ends
the episode with reward 1.0 for the right answer, else 0.0.  A question is a pure function of
the reset seed.  ``SessionStats`` counts the sessions the server opened and closed, which is
what the tests check "one session per episode, all closed" against.
"""

from __future__ import annotations

import functools
import random
import threading
from typing import Any

from agentroll.errors import MissingDependencyError, ToolError
from agentroll.tools.calculator import evaluate

try:
    from fastapi import FastAPI
    from fastmcp import FastMCP
    from fastmcp.tools import ToolResult
    from openenv.core.env_server import (
        Action,
        CallToolAction,
        CallToolObservation,
        MCPEnvironment,
        Observation,
        State,
        create_fastapi_app,
    )
except ImportError as exc:  # the module is imported only when the example is used
    raise MissingDependencyError("openenv", "openenv") from exc

MAX_STEPS = 8


class SessionStats:
    """Sessions opened and closed by a server (thread-safe: sessions start in threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.opened = 0
        self.closed = 0

    def open(self) -> None:
        with self._lock:
            self.opened += 1

    def close(self) -> None:
        with self._lock:
            self.closed += 1

    @property
    def live(self) -> int:
        return self.opened - self.closed


class QuestionObservation(Observation):
    """What ``reset`` shows: the question."""

    question: str = ""


def question(seed: int | None) -> tuple[str, float]:
    """The question of ``seed`` and its answer: two or three integers with ``+ - *``."""
    rng = random.Random(seed)
    terms = [str(rng.randint(1, 20)) for _ in range(rng.randint(2, 3))]
    expr = terms[0]
    for term in terms[1:]:
        expr += f" {rng.choice('+-*')} {term}"
    return f"What is {expr}? Use calc to compute, then submit the answer.", evaluate(expr)


class ArithmeticEnvironment(MCPEnvironment):
    """One session: a question, ``calc`` and ``submit`` tools, a reward on ``submit``."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, stats: SessionStats | None = None) -> None:
        mcp = FastMCP("arithmetic")
        self._answer: float | None = None
        self._submitted: float | None = None
        self._state = State(step_count=0)
        self._stats = stats

        @mcp.tool
        def calc(expression: str) -> ToolResult:
            """Evaluate an arithmetic expression such as "(3 + 4) * 2".

            Args:
                expression: integers, + - * / and parentheses.
            """
            try:
                return ToolResult(content=str(evaluate(expression)))
            except ToolError as exc:  # the agent's mistake: an error result, not a crash
                return ToolResult(content=str(exc), is_error=True)

        @mcp.tool
        def submit(answer: float) -> str:
            """Submit the final answer; this ends the episode.

            Args:
                answer: the value of the expression.
            """
            self._submitted = answer
            return "submitted"

        super().__init__(mcp)
        if stats is not None:
            stats.open()

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> QuestionObservation:
        text, self._answer = question(seed)
        self._submitted = None
        self._state = State(episode_id=episode_id, step_count=0)
        return QuestionObservation(question=text)

    async def step_async(
        self, action: Action, timeout_s: float | None = None, **kwargs: Any
    ) -> Observation:
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            if self._submitted is not None:
                obs.done = True
                obs.reward = float(self._answer is not None and self._submitted == self._answer)
            elif self._state.step_count >= MAX_STEPS:
                obs.done, obs.reward = True, 0.0
        return obs

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Any:
        raise ValueError(f"{type(self).__name__} takes MCP actions only (call_tool, list_tools)")

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        if self._stats is not None and self.mcp_client is not None:
            self._stats.close()
        super().close()


def create_example_app(*, max_sessions: int = 64, stats: SessionStats | None = None) -> FastAPI:
    """The example server's ASGI app (serve it with ``openenv_server.serve_app``)."""
    return create_fastapi_app(
        functools.partial(ArithmeticEnvironment, stats),
        CallToolAction,
        CallToolObservation,
        max_concurrent_envs=max_sessions,
        env_name="arithmetic",
        reset_observation_cls=QuestionObservation,
        mode="simulation",
    )


__all__ = [
    "ArithmeticEnvironment",
    "QuestionObservation",
    "SessionStats",
    "create_example_app",
    "question",
]
