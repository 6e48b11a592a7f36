"""OpenAI Chat Completions and Completions bodies: decoding, checks, and the replies.

Invariants: a body is decoded into typed Structs or refused with ``RequestError`` (an
OpenAI-style error: status, message saying what to change, ``param``); unknown fields are
ignored, known fields the gateway cannot honour are refused when set to anything but their
neutral value; nothing here does I/O or touches a backend.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from agentroll.types import Message, ToolCall, ToolSpec

_MAX_N = 16
_MAX_STOP = 8


class RequestError(Exception):
    """A request the gateway refuses: answered ``status`` with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> bytes:
        return msgspec.json.encode(
            {
                "error": {
                    "message": self.message,
                    "type": self.kind,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = {}
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDef | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatRequest(msgspec.Struct, kw_only=True):
    """The fields of a Chat Completions body the gateway reads (others are ignored)."""

    messages: list[dict[str, Any]]
    model: str = ""
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(msgspec.Struct, kw_only=True):
    """A (legacy) Completions body: ``prompt`` is text or token ids."""

    # text, token ids, or a batch of one of either (msgspec takes one array type per union:
    # the gateway checks the elements)
    prompt: str | list[str | int | list[int]]
    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False
    logprobs: int | None = None
    echo: bool | None = False


class SessionRequest(msgspec.Struct, kw_only=True):
    """``POST /sessions``: what the session's trajectories are about."""

    task_id: str = ""
    group_id: str = ""
    group_size: int = 0  # 0: released when every session created under the group ended
    seed: int | None = None
    metadata: dict[str, Any] = {}


class RewardRequest(msgspec.Struct, kw_only=True):
    """``POST /sessions/{sid}/reward``: a scalar, or named rewards (summed)."""

    reward: float | None = None
    rewards: dict[str, float] | None = None


def decode(body: bytes, typ: type[Any], what: str) -> Any:
    """``body`` as ``typ``, or ``RequestError(400)`` saying what is malformed."""
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as exc:
        path = str(exc).rpartition("at `")[2].rstrip("`") if "at `" in str(exc) else None
        path = path.removeprefix("$.") if path else None  # as the other params: tools[0].type
        raise RequestError(400, f"invalid {what} body: {exc}", param=path) from None
    except msgspec.DecodeError as exc:
        raise RequestError(400, f"the {what} body is not valid JSON: {exc}") from None


# -- checks ------------------------------------------------------------------------------


class Sampling(msgspec.Struct, kw_only=True, frozen=True):
    """The sampling a call asked for, checked."""

    temperature: float
    top_p: float
    max_tokens: int | None
    stop: tuple[str, ...]
    seed: int | None
    n: int
    logprobs: bool


def _number(value: float | None, name: str, low: float, high: float, default: float) -> float:
    if value is None:
        return default
    if not (low <= value <= high):
        raise RequestError(400, f"{name}={value} is out of range; use {low} to {high}", param=name)
    return float(value)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > _MAX_STOP or any(not s for s in stops):
        raise RequestError(400, f"stop takes up to {_MAX_STOP} non-empty strings", param="stop")
    return stops


def check_sampling(
    *,
    temperature: float | None,
    top_p: float | None,
    max_tokens: int | None,
    stop: str | list[str] | None,
    seed: int | None,
    n: int | None,
    logprobs: bool,
) -> Sampling:
    n = 1 if n is None else n
    if not 1 <= n <= _MAX_N:
        raise RequestError(400, f"n={n} is out of range; use 1 to {_MAX_N}", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(400, f"max_tokens={max_tokens}; use at least 1", param="max_tokens")
    return Sampling(
        temperature=_number(temperature, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(top_p, "top_p", 1e-9, 1.0, 1.0),
        max_tokens=max_tokens,
        stop=_stops(stop),
        seed=seed,
        n=n,
        logprobs=logprobs,
    )


def check_chat(
    req: ChatRequest,
    tools_of: Callable[[list[ToolDef] | None], list[ToolSpec] | None] | None = None,
    memo: MessageMemo | None = None,
) -> tuple[list[Message], list[ToolSpec] | None, Sampling]:
    """The conversation, tools and sampling of a chat call; ``RequestError`` on anything the
    gateway cannot do exactly.  ``tools_of`` checks the tools (default ``check_tools``; a
    gateway passes its cache, so a session's tools stay one object); ``memo``: the session's
    ``MessageMemo``."""
    for name, value in (
        ("frequency_penalty", req.frequency_penalty),
        ("presence_penalty", req.presence_penalty),
    ):
        if value:
            raise RequestError(
                400,
                f"{name} is not supported (the sampled distribution must be the model's "
                "own); leave it out or set it to 0",
                param=name,
            )
    if req.logit_bias:
        raise RequestError(400, "logit_bias is not supported; leave it out", param="logit_bias")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise RequestError(
            400,
            "response_format other than text is not supported (no constrained decoding); "
            "leave it out and parse the text",
            param="response_format",
        )
    if req.top_logprobs:
        raise RequestError(
            400,
            "top_logprobs > 0 is not supported: the backend reports the sampled token's "
            "logprob only; set logprobs=true and top_logprobs=0",
            param="top_logprobs",
        )
    tools = (tools_of or check_tools)(req.tools)
    choice = req.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        raise RequestError(
            400,
            f"tool_choice={json.dumps(choice)} is not supported (no constrained decoding); "
            "use 'auto' or leave it out",
            param="tool_choice",
        )
    messages = check_messages(req.messages, memo)
    sampling = check_sampling(
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        stop=req.stop,
        seed=req.seed,
        n=req.n,
        logprobs=bool(req.logprobs),
    )
    if sampling.n > 1 and tools:
        raise RequestError(
            400, "n > 1 with tools is not supported; make one call per choice", param="n"
        )
    return messages, tools, sampling


def check_tools(tools: list[ToolDef] | None) -> list[ToolSpec] | None:
    if not tools:
        return None
    out = []
    seen = set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if tool.type != "function" or tool.function is None:
            raise RequestError(
                400, f"{param}: only function tools are supported", param=f"{param}.type"
            )
        fn = tool.function
        if not fn.name or fn.name in seen:
            raise RequestError(
                400, f"{param}.function.name must be a unique non-empty string", param=param
            )
        seen.add(fn.name)
        check_schema(fn.parameters, f"{param}.function.parameters")
        out.append(ToolSpec(name=fn.name, description=fn.description, parameters=fn.parameters))
    return out


_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_schema(schema: Any, where: str, depth: int = 0) -> None:
    """A JSON Schema's shape: an object whose ``type`` (if any) is a JSON type name (or a
    list of them) and whose ``properties``/``items`` are schemas; ``RequestError`` naming
    ``where`` otherwise."""
    if depth > 32:
        raise RequestError(400, f"{where} nests deeper than 32 levels", param=where)
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise RequestError(400, f"{where} must be a JSON Schema object", param=where)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if any(not isinstance(k, str) or k not in _SCHEMA_TYPES for k in kinds):
        raise RequestError(
            400,
            f"{where}.type={json.dumps(kind)} is not a JSON Schema type "
            f"(use one of {sorted(_SCHEMA_TYPES)})",
            param=where,
        )
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise RequestError(400, f"{where}.properties must be an object", param=where)
        for key, sub in props.items():
            check_schema(sub, f"{where}.properties.{key}", depth + 1)
    required = schema.get("required")
    if required is not None and (
        not isinstance(required, list) or any(not isinstance(r, str) for r in required)
    ):
        raise RequestError(400, f"{where}.required must be a list of names", param=where)
    items = schema.get("items")
    if items is not None:
        check_schema(items, f"{where}.items", depth + 1)


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    400,
                    f"{where}[{j}] is a {kind!r} part; only text parts are supported "
                    "(no images or audio)",
                    param=where,
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(400, f"{where}[{j}].text must be a string", param=where)
            texts.append(text)
        return "".join(texts)
    raise RequestError(400, f"{where} must be a string or a list of text parts", param=where)


def _tool_calls(value: Any, where: str) -> list[ToolCall]:
    if not value:
        return []
    if not isinstance(value, list):
        raise RequestError(400, f"{where} must be a list", param=where)
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(
                400,
                f"{where}[{j}] must be {{id, type: function, function: {{name, arguments}}}}",
                param=where,
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise RequestError(
                    400, f"{where}[{j}].function.arguments is not valid JSON", param=where
                ) from None
        if not isinstance(args, dict):
            raise RequestError(
                400, f"{where}[{j}].function.arguments must encode a JSON object", param=where
            )
        calls.append(ToolCall(id=str(call.get("id") or ""), name=fn["name"], arguments=args))
    return calls


def check_message(m: dict[str, Any], i: int) -> Message:
    """Message ``i`` of a chat as a ``Message``; ``RequestError`` when it is not valid."""
    where = f"messages[{i}]"
    role = m.get("role")
    if role not in _ROLES:
        raise RequestError(
            400,
            f"{where}.role={json.dumps(role)} is not supported; use one of {sorted(_ROLES)}",
            param=f"{where}.role",
        )
    if role == "developer":  # the newer name of the system role
        role = "system"
    name = m.get("name")
    tool_call_id = m.get("tool_call_id")
    if role == "tool" and not isinstance(tool_call_id, str):
        raise RequestError(400, f"{where} (role tool) needs a string tool_call_id", param=where)
    content = _content(m.get("content"), f"{where}.content")
    calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else []
    return Message(
        role=role,
        content=content,
        tool_calls=calls,
        tool_call_id=tool_call_id if role == "tool" else None,
        name=name if isinstance(name, str) and role == "tool" else None,
    )


class MessageMemo:
    """A session's last call's messages, checked: an agent loop resends its whole history
    every call, and the messages it resent unchanged (equal as decoded JSON) are not checked
    again, so a call costs its new messages, not its history."""

    __slots__ = ("_checked", "_raw")

    def __init__(self) -> None:
        self._raw: list[dict[str, Any]] = []
        self._checked: list[Message] = []

    def check(self, raw: list[dict[str, Any]]) -> list[Message]:
        old, n = self._raw, 0
        limit = min(len(raw), len(old))
        while n < limit and raw[n] == old[n]:
            n += 1
        out = self._checked[:n] + [check_message(raw[i], i) for i in range(n, len(raw))]
        # a copy: an in-process caller appends to the list it passes (its dicts it must not
        # change in place after a call)
        self._raw, self._checked = list(raw), out
        return out


def check_messages(raw: list[dict[str, Any]], memo: MessageMemo | None = None) -> list[Message]:
    """The chat as ``Message``s (through ``memo`` when given); ``RequestError`` when it is
    not a valid chat."""
    if not raw:
        raise RequestError(400, "messages is empty; send at least one message", param="messages")
    out = (memo or MessageMemo()).check(raw)
    if all(m.role == "system" for m in out):
        raise RequestError(
            400, "messages holds only system messages; add a user message", param="messages"
        )
    return out


# -- replies -----------------------------------------------------------------------------

FinishName = Literal["stop", "length", "tool_calls"]


def openai_tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]


def completion_id() -> str:
    return f"chatcmpl-{time.time_ns():x}"


def chat_reply(
    *,
    cid: str,
    model: str,
    choices: list[dict[str, Any]],
    prompt_ids: list[int],
    usage: dict[str, int],
    session: str,
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "prompt_token_ids": prompt_ids,
        "session_id": session,
    }


def sse(event: dict[str, Any] | str) -> bytes:
    """One server-sent event (``[DONE]`` as a string)."""
    data = event if isinstance(event, str) else msgspec.json.encode(event).decode()
    return f"data: {data}\n\n".encode()


__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "MessageMemo",
    "RequestError",
    "RewardRequest",
    "Sampling",
    "SessionRequest",
    "chat_reply",
    "check_chat",
    "check_message",
    "check_messages",
    "check_sampling",
    "check_schema",
    "check_tools",
    "completion_id",
    "decode",
    "openai_tool_calls",
    "sse",
]
