"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}`` objects
(``"arguments"`` accepted), optionally after ``<|python_tag|>``, several separated by ``;``.

Invariants: an object is a call when it has a name and parameters; one that starts like a
call (its first key is name, parameters, arguments or type) and is unclosed, not valid JSON
or has parameters but no name is an error; any other ``{`` is content, released as soon as
its first key rules a call out; after ``<|python_tag|>`` the next object must be a call.
"""

from __future__ import annotations

import re
from typing import Any

from agentroll.parsers.base import ParsedOutput, StreamingParser
from agentroll.parsers.calls import check_call, loads_object
from agentroll.parsers.scan import BufferedStream, JsonScanner, Markers

PYTHON_TAG = "<|python_tag|>"
_OPENING = Markers([PYTHON_TAG, "{"])
_KEYS = ('"name"', '"parameters"', '"arguments"', '"type"')
_WINDOW = 64  # characters after "{" within which the first key must show
_SPACE = re.compile(r"\s*")
_NAME = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:'
)
_PROBE_MAX = 512
HINT = '; write {"name": "TOOL", "parameters": {...}} (several separated by ";")'


class Llama3JSONToolParser:
    """Llama 3.x JSON tool calls, mixed with content."""

    def parse(self, text: str, *, call_id_prefix: str = "call") -> ParsedOutput:
        stream = self.stream(call_id_prefix=call_id_prefix)
        stream.feed(text)
        return stream.finish()[1]

    def stream(self, *, call_id_prefix: str = "call") -> StreamingParser:
        return _LlamaStream(call_id_prefix=call_id_prefix)


def _intent(window: str, complete: bool) -> bool | None:
    """Whether an object starting ``window`` (its ``{`` first) is meant as a call; ``None``
    while more text could change the answer."""
    undecided = None if not complete else False
    rest = window[1:].lstrip()
    if not rest:
        return undecided
    for key in _KEYS:
        if rest.startswith(key):
            after = rest[len(key) :].lstrip()
            return after[0] == ":" if after else undecided
        if key.startswith(rest):
            return undecided
    return False


class _LlamaStream(BufferedStream):
    """States: ``out``, ``tag`` (after ``<|python_tag|>``), ``object`` (a ``{`` at
    ``self._pos``: first its intent is decided, then its end is found) and ``after`` (a
    call just closed: whitespace and one ``;`` belong to it)."""

    def __init__(self, *, call_id_prefix: str = "call") -> None:
        super().__init__(call_id_prefix=call_id_prefix)
        self._state = "out"
        self._forced = False  # the object follows <|python_tag|>
        self._intent: bool | None = None
        self._json = JsonScanner()

    def _step(self) -> bool:
        buf, pos = self._buf, self._pos
        if self._state == "out":
            at, marker = _OPENING.split(buf, pos, self._final)
            self._emit(buf[pos:at])
            if marker is None:
                self._pos = at
                return False
            if marker == PYTHON_TAG:
                self._pos, self._state = at + len(marker), "tag"
            else:
                self._open(at, forced=False)
            return True
        if self._state in ("tag", "after"):
            cur = _SPACE.match(buf, pos).end()  # type: ignore[union-attr]
            if cur == len(buf) and not self._final:
                if self._state == "tag":
                    self._pos = cur  # spaces after the tag are no content
                return False
            if self._state == "after":
                self._pos = cur + 1 if buf.startswith(";", cur) else pos
                self._state = "out"
            elif buf.startswith("{", cur):
                self._open(cur, forced=True)
            else:
                self._reject(f"{PYTHON_TAG} is not followed by a JSON call" + HINT)
                self._pos, self._state = cur, "out"
            return True
        return self._object_step()

    def _open(self, at: int, *, forced: bool) -> None:
        self._pos, self._state, self._forced = at, "object", forced
        self._intent = True if forced else None
        self._json = JsonScanner()

    def _object_step(self) -> bool:
        buf, base = self._buf, self._pos
        if self._intent is None:
            window = buf[base : base + _WINDOW + 1]
            self._intent = _intent(window, self._final or len(window) > _WINDOW)
            if self._intent is None:
                return False
            if not self._intent:  # plain content: the "{" goes out, the rest is read again
                self._emit("{")
                self._pos, self._state = base + 1, "out"
                return True
        while (found := self._json.next_bracket(buf, base)) is not None:
            if self._json.depth == 0:
                end = base + found[0] + 1
                self._pos = end
                self._close(buf[base:end])
                return True
        if self._final:
            self._reject("a tool call's JSON object is not closed" + HINT)
            self._pos, self._state = len(buf), "out"
        elif len(buf) - base <= _PROBE_MAX and (m := _NAME.match(buf, base)):
            self._announce_literal(m.group(1))
        return False

    def _close(self, text: str) -> None:
        self._state = "after"
        value: Any
        value, why = loads_object(text)
        if why:
            self._reject(f"tool call is not valid JSON ({why})" + HINT)
            return
        has_args = isinstance(value, dict) and ("parameters" in value or "arguments" in value)
        if has_args and "name" in value:
            args = value["parameters"] if "parameters" in value else value["arguments"]
            call, err = check_call(value["name"], args, self._call_id(), hint=HINT)
            self._settle(call, err)
        elif has_args:
            self._reject("tool call has no string 'name'" + HINT)
        elif self._forced:
            self._reject(f"the object after {PYTHON_TAG} is not a tool call" + HINT)
        else:  # a JSON object that is no call: content
            self._emit(text)
            self._state = "out"
