"""An OpenEnv environment server as an agentroll ``Environment`` (``[openenv]`` extra).

Invariants: one server session (an OpenEnv WebSocket) per episode, opened in ``reset`` and
closed when the episode ends, however it ends (``end_episode``); every call
has a deadline; a server that is down, slow, malformed or breaks its contract fails the
episode as data (``OpenEnvError``, translated in ``_translate`` only); openenv is imported
only when an ``OpenEnvEnvironment`` starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

from agentroll.env import Environment, EpisodeState
from agentroll.errors import ConfigError, EnvError, MissingDependencyError, ToolError
from agentroll.tool import Tool, format_tool_output
from agentroll.types import Message, Task, ToolSpec, Trajectory

logger = logging.getLogger("agentroll.integrations.openenv")

# OpenEnv's reserved names (its step/reset API); a tool of the server never has them
_RESERVED = frozenset({"reset", "step", "state", "close"})
# errors a tool call reports that are the model's doing: shown to it, the episode goes on
_MODEL_ERRORS = frozenset({"invalid_args", "execution_error", "timeout"})


class OpenEnvError(EnvError):
    """The OpenEnv server failed: unreachable, no reply in time, a malformed reply, or a
    reply that breaks the protocol (an unknown tool it listed itself).  The episode fails
    with this as its ``error``; the foreign exception is the ``__cause__``."""


def _openenv() -> Any:
    """The openenv client module, or ``MissingDependencyError`` naming the extra."""
    try:
        from openenv.core import generic_client
    except ImportError as exc:
        raise MissingDependencyError("openenv", "openenv") from exc
    return generic_client


def _translate(exc: Exception, what: str, url: str, timeout: float) -> OpenEnvError:
    """The one place where a foreign error becomes an ``OpenEnvError`` saying why."""
    if isinstance(exc, OpenEnvError):
        return exc
    if isinstance(exc, TimeoutError):
        return OpenEnvError(f"{what}: no reply from the OpenEnv server {url} within {timeout}s")
    if isinstance(exc, ConnectionError | OSError):
        return OpenEnvError(f"{what}: cannot reach the OpenEnv server {url}: {exc}")
    if isinstance(exc, RuntimeError):  # the client's reading of an error frame
        return OpenEnvError(f"{what}: the OpenEnv server {url} answered with an error: {exc}")
    if isinstance(exc, ValueError | TypeError | KeyError | AttributeError):
        return OpenEnvError(f"{what}: malformed reply from the OpenEnv server {url}: {exc}")
    return OpenEnvError(f"{what}: the OpenEnv connection to {url} failed: {exc!r}")


def _check_result(result: Any) -> tuple[dict[str, Any], float | None, bool]:
    """(observation, reward, done) of a client ``StepResult``; ``ValueError`` when any is
    not what the protocol says (a dict, a finite number or null, a bool)."""
    obs, reward, done = result.observation, result.reward, result.done
    if not isinstance(obs, dict):
        raise ValueError(f"observation is a {type(obs).__name__}, not an object")
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward)
    ):
        raise ValueError(f"reward {reward!r} is not a finite number")
    if not isinstance(done, bool):
        raise ValueError(f"done {done!r} is not a boolean")
    return obs, None if reward is None else float(reward), done


def render_observation(observation: dict[str, Any]) -> str:
    """Default text of an observation for the model: a lone field's text as it is, else the
    fields (without ``metadata``) as JSON."""
    fields = {k: v for k, v in observation.items() if k not in ("metadata", "reward", "done")}
    if len(fields) == 1:
        (value,) = fields.values()
        if isinstance(value, str):
            return value
    return json.dumps(fields, ensure_ascii=False, default=str)


def _tool_text(result: Any) -> tuple[str, bool]:
    """(text, is_error) of an MCP tool result as OpenEnv serialises it (a FastMCP
    ``CallToolResult``: text content blocks, ``data``, ``is_error``) or a plain value."""
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [
            b["text"]
            for b in result["content"]
            if isinstance(b, dict) and isinstance(b.get("text"), str)
        ]
        is_error = bool(result.get("is_error") or result.get("isError"))
        if texts:
            return "\n".join(texts), is_error
        return format_tool_output(result.get("data")), is_error
    return format_tool_output(result), False


class _RemoteTool(Tool):
    """A tool that runs on the OpenEnv server: its schema is the server's (not derived from a
    signature), its arguments are checked against that schema, and a call goes through the
    episode's session (``OpenEnvEnvironment.call_remote``)."""

    def __init__(self, spec: ToolSpec, *, step: bool, timeout: float | None) -> None:
        # Tool.__init__ derives a schema from a Python signature; this one is given.
        import jsonschema

        self.name, self.spec, self.timeout, self.pure = spec.name, spec, timeout, False
        self.is_method, self.is_async, self.injected = True, True, ()
        self.arg_names = tuple(spec.parameters.get("properties", {}))
        self.is_step = step  # the declared step action, not an MCP tool
        validator = jsonschema.validators.validator_for(spec.parameters)
        self._validator = validator(spec.parameters)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.path))
        if errors:
            raise ValueError("; ".join(e.message for e in errors[:3]))
        return dict(arguments)

    async def invoke(
        self, owner: Any, kwargs: dict[str, Any], *, state: Any = None, executor: Any = None
    ) -> Any:
        return await owner.call_remote(self, kwargs)


class _Session:
    """One OpenEnv session: a connected client, closed once."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.closed = False


class OpenEnvEnvironment(Environment):
    """An OpenEnv environment server, by ``url``, as an agentroll environment.

    Use as ``async with OpenEnvEnvironment(url=...) as env:`` (or ``await env.start()`` /
    ``await env.aclose()``) around the ``RolloutEngine``: ``start`` lists the server's MCP
    tools (they become tools with the server's JSON schemas) and fetches the action schema
    when ``action_tool`` is set.

    An episode opens its own session in ``reset``: the reset observation becomes a user
    message (after ``system_prompt`` and the task's ``data['prompt']``, if any; the task's
    ``data['reset']`` holds extra reset arguments).  A tool call is an MCP ``call_tool``
    step; its result is the tool message.  The declared step actions: ``action_tool``
    names a tool whose arguments are the env's Action (schema from ``/schema``), and
    ``text_action`` maps a reply without tool calls to an Action (a field name, the text
    becomes that field, or a function of the text returning the action's fields); without
    it such a reply ends the episode.  Observations of step actions become user messages
    (``render``, default ``render_observation``).  ``done`` on any observation ends the
    episode; the trajectory's reward is the sum of the observations' rewards.

    ``timeout`` bounds every call (connect, reset, step, close) in seconds.  A server that
    is down, slow, sends a malformed observation, or reports a tool it listed as unknown
    fails the episode with an ``OpenEnvError`` saying why; a tool's own error, bad arguments
    or an unknown tool name from the model are shown to the model, as for ``@tool`` tools.
    ``image=`` (a server started from a docker image) is not supported: agentroll's
    sandboxes have no network, and an OpenEnv server is reached over one.
    """

    name = "openenv"
    max_turns = 8

    def __init__(
        self,
        url: str,
        *,
        tasks: Iterable[Task] | None = None,
        num_tasks: int = 1,
        mcp: bool = True,
        action_tool: str | None = None,
        text_action: str | Callable[[str], dict[str, Any]] | None = None,
        render: Callable[[dict[str, Any]], str] = render_observation,
        system_prompt: str | None = None,
        timeout: float = 30.0,
        max_turns: int = 8,
        headers: dict[str, str] | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ConfigError(f"url {url!r}: give the server's http(s):// or ws(s):// address")
        if not timeout > 0:
            raise ConfigError(f"timeout={timeout}: give a positive number of seconds")
        if action_tool in _RESERVED:
            raise ConfigError(f"action_tool={action_tool!r} is reserved by OpenEnv; rename it")
        if num_tasks < 1:
            raise ConfigError("num_tasks must be >= 1")
        self.url = url.rstrip("/")
        self._tasks = list(tasks) if tasks is not None else None
        self.num_tasks = num_tasks
        self.mcp = mcp
        self.action_tool = action_tool
        self.text_action = text_action
        self.render = render
        self.system_prompt_text = system_prompt
        self.timeout = timeout
        # the engine's limit on a tool call stays above this one's deadline, so that a slow
        # server is this environment's failure (latched), not a timeout shown to the model
        self._tool_limit = 2 * timeout + 1
        self.max_turns = max_turns
        self.headers = headers
        self._remote: dict[str, Tool] | None = None
        self._root = self
        self._open: set[_Session] = set()  # sessions not yet closed (kept by the root)
        # per episode (set in reset on the episode's copy)
        self._session: _Session | None = None
        self._fault: OpenEnvError | None = None
        self._done = False
        self._rewards: list[float] = []

    # -- lifecycle of the whole environment --

    async def __aenter__(self) -> OpenEnvEnvironment:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Connect once to list the tools (and the action schema); raises ``OpenEnvError``
        when the server cannot be used, ``MissingDependencyError`` without openenv."""
        _openenv()
        tools: dict[str, Tool] = {}
        if self.action_tool is not None:
            schema = await self._action_schema()
            spec = ToolSpec(
                name=self.action_tool,
                description=schema.pop("description", "") or "Take a step in the environment.",
                parameters=schema,
            )
            tools[spec.name] = _RemoteTool(spec, step=True, timeout=self._tool_limit)
        if self.mcp:
            session = await self._connect()
            try:
                result = await self._call(session, "list_tools", {"type": "list_tools"})
                listed = result[0].get("tools")
                if not isinstance(listed, list):
                    raise OpenEnvError(
                        f"list_tools: malformed reply from {self.url}: no 'tools' list"
                    )
                for payload in listed:
                    spec = _tool_spec(payload)
                    tools[spec.name] = _RemoteTool(spec, step=False, timeout=self._tool_limit)
            finally:
                await self._close_session(session)
        self._remote = tools

    async def aclose(self) -> None:
        """Close every session still open (episodes the engine dropped mid-way)."""
        root = self._root
        for session in list(root._open):
            await root._close_session(session)

    # -- what the engine reads --

    @property
    def tools(self) -> dict[str, Tool]:
        if self._remote is None:
            raise ConfigError(
                "OpenEnvEnvironment is not started: use `async with OpenEnvEnvironment(...) "
                "as env:` (or `await env.start()`) before building the RolloutEngine"
            )
        return self._remote

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [t.spec for t in self.tools.values()]

    def tasks(self) -> list[Task]:
        if self._tasks is not None:
            return self._tasks
        return [Task(id=f"openenv-{i}") for i in range(self.num_tasks)]

    # -- one episode --

    async def reset(self, task: Task, *, seed: int) -> list[Message]:
        self._fault, self._done, self._rewards, self._session = None, False, [], None
        session = await self._connect()
        self._session = session
        extra = task.data.get("reset", {})
        if not isinstance(extra, dict):
            raise ConfigError(f"task {task.id!r}: data['reset'] must be a dict of reset arguments")
        # OpenEnv servers seed numpy-style generators: keep the seed within 32 bits
        obs, _, done = await self._call(
            session, "reset", {"seed": seed % 2**32, **extra}, reset=True
        )
        self._done = done
        messages = []
        if self.system_prompt_text:
            messages.append(Message(role="system", content=self.system_prompt_text))
        prompt = task.data.get("prompt")
        if isinstance(prompt, str):
            messages.append(Message(role="user", content=prompt))
        messages.append(Message(role="user", content=self.render(obs)))
        return messages

    async def env_response(
        self, messages: list[Message], state: EpisodeState
    ) -> list[Message] | None:
        if self.text_action is None or self._done:
            return None
        text = messages[-1].content if messages else ""
        action = self.text_action(text) if callable(self.text_action) else {self.text_action: text}
        obs = await self._step(action, "step")
        return [Message(role="user", content=self.render(obs))]

    def is_done(self, state: EpisodeState) -> bool:
        return self._done or self._fault is not None

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        if self._session is not None:
            await self._close_session(self._session)
        if self._fault is not None:
            raise self._fault
        return float(sum(self._rewards))

    async def end_episode(self, state: EpisodeState) -> None:
        """The engine's end of the episode, however it ended: its session is closed."""
        if self._session is not None:
            await self._close_session(self._session)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ConfigError(
            "an OpenEnv episode cannot continue from a checkpoint: its server session is gone"
        )

    async def call_remote(self, tool: _RemoteTool, arguments: dict[str, Any]) -> str:
        """Run ``tool`` on this episode's session; its text for the model.  A tool's own
        failure is a ``ToolError``; a server failure is latched (the episode then ends and
        fails with it) and raised as ``OpenEnvError``."""
        if tool.is_step:
            return self.render(await self._step(arguments, tool.name))
        action = {"type": "call_tool", "tool_name": tool.name, "arguments": arguments}
        obs = await self._step(action, f"call_tool {tool.name}")
        error = obs.get("error")
        if error:
            kind = error.get("error_type") if isinstance(error, dict) else None
            message = error.get("message") if isinstance(error, dict) else str(error)
            if kind in _MODEL_ERRORS:
                raise ToolError(str(message))
            exc = OpenEnvError(
                f"call_tool {tool.name}: the OpenEnv server {self.url} failed the call "
                f"({kind or 'error'}): {message}"
            )
            await self._fail(exc)
            raise exc
        text, is_error = _tool_text(obs.get("result"))
        if is_error:
            raise ToolError(text)
        return text

    # -- the session --

    async def _step(self, action: dict[str, Any], what: str) -> dict[str, Any]:
        if self._session is None or self._session.closed:
            raise OpenEnvError(f"{what}: the episode's OpenEnv session is closed")
        obs, reward, done = await self._call(self._session, what, action)
        if reward is not None:
            self._rewards.append(reward)
        self._done = self._done or done
        return obs

    async def _call(
        self, session: _Session, what: str, payload: dict[str, Any], *, reset: bool = False
    ) -> tuple[dict[str, Any], float | None, bool]:
        """One request on ``session`` under the deadline; a failure closes the session,
        is latched for the episode and raised as ``OpenEnvError``."""
        try:
            async with asyncio.timeout(self.timeout):
                if reset:
                    result = await session.client.reset(**payload)
                else:
                    result = await session.client.step(payload)
            return _check_result(result)
        except asyncio.CancelledError:
            await self._close_session(session)
            raise
        except Exception as exc:
            err = _translate(exc, what, self.url, self.timeout)
            if session is self._session:
                await self._fail(err)
            else:
                await self._close_session(session)
            raise err from exc

    async def _fail(self, exc: OpenEnvError) -> None:
        self._fault = self._fault or exc
        if self._session is not None:
            await self._close_session(self._session)

    async def _connect(self) -> _Session:
        client = _openenv().GenericEnvClient(
            base_url=self.url,
            connect_timeout_s=self.timeout,
            message_timeout_s=self.timeout,
            headers=self.headers,
        )
        session = _Session(client)
        self._root._open.add(session)
        try:
            async with asyncio.timeout(self.timeout):
                await client.__aenter__()
        except asyncio.CancelledError:
            await self._close_session(session)
            raise
        except Exception as exc:
            await self._close_session(session)
            raise _translate(exc, "connect", self.url, self.timeout) from exc
        return session

    async def _close_session(self, session: _Session) -> None:
        """Close ``session`` once, shielded from cancellation and bounded by the timeout
        (a server that never acknowledges the close is left to drop the socket)."""
        if session.closed:
            return
        session.closed = True
        self._root._open.discard(session)

        async def close() -> None:
            try:
                async with asyncio.timeout(self.timeout):
                    await session.client.close()
            except Exception as exc:  # the episode's outcome is already decided
                logger.debug("closing an OpenEnv session of %s failed: %r", self.url, exc)

        await asyncio.shield(close())

    async def _action_schema(self) -> dict[str, Any]:
        """The env's Action JSON schema from ``GET /schema`` (its ``metadata`` field, which
        is OpenEnv's bookkeeping, left out)."""
        import httpx

        base = self.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
        try:
            async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as http:
                response = await http.get(f"{base}/schema")
                response.raise_for_status()
                schema = response.json()["action"]
            if not isinstance(schema, dict):
                raise TypeError("the action schema is not an object")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise _translate(
                ConnectionError(str(exc)) if isinstance(exc, httpx.TransportError) else exc,
                "schema",
                self.url,
                self.timeout,
            ) from exc
        schema = dict(schema)
        schema.pop("title", None)
        props = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
        schema["properties"] = props
        schema["required"] = [r for r in schema.get("required", []) if r in props]
        schema.setdefault("type", "object")
        return schema


def _tool_spec(payload: Any) -> ToolSpec:
    """A listed MCP tool as a ``ToolSpec``; ``OpenEnvError`` when it is not one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise OpenEnvError(f"list_tools: malformed tool {payload!r:.200}")
    schema = payload.get("input_schema", payload.get("inputSchema")) or {"type": "object"}
    if not isinstance(schema, dict):
        raise OpenEnvError(f"list_tools: tool {payload['name']!r} has a malformed schema")
    schema = {k: v for k, v in schema.items() if k != "title"}
    schema.setdefault("properties", {})
    schema.setdefault("required", [])
    return ToolSpec(
        name=payload["name"],
        description=str(payload.get("description") or ""),
        parameters=schema,
    )


__all__ = ["OpenEnvEnvironment", "OpenEnvError", "render_observation"]
