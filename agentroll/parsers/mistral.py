"""Mistral tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizers
before v11) and ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`` (v11+, ``[CALL_ID]`` optional,
repeated per call; ``[ARGS]`` may be missing where special tokens were not decoded).

Invariants: text outside calls is content; each object of a list is a call of its own,
settled when it closes; a v11 call keeps the id it carries (unless empty or already used in
the turn), every other call is numbered ``{prefix}_{k}``; a list or an arguments object
that the turn ends inside is an unclosed call.
"""

from __future__ import annotations

import re

from agentroll.parsers.base import ParsedOutput, StreamingParser
from agentroll.parsers.calls import check_call, loads_object
from agentroll.parsers.scan import BufferedStream, JsonScanner, Markers

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_OPENING = Markers([TOOL_CALLS])
_HEAD = Markers([TOOL_CALLS, ARGS, CALL_ID])
_WORD = re.compile(r"[^\s\[\]{}]{1,256}")
_SPACE = re.compile(r"\s*")
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*[,}]')
_PROBE_MAX = 512
HINT = f'; write {TOOL_CALLS}NAME{ARGS}{{"arg": ...}} or {TOOL_CALLS}[{{"name": ..., "arguments": {{...}}}}]'


class MistralToolParser:
    """Mistral's ``[TOOL_CALLS]`` calls, both the JSON-list and the v11+ form."""

    def parse(self, text: str, *, call_id_prefix: str = "call") -> ParsedOutput:
        stream = self.stream(call_id_prefix=call_id_prefix)
        stream.feed(text)
        return stream.finish()[1]

    def stream(self, *, call_id_prefix: str = "call") -> StreamingParser:
        return _MistralStream(call_id_prefix=call_id_prefix)


class _MistralStream(BufferedStream):
    """States: ``out`` (content), ``head`` (after ``[TOOL_CALLS]``: name, id, ``[ARGS]``),
    ``args`` (the v11 arguments object) and ``list`` (the JSON list); ``self._pos`` is the
    start of the head, the object or the list while it is open."""

    def __init__(self, *, call_id_prefix: str = "call") -> None:
        super().__init__(call_id_prefix=call_id_prefix)
        self._state = "out"
        self._cur = 0  # head: how far it is read, relative to self._pos
        self._name = ""
        self._id = ""
        self._stage = "name"  # head: name | call_id | id | args_marker | brace
        self._json = JsonScanner()
        self._element = -1  # list: where the open element starts (-1: none)
        self._junk = False  # list: holds something other than objects
        self._gap = 0  # list: where the text since the last element starts
        self._ids: set[str] = set()

    def _step(self) -> bool:
        if self._state == "out":
            buf, pos = self._buf, self._pos
            at, marker = _OPENING.split(buf, pos, self._final)
            self._emit(buf[pos:at])
            if marker is None:
                self._pos = at
                return False
            self._pos, self._state, self._cur = at + len(marker), "head", 0
            self._name, self._id, self._stage = "", "", "name"
            return True
        if self._state == "head":
            return self._head_step()
        if self._state == "args":
            return self._args_step()
        return self._list_step()

    def _head_step(self) -> bool:
        buf, base = self._buf, self._pos
        cur = _SPACE.match(buf, base + self._cur).end()  # type: ignore[union-attr]
        self._cur = cur - base
        if cur == len(buf) and not self._final:
            return False
        marker = _HEAD.starting(buf, cur)
        if marker is None and not self._final and _HEAD.could_start(buf[cur : cur + 16]):
            return False  # "[AR" may still become [ARGS]
        if self._stage == "name" and buf.startswith("[", cur) and marker is None:
            self._state, self._pos, self._json = "list", cur, JsonScanner()
            self._element, self._junk, self._gap = -1, False, 0
            return True
        if self._stage in ("name", "id") and marker is None and cur < len(buf):
            word = _WORD.match(buf, cur)
            if word is not None:
                if word.end() == len(buf) and not self._final and len(word.group()) < 256:
                    return False  # the word may go on
                if self._stage == "name":
                    self._name, self._stage = word.group(), "call_id"
                else:
                    self._id, self._stage = word.group(), "args_marker"
                self._cur = word.end() - base
                return True
        if marker == CALL_ID and self._stage in ("name", "call_id"):
            self._stage, self._cur = "id", cur + len(CALL_ID) - base
            return True
        if marker == ARGS and self._stage != "brace":
            self._stage, self._cur = "brace", cur + len(ARGS) - base
            return True
        if buf.startswith("{", cur) and self._stage != "id":
            self._state, self._pos, self._json = "args", cur, JsonScanner()
            self._announce(self._name, self._carried_id())
            return True
        # anything else: no call after all; the text after the marker is read as content
        what = f"call {self._name!r}" if self._name else TOOL_CALLS
        self._reject(f"{what} is not followed by its arguments object" + HINT)
        self._state = "out"
        return True

    def _carried_id(self) -> str:
        return self._id if self._id and self._id not in self._ids else self._call_id()

    def _args_step(self) -> bool:
        buf, base = self._buf, self._pos
        while (found := self._json.next_bracket(buf, base)) is not None:
            if self._json.depth == 0:
                end = base + found[0] + 1
                self._state, self._pos = "out", end
                self._settle_text(self._name, buf[base:end], self._carried_id())
                return True
        if self._final:
            self._reject(f"the arguments of call {self._name!r} are not closed" + HINT)
            self._state, self._pos = "out", len(buf)
        return False

    def _list_step(self) -> bool:
        buf, base = self._buf, self._pos
        scan = self._json
        while (found := scan.next_bracket(buf, base)) is not None:
            at, char = found
            if scan.depth == 2 and char in "{[" and self._element < 0:
                self._between(buf, base, at)
                if char == "{":
                    self._element = at
                else:
                    self._mark_junk()
            elif scan.depth == 1 and char in "}]":
                if self._element >= 0:
                    element = buf[base + self._element : base + at + 1]
                    self._element = -1
                    self._settle_text(None, element, self._call_id())
                self._gap = at + 1
            elif scan.depth == 0:
                self._between(buf, base, at)
                self._state, self._pos = "out", base + at + 1
                return True
            elif scan.depth == 1 and char == "[":
                self._gap = at + 1  # the list's own opening bracket
        start = self._element
        probe = start >= 0 and len(buf) - base - start <= _PROBE_MAX
        if probe and (m := _NAME.match(buf, base + start)):
            self._announce_literal(m.group(1))
        if self._final:
            self._reject(f"the {TOOL_CALLS} list is not closed with ]" + HINT)
            self._state, self._pos = "out", len(buf)
        return False

    def _between(self, buf: str, base: int, at: int) -> None:
        if buf[base + self._gap : base + at].strip(" \t\r\n,"):
            self._mark_junk()

    def _mark_junk(self) -> None:
        if not self._junk:
            self._junk = True
            self._reject(f"the {TOOL_CALLS} list holds something other than call objects" + HINT)

    def _settle_text(self, name: str | None, text: str, call_id: str) -> None:
        """Check one call: ``text`` is its arguments (``name`` given) or its whole object."""
        value, why = loads_object(text)
        if why:
            self._reject(f"tool call is not valid JSON ({why})" + HINT)
            return
        if name is None:
            if not isinstance(value, dict):
                self._reject("tool call must be a JSON object with keys name and arguments")
                return
            name, value = value.get("name"), value.get("arguments", value.get("parameters"))
        call, err = check_call(name, value, call_id, hint=HINT)
        if call is None:
            self._reject(err)
            return
        self._ids.add(call.id)
        self._complete(call)
