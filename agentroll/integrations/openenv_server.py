"""Any agentroll ``Environment`` served as an OpenEnv environment server (``[openenv]``).

Built on openenv's own server (``create_fastapi_app`` + ``MCPEnvironment``): reset/step/state
over HTTP and WebSocket, the environment's tools over MCP, so OpenEnv's clients drive it.
Invariants: one episode per WebSocket session, on its own ``spawn()`` copy and its own
sandbox, closed when the session ends; binds 127.0.0.1 unless told otherwise; with a
``token`` every request (HTTP and WebSocket) must carry ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import msgspec

from agentroll._net import is_loopback
from agentroll.env import Environment, EpisodeState, call_hook, load_environment
from agentroll.errors import ConfigError, MissingDependencyError
from agentroll.sandbox import Sandbox, open_sandbox
from agentroll.tool import call_tool
from agentroll.types import Message, Task, ToolCall, Trajectory, new_id

try:
    import uvicorn
    from fastapi import FastAPI
    from fastmcp import FastMCP
    from fastmcp.tools import Tool as McpTool
    from fastmcp.tools import ToolResult
    from openenv.core.env_server import (
        Action,
        CallToolAction,
        ListToolsAction,
        MCPEnvironment,
        Observation,
        State,
        create_fastapi_app,
    )
    from openenv.core.utils import run_async_safely
    from pydantic import Field, PrivateAttr
except ImportError as exc:  # the module is imported only when serving
    raise MissingDependencyError("openenv", "openenv") from exc

_RESERVED = frozenset({"reset", "step", "state", "close"})
_CLOSE_TIMEOUT = 30.0  # seconds a session's sandbox may take to close


class AgentrollAction(Action):
    """A step: ``message`` (the agent's reply without tool calls: ``env_response`` answers
    it), or OpenEnv's MCP actions ``call_tool`` / ``list_tools`` (so OpenEnv's
    ``MCPToolClient`` works on the WebSocket)."""

    type: Literal["message", "call_tool", "list_tools"] = "message"
    content: str = Field(default="", description="the agent's reply (type 'message')")
    tool_name: str = Field(default="", description="the tool to call (type 'call_tool')")
    arguments: dict[str, Any] = Field(default_factory=dict, description="its arguments")


class AgentrollObservation(Observation):
    """The messages the environment added (reset: the initial prompt; a step: its reply),
    as ``{"role", "content", ...}`` dicts, and the task's id."""

    messages: list[dict[str, Any]] = Field(default_factory=list)
    task_id: str = ""


class AgentrollState(State):
    """The session's task, turn and whether its episode is over."""

    task_id: str = ""
    turn: int = 0
    done: bool = False
    reward: float | None = None


class _EnvTool(McpTool):
    """An agentroll tool as a FastMCP tool: its schema is the agentroll tool's; a call runs
    it through ``agentroll.tool.call_tool`` on the session's episode."""

    _session: Any = PrivateAttr(default=None)

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        content, is_error = await self._session.run_tool(self.name, arguments)
        # structured too: OpenEnv's MCPToolClient.call_tool returns the result's ``data``,
        # which is then ``{"result": text}``
        return ToolResult(
            content=content, structured_content={"result": content}, is_error=is_error
        )


class ServedEpisode(MCPEnvironment):
    """One OpenEnv session over an agentroll environment (made by the server's factory)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, env: Environment, tasks: list[Task], tool_timeout: float) -> None:
        mcp = FastMCP(env.name or "agentroll")
        for spec in env.tool_specs:
            if spec.name in _RESERVED:
                raise ConfigError(f"tool {spec.name!r} is reserved by OpenEnv; rename it")
            tool = _EnvTool(
                name=spec.name, description=spec.description, parameters=spec.parameters
            )
            tool._session = self
            mcp.add_tool(tool)
        super().__init__(mcp)
        self._proto, self._tasks, self._tool_timeout = env, tasks, tool_timeout
        self._env: Environment | None = None
        self._episode: EpisodeState | None = None
        self._sandbox: Sandbox | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = AgentrollState()
        self._calls = 0

    # -- reset / step --

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> AgentrollObservation:
        self._loop = asyncio.get_running_loop()
        await self._close_sandbox()
        task = self._pick(seed, kwargs)
        env = self._proto.spawn()
        state = EpisodeState(task, seed=seed or 0, episode_id=episode_id or new_id())
        if env.sandbox_config is not None:
            self._sandbox = open_sandbox(env.sandbox_config, episode_id=state.episode_id)
            await self._sandbox.start()
            state.sandbox = self._sandbox
        messages = await call_hook(env.reset, task, seed=state.seed)
        state.messages = [msgspec.convert(msgspec.to_builtins(m), Message) for m in messages]
        self._env, self._episode = env, state
        self._state = AgentrollState(episode_id=state.episode_id, task_id=task.id)
        return AgentrollObservation(messages=_dicts(state.messages), task_id=task.id)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> AgentrollObservation:
        return run_async_safely(self.reset_async(seed=seed, episode_id=episode_id, **kwargs))

    async def step_async(
        self, action: Action, timeout_s: float | None = None, **kwargs: Any
    ) -> Observation:
        if isinstance(action, AgentrollAction) and action.type != "message":
            action = (
                CallToolAction(tool_name=action.tool_name, arguments=action.arguments)
                if action.type == "call_tool"
                else ListToolsAction()
            )
        if isinstance(action, ListToolsAction):  # needs no episode (OpenEnv's RFC 003)
            return await super().step_async(action)
        env, state = self._require_episode()
        if isinstance(action, AgentrollAction):  # a reply without tool calls
            state.messages.append(Message(role="assistant", content=action.content))
            reply = await call_hook(env.env_response, state.messages, state)
            new = (
                []
                if reply is None
                else [msgspec.convert(msgspec.to_builtins(m), Message) for m in reply]
            )
            state.messages.extend(new)
            obs: Observation = AgentrollObservation(messages=_dicts(new), task_id=state.task.id)
            return await self._after_turn(obs, ended=reply is None)
        obs = await super().step_async(action, timeout_s=timeout_s or self._tool_timeout)
        if isinstance(action, CallToolAction):
            return await self._after_turn(obs, ended=False)
        return obs

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return run_async_safely(self.step_async(action, timeout_s=timeout_s, **kwargs))

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Any:
        raise TypeError(f"unexpected action {type(action).__name__}")  # step_async routes all

    @property
    def state(self) -> AgentrollState:
        return self._state

    # -- what the FastMCP tools call --

    async def run_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run the environment's tool ``name``: (text for the agent, is it an error)."""
        env, state = self._require_episode()
        self._calls += 1
        call = ToolCall(id=f"call_{self._calls}", name=name, arguments=arguments)
        state.messages.append(Message(role="assistant", tool_calls=[call]))
        limits = (env.tool_timeout or self._tool_timeout, 16_384)
        result = await call_tool(env.tools, env, call, state, limits)
        state.messages.append(
            Message(role="tool", content=result.content, tool_call_id=call.id, name=name)
        )
        return result.content, result.error is not None

    # -- internals --

    def _pick(self, seed: int | None, kwargs: dict[str, Any]) -> Task:
        """The task named by ``task_id``, else at ``task_index``, else at ``seed`` (mod the
        number of tasks), else the first."""
        if "task_id" in kwargs:
            found = [t for t in self._tasks if t.id == kwargs["task_id"]]
            if not found:
                raise ValueError(f"no task with id {kwargs['task_id']!r}")
            return found[0]
        if not self._tasks:
            raise ValueError("the environment has no tasks")
        index = kwargs.get("task_index", seed or 0)
        if not isinstance(index, int):
            raise ValueError("task_index must be an integer")
        return self._tasks[index % len(self._tasks)]

    def _require_episode(self) -> tuple[Environment, EpisodeState]:
        if self._env is None or self._episode is None:
            raise ValueError("call reset before step")
        if self._state.done:
            raise ValueError("the episode is over; call reset to start another")
        return self._env, self._episode

    async def _after_turn(self, obs: Observation, *, ended: bool) -> Observation:
        """Count the turn; when the episode is over (no more reply, the environment's stop
        condition, or ``max_turns``), score it and say so on the observation."""
        env, state = self._require_episode()
        state.turn += 1
        self._state.turn = self._state.step_count = state.turn
        if ended or env.is_done(state) or state.turn >= env.max_turns:
            reward = await _score(env, state)
            obs.done, obs.reward = True, reward
            self._state.done, self._state.reward = True, reward
        return obs

    async def _close_sandbox(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await asyncio.shield(sandbox.close())

    def close(self) -> None:
        """The server ends the session (in a worker thread): close its sandbox on the loop
        that made it."""
        loop = self._loop
        if self._sandbox is not None and loop is not None and not loop.is_closed():
            future = asyncio.run_coroutine_threadsafe(self._close_sandbox(), loop)
            with contextlib.suppress(Exception):
                future.result(timeout=_CLOSE_TIMEOUT)
        super().close()


def _dicts(messages: list[Message]) -> list[dict[str, Any]]:
    return [msgspec.to_builtins(m) for m in messages]


async def _score(env: Environment, state: EpisodeState) -> float:
    """The episode's reward from its messages (the rubric, else ``env.reward``)."""
    traj = Trajectory(
        id=state.episode_id,
        task_id=state.task.id,
        group_id=state.episode_id,
        env_name=env.name,
        env_version=env.version,
        messages=list(state.messages),
    )
    if env.rubric is not None:
        return env.rubric.combine(await env.rubric.score(env, traj, state, None))
    value = await call_hook(env.reward, traj, state)
    return float(sum(value.values())) if isinstance(value, dict) else float(value)


def create_app(
    env: Environment | str,
    *,
    max_sessions: int = 64,
    tool_timeout: float = 60.0,
    token: str | None = None,
    **env_kwargs: Any,
) -> Any:
    """The ASGI app serving ``env`` (an instance, or a name ``load_environment`` takes, with
    ``env_kwargs``) as an OpenEnv server: ``/reset``, ``/step``, ``/state``, ``/schema``,
    ``/ws``, ``/mcp``.  ``reset`` takes ``seed``, ``task_id`` or ``task_index`` to pick
    the task.  With ``token``, every request must carry it as a bearer token."""
    instance = load_environment(env, **env_kwargs) if isinstance(env, str) else env
    tasks = list(instance.tasks())
    app: FastAPI = create_fastapi_app(
        functools.partial(ServedEpisode, instance, tasks, tool_timeout),
        AgentrollAction,
        AgentrollObservation,
        max_concurrent_envs=max_sessions,
        env_name=instance.name,
        state_cls=AgentrollState,
        mode="simulation",
    )
    return app if token is None else BearerAuth(app, token)


class BearerAuth:
    """ASGI middleware: HTTP and WebSocket requests need ``Authorization: Bearer <token>``
    (compared in constant time); others get 401 or a close with code 1008."""

    def __init__(self, app: Any, token: str) -> None:
        if not token.strip():
            raise ConfigError("the server token is empty; give a non-empty token")
        self.app, self._expected = app, f"Bearer {token.strip()}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"text/plain")],
                    }
                )
                await send({"type": "http.response.body", "body": b"unauthorized\n"})
                return
        await self.app(scope, receive, send)


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``(host, port)``; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from exc
    return sock


class _Server(uvicorn.Server):
    """A uvicorn server that calls ``on_ready`` once it listens (its signal handlers, when
    it runs in the main thread, are installed by then)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self._on_ready is not None and not self.should_exit:
            self._on_ready()


def server_for(app: Any, on_ready: Callable[[], None] | None = None) -> uvicorn.Server:
    """A uvicorn server for ``app`` (quiet: warnings only); ``on_ready()`` runs once it
    accepts connections."""
    config = uvicorn.Config(app, log_level="warning", lifespan="on", ws="websockets-sansio")
    return _Server(config, on_ready)


@contextlib.contextmanager
def serve_app(
    app: Any, host: str = "127.0.0.1", port: int = 0, *, ready_timeout: float = 30.0
) -> Iterator[str]:
    """Serve ``app`` in a background thread for the ``with`` block; yields its base URL
    (``http://host:port``) once it accepts connections.  Raises ``RuntimeError`` when it
    does not start within ``ready_timeout`` seconds.  On exit the server stops and its
    thread is joined: nothing outlives the block."""
    sock = bind(host, port)
    ready = threading.Event()
    server = server_for(app, ready.set)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="openenv-server", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + ready_timeout
        while not ready.wait(0.05):  # a deadline, and a thread that died in startup
            if not thread.is_alive():
                raise RuntimeError("the OpenEnv server thread exited during startup")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server did not start in {ready_timeout}s")
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        yield f"http://{shown}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(ready_timeout)
        sock.close()


__all__ = [
    "AgentrollAction",
    "AgentrollObservation",
    "AgentrollState",
    "BearerAuth",
    "ServedEpisode",
    "bind",
    "create_app",
    "is_loopback",
    "serve_app",
    "server_for",
]
