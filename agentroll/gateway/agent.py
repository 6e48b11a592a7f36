"""An existing agent as an environment: ``async def agent(task, base_url, api_key)``.

Invariants: each episode is one gateway session, ended in ``finally`` (a failing agent is
data: the session's samples carry ``status="failed"`` and the error); the agent's return
value (a reward, named rewards, or None) is the episode's reward, else what it posted to
the session's reward route, else ``reward(trajectory)``; the gateway and its server live
exactly as long as the engine that opened them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from agentroll.env import Environment, EpisodeState, call_hook
from agentroll.errors import ConfigError, EnvError
from agentroll.gateway.config import GatewayConfig
from agentroll.gateway.gateway import Gateway
from agentroll.gateway.routes import serve_gateway
from agentroll.types import Status, Task, Trajectory, unicode_safe

AgentFn = Callable[[Task, str, str], Awaitable[Any] | Any]


class AgentEnvironment(Environment):
    """Runs ``agent(task, base_url, api_key)`` per episode against the engine's backend.

    The agent talks OpenAI Chat Completions to ``base_url`` (a session's ``/v1``) with
    ``api_key``; it may be a coroutine function, a plain function (run in a thread), or
    start a process or container that only gets the URL and key.  Everything else is as
    for a class environment: concurrency, admission, seeds and groups come from the engine.
    """

    name = "agent"

    def __init__(
        self,
        agent: AgentFn,
        *,
        tasks: Iterable[Task] | None = None,
        config: GatewayConfig | None = None,
        name: str | None = None,
        host: str = "127.0.0.1",
        token: str | None = None,
    ) -> None:
        if not callable(agent):
            raise ConfigError("AgentEnvironment needs a callable agent(task, base_url, api_key)")
        self.agent = agent
        self._tasks = list(tasks) if tasks is not None else None
        self.gateway_config = config or GatewayConfig()
        if name:
            self.name = name  # type: ignore[misc]
        self._host, self._token = host, token
        self.gateway: Gateway | None = None
        self.url = ""
        self._stack: contextlib.AsyncExitStack | None = None

    def spawn(self) -> AgentEnvironment:
        return self  # one gateway serves every episode

    def tasks(self) -> Iterable[Task]:
        if self._tasks is None:
            raise ConfigError("AgentEnvironment has no tasks; pass tasks=... or to engine.run()")
        return self._tasks

    async def open_driver(self, backend: Any, tokenizer: Any) -> None:
        stack = contextlib.AsyncExitStack()
        try:
            # each episode takes its samples from ``end``: the gateway keeps none of them
            self.gateway = await stack.enter_async_context(
                Gateway(backend, tokenizer=tokenizer, config=self.gateway_config, publish=_drop)
            )
            self.url = await stack.enter_async_context(
                serve_gateway(self.gateway, host=self._host, token=self._token)
            )
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack

    async def close_driver(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()
        self.gateway = None

    async def drive_episode(
        self, task: Task, state: EpisodeState, group_id: str
    ) -> list[Trajectory]:
        gw = self.gateway
        if gw is None:
            raise RuntimeError("AgentEnvironment is not open; run it inside a RolloutEngine")
        session = gw.open_session(task=task, seed=state.seed)
        error: str | None = "CancelledError: the episode was cancelled"  # until the agent returns
        try:
            value = await call_hook(
                self.agent, task, f"{self.url}/sessions/{session.id}/v1", session.id
            )
            if isinstance(value, dict):
                session.set_reward(None, {str(k): float(v) for k, v in value.items()})
            elif value is not None:
                session.set_reward(float(value), None)
            error = None
        except Exception as exc:  # a failed agent is data
            error = unicode_safe(f"{type(exc).__name__}: {exc}")
        finally:
            status: Status = "failed" if error is not None else "ok"
            samples = await gw.end(session, status=status, reason="agent_error" if error else "")
        if not samples and error is not None:  # it failed before its first call: say why
            raise EnvError(f"the agent failed before its first model call: {error}")
        for t in samples:
            t.error = error
        if error is None and session.reward is None and samples:
            for t in samples:
                value = await call_hook(self.reward, t, state)
                t.reward = float(value) if not isinstance(value, dict) else sum(value.values())
                t.rewards = value if isinstance(value, dict) else {"reward": t.reward}
        return samples

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        """The reward when the agent returned None and posted none.  Default: 0."""
        return 0.0


async def _drop(trajectories: list[Trajectory]) -> None:
    """The gateway's sink under an engine: the episode already holds the samples."""


__all__ = ["AgentEnvironment", "AgentFn"]
