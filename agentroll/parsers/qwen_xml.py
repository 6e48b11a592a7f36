"""Qwen3-Coder / Qwen3.5 XML tool calls:
``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``.

Invariants: a value loses one leading and one trailing newline, nothing else; it becomes a
JSON value by the tool's schema when the parser has it (a value the type does not fit stays
a string, for the tool's own validation to report), else only when it is valid JSON other
than a string; the content is the text with closed blocks removed, cut at an unclosed one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agentroll.parsers.base import ParsedOutput, StreamingParser
from agentroll.parsers.calls import check_call
from agentroll.parsers.scan import BufferedStream, Markers
from agentroll.types import ToolSpec

START = "<tool_call>"
END = "</tool_call>"
_MARKERS = Markers([START, END])
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_PARAM, _PARAM_END, _FUNCTION_END = "<parameter=", "</parameter>", "</function>"
_SPACE = re.compile(r"\s*")
_PROBE_MAX = 512
HINT = (
    "; write <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n"
    "</function>\\n</tool_call>"
)


class QwenXMLToolParser:
    """Qwen3-Coder XML calls; ``tools`` (or ``with_tools``) gives the schemas by which
    parameter values are typed."""

    def __init__(self, tools: Sequence[ToolSpec] = ()) -> None:
        self._properties: dict[str, Mapping[str, Any]] = {}
        for spec in tools:
            props = spec.parameters.get("properties")
            self._properties[spec.name] = props if isinstance(props, Mapping) else {}

    def with_tools(self, tools: Sequence[ToolSpec]) -> QwenXMLToolParser:
        """A parser that types parameter values by the schemas of ``tools``."""
        return QwenXMLToolParser(tools)

    def parse(self, text: str, *, call_id_prefix: str = "call") -> ParsedOutput:
        stream = self.stream(call_id_prefix=call_id_prefix)
        stream.feed(text)
        return stream.finish()[1]

    def stream(self, *, call_id_prefix: str = "call") -> StreamingParser:
        return _QwenXMLStream(self, call_id_prefix=call_id_prefix)

    def parse_body(self, body: str) -> tuple[str, dict[str, Any]] | str:
        """The name and arguments of one block's body, or what is wrong with it."""
        m = _FUNCTION.match(body)
        if m is None:
            return "a <tool_call> block must start with <function=NAME>" + HINT
        name = m.group(1).strip()
        if not name:
            return "tool call has no name in <function=NAME>" + HINT
        props = self._properties.get(name, {})
        args: dict[str, Any] = {}
        pos = m.end()
        while True:
            pos = _SPACE.match(body, pos).end()  # type: ignore[union-attr]
            if body.startswith(_PARAM, pos):
                close = body.find(">", pos)
                param = body[pos + len(_PARAM) : close].strip() if close >= 0 else ""
                if not param or "\n" in param:
                    return f"tool call {name!r} has a malformed <parameter=NAME> tag" + HINT
                end = body.find(_PARAM_END, close + 1)
                if end < 0:
                    return f"parameter {param!r} of {name!r} is not closed with </parameter>"
                if param in args:
                    return f"parameter {param!r} of {name!r} is given twice"
                value = body[close + 1 : end].removeprefix("\n").removesuffix("\n")
                schema = props.get(param)
                args[param] = _typed(value, schema if isinstance(schema, Mapping) else None)
                pos = end + len(_PARAM_END)
            elif body.startswith(_FUNCTION_END, pos):
                if body[pos + len(_FUNCTION_END) :].strip():
                    return f"tool call {name!r} has text after </function>" + HINT
                return name, args
            elif pos >= len(body):
                return f"tool call {name!r} is not closed with </function>" + HINT
            else:
                return (
                    f"tool call {name!r} has text outside <parameter=...> tags; write "
                    "<parameter=ARG>\\nVALUE\\n</parameter> or </function>"
                )


def _typed(value: str, schema: Mapping[str, Any] | None) -> Any:
    """``value`` as the JSON value ``schema`` asks for (see the module docstring)."""
    types = _types(schema) if schema is not None else []
    if not types:
        decoded, ok = _strict_json(value)
        return decoded if ok and not isinstance(decoded, str) else value
    text = value.strip()
    for kind in types:
        if kind == "null" and text == "null":
            return None
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("integer", "number", "object", "array"):
            decoded, ok = _strict_json(text)
            if not ok or isinstance(decoded, bool):
                continue
            if kind == "integer" and isinstance(decoded, float) and decoded.is_integer():
                return int(decoded)
            wanted = {"integer": int, "number": int | float, "object": dict, "array": list}
            if isinstance(decoded, wanted[kind]):
                return decoded
    return value  # a string, or a value no type fits (the tool's validation says so)


def _types(schema: Mapping[str, Any]) -> list[str]:
    """The JSON types a schema allows (``type``, a list of them, or ``anyOf``/``oneOf``)."""
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            if isinstance(sub, Mapping):
                kinds.extend(_types(sub))
    return [k for k in kinds if isinstance(k, str) and k != "string"] + (
        ["string"] if "string" in kinds else []
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: no JSON number, and no trajectory could hold it
        raise ValueError(f"{text} is out of range")
    return value


def _strict_json(text: str) -> tuple[Any, bool]:
    """``(value, True)`` when ``text`` is JSON in the strict sense (no NaN or infinity)."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite), True
    except (ValueError, RecursionError):
        return None, False


class _QwenXMLStream(BufferedStream):
    def __init__(self, parser: QwenXMLToolParser, *, call_id_prefix: str = "call") -> None:
        super().__init__(call_id_prefix=call_id_prefix)
        self._parser = parser
        self._open = False  # inside a block; its body starts at self._pos
        self._scanned = 0

    def _step(self) -> bool:
        buf, pos = self._buf, self._pos
        if not self._open:
            at, marker = _MARKERS.split(buf, pos, self._final)
            self._emit(buf[pos:at])
            self._pos = at if marker is None else at + len(marker)
            if marker == END:
                self._reject("a </tool_call> appears without its opening <tool_call>" + HINT)
            elif marker == START:
                self._open, self._scanned = True, 0
            return marker is not None
        end = buf.find(END, pos + self._scanned)
        if end < 0:
            if self._final:
                self._reject("a <tool_call> block is not closed with </tool_call>" + HINT)
                self._pos, self._open = len(buf), False
                return False
            if len(buf) - pos <= _PROBE_MAX and (m := _FUNCTION.match(buf, pos)):
                self._announce(m.group(1).strip())
            self._scanned = max(0, len(buf) - pos - len(END) + 1)
            return False
        parsed = self._parser.parse_body(buf[pos:end])
        call_id = self._call_id()
        if isinstance(parsed, str):
            self._reject(parsed)
        else:
            call, err = check_call(parsed[0], parsed[1], call_id, hint=HINT)
            self._settle(call, err)
        self._pos, self._open = end + len(END), False
        return True
