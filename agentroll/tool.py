"""Tools: functions the model can call, with JSON schemas from signatures and docstrings.

Invariants: a tool's schema lists exactly its non-injected parameters (``sandbox`` and
``state`` are injected by the engine and hidden from the model); arguments are validated
strictly against the signature before the call; a sync tool runs in the engine's bounded
thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import time
import typing
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import msgspec

from agentroll.errors import ConfigError, ToolError
from agentroll.types import ExecResult, ToolCall, ToolResult, ToolSpec, unicode_safe

if TYPE_CHECKING:
    from agentroll.env import EpisodeState

INJECTED = frozenset({"sandbox", "state"})


_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google/NumPy-ish docstring into a description and per-argument texts."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    desc: list[str] = []
    args: dict[str, str] = {}
    section = "desc"
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:", "params:"):
            section, current = "args", None
            continue
        if stripped.lower().rstrip(":") in (
            "returns",
            "return",
            "raises",
            "yields",
            "example",
            "examples",
        ):
            section = "other"
            continue
        if section == "desc":
            desc.append(line)
        elif section == "args":
            m = _ARG_LINE.match(line)
            if m and not line.startswith(" " * 8):
                current = m.group(1).lstrip("*")
                args[current] = m.group(2).strip()
            elif current and stripped:
                args[current] = f"{args[current]} {stripped}".strip()
    return " ".join(" ".join(desc).split()), args


class Tool:
    """A function the model can call.  Build with the ``@tool`` decorator."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
        pure: bool = False,
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.timeout = timeout
        self.pure = pure
        sig = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn)
        except Exception as exc:
            raise ConfigError(f"tool {self.name!r}: cannot resolve type hints ({exc})") from exc
        params = list(sig.parameters.values())
        self.is_method = bool(params) and params[0].name == "self"
        if self.is_method:
            params = params[1:]
        doc_desc, doc_args = _parse_docstring(fn.__doc__)
        self.injected: tuple[str, ...] = tuple(p.name for p in params if p.name in INJECTED)
        fields: list[Any] = []
        for p in params:
            if p.name in INJECTED:
                continue
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ConfigError(
                    f"tool {self.name!r}: *args/**kwargs cannot be described to a model"
                )
            ann = hints.get(p.name, Any)
            if p.default is inspect.Parameter.empty:
                fields.append((p.name, ann))
            else:
                fields.append((p.name, ann, p.default))
        self.arg_names = tuple(f[0] for f in fields)
        self.args_type = msgspec.defstruct(
            f"{self.name}_arguments", fields, kw_only=True, forbid_unknown_fields=True
        )
        self.is_async = inspect.iscoroutinefunction(fn)
        schema = msgspec.json.schema(self.args_type)
        defs = schema.pop("$defs", {})
        params_schema = defs.pop(self.args_type.__name__)
        params_schema.pop("title", None)
        params_schema.setdefault("properties", {})
        params_schema.setdefault("required", [])
        for arg, text in doc_args.items():
            if arg in params_schema["properties"]:
                params_schema["properties"][arg]["description"] = text
        if defs:
            params_schema["$defs"] = defs
        self.spec = ToolSpec(
            name=self.name,
            description=description if description is not None else doc_desc,
            parameters=params_schema,
        )

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check ``arguments`` against the signature; raises ``ValueError`` with a message
        meant for the model."""
        try:
            obj = msgspec.convert(arguments, self.args_type, strict=True)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc).replace("$.", "")) from None
        return {n: getattr(obj, n) for n in self.arg_names}

    async def invoke(
        self,
        owner: Any,
        kwargs: dict[str, Any],
        *,
        state: EpisodeState | None = None,
        executor: Executor | None = None,
    ) -> Any:
        """Run the tool with validated ``kwargs`` (+ injected parameters)."""
        for n in self.injected:
            kwargs[n] = state if n == "state" else (state.sandbox if state else None)
        fn = functools.partial(self.fn, owner) if self.is_method else self.fn
        if self.is_async:
            return await fn(**kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, functools.partial(fn, **kwargs))

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Accessed on an instance, a tool method still calls like a method.
        if obj is None:
            return self
        return functools.partial(self.fn, obj) if self.is_method else self.fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    pure: bool = False,
) -> Any:
    """Mark a function or method as a tool: ``@tool`` or ``@tool(timeout=5)``.

    ``pure=True`` declares that its result is a function of its arguments (and, when it
    takes them, of the episode's task and the sandbox's files) and that it changes nothing
    an episode depends on: with ``RolloutConfig(tool_cache=True)`` a call with the same key
    returns the cached result instead of running it; sampled hits run again, and a tool
    whose result differs is found impure and no longer cached.

    The JSON schema of its arguments comes from the type hints; argument descriptions come
    from an ``Args:`` docstring section.  Parameters named ``sandbox`` and ``state`` are
    injected by the engine and hidden from the schema.  Raise ``ToolError`` to return a
    message to the model; any other exception is also reported to the model.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(f, name=name, description=description, timeout=timeout, pure=pure)

    return wrap(fn) if fn is not None else wrap


def format_tool_output(value: Any) -> str:
    """How a tool's return value is shown to the model."""
    if isinstance(value, str):
        return value
    if isinstance(value, ExecResult):
        parts = [value.stdout]
        if value.stderr:
            parts.append(f"[stderr]\n{value.stderr}")
        if value.timed_out:
            parts.append(f"[timed out after {value.duration:.1f}s]")
        elif value.exit_code != 0:
            parts.append(f"[exit code {value.exit_code}]")
        return "\n".join(p for p in parts if p) or "(no output)"
    if value is None:
        return ""
    try:
        return json.dumps(msgspec.to_builtins(value), ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


async def call_tool(
    tools: dict[str, Tool],
    owner: Any,
    call: ToolCall,
    state: EpisodeState | None,
    limits: tuple[float, int],
    executor: Executor | None = None,
) -> ToolResult:
    """Run one model tool call; every failure becomes a result the model sees.

    ``limits`` is (default timeout in seconds, most characters of output shown).  An unknown
    tool, bad arguments, a ``ToolError``, any other exception and a timeout each give a
    ``ToolResult`` with ``error`` set; only cancellation propagates.
    """
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(tools) or "none"
        return ToolResult(
            call_id=call.id,
            name=call.name,
            error="unknown_tool",
            content=f"Error: unknown tool {call.name!r}; available tools: {known}",
        )
    try:
        kwargs = tool.validate(call.arguments)
    except ValueError as exc:
        return ToolResult(
            call_id=call.id,
            name=call.name,
            error="bad_arguments",
            content=f"Error: bad arguments for {call.name}: {exc}",
        )
    default_timeout, limit = limits
    timeout = tool.timeout or default_timeout
    t0 = time.perf_counter()
    error: str | None = None
    try:
        async with asyncio.timeout(timeout):
            value = await tool.invoke(owner, kwargs, state=state, executor=executor)
        content = format_tool_output(value)
    except TimeoutError:
        error, content = "timeout", f"Error: tool {call.name} timed out after {timeout}s"
    except ToolError as exc:
        error, content = "tool_error", f"Error: {exc}"
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        error, content = "exception", f"Error: {call.name} raised {type(exc).__name__}: {exc}"
    if len(content) > limit:
        half = limit // 2
        content = f"{content[:half]}\n...[{len(content) - 2 * half} characters elided]...\n{content[-half:]}"
    content = unicode_safe(content)
    return ToolResult(
        call_id=call.id,
        name=call.name,
        content=content,
        error=error,
        duration=time.perf_counter() - t0,
    )
