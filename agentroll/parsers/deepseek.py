"""DeepSeek V3 / R1 / V3.1 tool calls inside a ``<|tool_calls_begin|>`` block.

A call is ``<|tool_call_begin|>function<|tool_sep|>NAME\\n```json\\nARGS\\n```<|tool_call_end|>``
(V3, R1) or ``<|tool_call_begin|>NAME<|tool_sep|>ARGS<|tool_call_end|>`` (V3.1), the bars
being U+FF5C and the underscores U+2581.  Invariants: text outside the block is content;
inside it only whitespace stands between calls (anything else is one error per stretch); a
call that meets another marker before its end is unclosed; a block the turn ends in
without its end marker keeps its closed calls.
"""

from __future__ import annotations

import re
from typing import Any

from agentroll.parsers.base import ParsedOutput, StreamingParser
from agentroll.parsers.calls import check_call, loads_object
from agentroll.parsers.scan import BufferedStream, Markers


def _marker(words: str) -> str:
    # DeepSeek's markers use the fullwidth bar U+FF5C and U+2581 for spaces
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


CALLS_BEGIN = _marker("tool calls begin")
CALLS_END = _marker("tool calls end")
CALL_BEGIN = _marker("tool call begin")
CALL_END = _marker("tool call end")
SEP = _marker("tool sep")
_ALL = Markers([CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP])
_CALL_STOPS = Markers([CALL_END, CALL_BEGIN, CALLS_BEGIN, CALLS_END])
# V3: the type, then after the separator the name on its line and the arguments in a fence
_V3 = re.compile(r"([^\n]*)\n\s*```(?:json)?[ \t]*\n(.*?)\s*```\s*", re.DOTALL)
_V3_NAME = re.compile(r"([^\n{]*)\n")
_PROBE_MAX = 512
HINT = f"; write {CALLS_BEGIN}{CALL_BEGIN}NAME{SEP}{{JSON arguments}}{CALL_END}{CALLS_END}"
_UNCLOSED = f"a tool call is not closed with {CALL_END}" + HINT


class DeepSeekV3ToolParser:
    """DeepSeek V3 and V3.1 tool calls (both forms in one parser)."""

    def parse(self, text: str, *, call_id_prefix: str = "call") -> ParsedOutput:
        stream = self.stream(call_id_prefix=call_id_prefix)
        stream.feed(text)
        return stream.finish()[1]

    def stream(self, *, call_id_prefix: str = "call") -> StreamingParser:
        return _DeepSeekStream(call_id_prefix=call_id_prefix)


def _split_call(body: str) -> tuple[str, str] | str:
    """The name and the arguments text of a call's body, or what is wrong with it."""
    head, sep, tail = body.partition(SEP)
    if not sep:
        return f"a tool call has no {SEP} between its name and its arguments" + HINT
    m = _V3.fullmatch(tail) if head.strip() == "function" else None
    name, raw = (m.group(1).strip(), m.group(2)) if m else (head.strip(), tail)
    if not name:
        return "a tool call has no name before its arguments" + HINT
    return name, raw.strip()


def _name_so_far(body: str) -> str:
    """The name of an open call's body, once it can be read ("" before)."""
    head, sep, tail = body.partition(SEP)
    if not sep:
        return ""
    if head.strip() != "function":
        return head.strip()
    if m := _V3_NAME.match(tail):
        return m.group(1).strip()
    return "function" if tail.lstrip().startswith("{") else ""


class _DeepSeekStream(BufferedStream):
    def __init__(self, *, call_id_prefix: str = "call") -> None:
        super().__init__(call_id_prefix=call_id_prefix)
        self._state = "out"  # out | block | call
        self._call_in_block = False
        self._scanned = 0  # call body length searched for its end
        self._junk = False  # the stretch of the block since the last call has non-space

    def _step(self) -> bool:
        if self._state == "call":
            return self._call_step()
        buf, pos = self._buf, self._pos
        at, marker = _ALL.split(buf, pos, self._final)
        self._pos = at if marker is None else at + len(marker)
        if self._state == "out":
            self._emit(buf[pos:at])
            if marker == CALLS_BEGIN:
                self._state, self._junk = "block", False
            elif marker == CALL_BEGIN:
                self._open_call(in_block=False)
            elif marker is not None:
                self._reject(f"{marker} appears outside a tool-call block" + HINT)
            return marker is not None
        junk = buf[pos:at].strip() or marker in (CALLS_BEGIN, CALL_END, SEP)
        if junk and not self._junk:
            self._junk = True
            self._reject(f"text between the calls of a {CALLS_BEGIN} block" + HINT)
        if marker == CALL_BEGIN:
            self._open_call(in_block=True)
        elif marker == CALLS_END:
            self._state = "out"
        return marker is not None

    def _open_call(self, *, in_block: bool) -> None:
        self._state, self._call_in_block, self._scanned = "call", in_block, 0

    def _call_step(self) -> bool:
        buf, pos = self._buf, self._pos
        m = _CALL_STOPS.pattern.search(buf, pos + self._scanned)
        if m is None:
            if self._final:
                self._reject(_UNCLOSED)
                self._pos, self._state = len(buf), "out"
                return False
            if len(buf) - pos <= _PROBE_MAX:
                self._announce(_name_so_far(buf[pos:]))
            self._scanned = max(0, len(buf) - pos - _CALL_STOPS.maxlen + 1)
            return False
        self._state, self._junk = ("block" if self._call_in_block else "out"), False
        if m.group() != CALL_END:  # the marker is read again in the state returned to
            self._reject(_UNCLOSED)
            self._pos = m.start()
            return True
        self._pos = m.end()
        self._close_call(buf[pos : m.start()])
        return True

    def _close_call(self, body: str) -> None:
        split = _split_call(body)
        if isinstance(split, str):
            self._reject(split)
            return
        name, raw = split
        args: Any
        args, why = loads_object(raw)
        if why:
            self._reject(f"arguments of tool call {name!r} are not valid JSON ({why})" + HINT)
            return
        call, err = check_call(name, args, self._call_id(), hint=HINT)
        self._settle(call, err)
