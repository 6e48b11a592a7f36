"""Checks that turn a decoded name and arguments into a ``ToolCall``, or say what is wrong.

Invariants: a call's arguments are a JSON object (a JSON text of one is decoded), nested at
most ``MAX_DEPTH`` deep, and hold no lone surrogate, so every accepted call can be encoded
into a trajectory and re-encoded as JSON from any stack depth.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from agentroll.types import ToolCall

#: deepest nesting accepted in a call's arguments (the arguments object is level 1)
MAX_DEPTH = 256


def check_call(
    name: Any, args: Any, call_id: str, *, hint: str = ""
) -> tuple[ToolCall | None, str]:
    """``(call, "")`` for a well-formed call, else ``(None, error)``; ``hint`` (what the
    model should write) is appended to the error.  ``args`` may be a JSON text of an object
    (some models double-encode them) or ``None`` (no arguments)."""
    if not isinstance(name, str) or not name:
        return None, "tool call has no string 'name'" + hint
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None, f"arguments of tool call {name!r} are not a JSON object" + hint
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, f"arguments of tool call {name!r} must be a JSON object" + hint
    if not _nested_at_most(args, MAX_DEPTH):
        return None, f"arguments of tool call {name!r} nest deeper than {MAX_DEPTH} levels"
    try:  # a "\ud800" escape decodes to a lone surrogate: no trajectory could hold it
        msgspec.json.encode([name, args])
    except UnicodeEncodeError:
        return None, f"tool call {name!r} holds a lone surrogate escape (not valid Unicode)"
    return ToolCall(id=call_id, name=name, arguments=args), ""


def loads_object(text: str) -> tuple[Any, str]:
    """``(value, "")`` for valid JSON text, else ``(None, why)``."""
    try:
        return json.loads(text), ""
    except (ValueError, RecursionError) as exc:
        return None, str(exc)


def _nested_at_most(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return True
