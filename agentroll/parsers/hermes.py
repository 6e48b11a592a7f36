"""Hermes / Qwen2.5 / Qwen3 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Invariants: the content is the text with every closed block removed, cut at the first
``<tool_call>`` left over (an unclosed block) and without stray ``</tool_call>``; calls and
block errors are numbered in order; the stream reproduces ``parse`` exactly, also where a
removed block splices a marker out of the text around it.
"""

from __future__ import annotations

import json
import re

from agentroll.parsers.base import ParsedOutput, StreamingParser
from agentroll.parsers.calls import check_call
from agentroll.parsers.scan import BufferedStream, Markers
from agentroll.types import ToolCall

START = "<tool_call>"
END = "</tool_call>"
# the name when it is the body's first key, announced before the block closes
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*[,}]')
_PROBE_MAX = 512  # body length up to which the name is looked for before the block closes


class HermesToolParser:
    """Hermes/Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    start = START
    end = END
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, *, call_id_prefix: str = "call") -> ParsedOutput:
        if self.start not in text and self.end not in text:
            return ParsedOutput(content=text.strip(), tool_calls=[], errors=[])
        calls: list[ToolCall] = []
        errors: list[str] = []
        for body in self._block.findall(text):
            call, err = self._parse_one(body, f"{call_id_prefix}_{len(calls) + len(errors)}")
            if call is not None:
                calls.append(call)
            else:
                errors.append(err)
        rest = self._block.sub("", text)
        if self.start in rest:
            errors.append(_UNCLOSED)
            rest = rest[: rest.index(self.start)]
        if self.end in rest:
            errors.append(_STRAY)
            rest = rest.replace(self.end, "")
        return ParsedOutput(content=rest.strip(), tool_calls=calls, errors=errors)

    def stream(self, *, call_id_prefix: str = "call") -> StreamingParser:
        """A stream whose ``finish`` equals ``parse`` of the text fed."""
        return _HermesStream(call_id_prefix=call_id_prefix)

    @staticmethod
    def _parse_one(body: str, call_id: str) -> tuple[ToolCall | None, str]:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as exc:
            return (
                None,
                f'tool call is not valid JSON ({exc}); write {{"name": ..., "arguments": {{...}}}}',
            )
        if not isinstance(obj, dict):
            return None, "tool call must be a JSON object with keys name and arguments"
        return check_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})), call_id)


_UNCLOSED = "a <tool_call> block is not closed with </tool_call>"
_STRAY = "a </tool_call> appears without its opening <tool_call>"
_OPENING = Markers([START])
_EITHER = Markers([START, END])


class _HermesStream(BufferedStream):
    """Two scans, as ``parse`` does them: blocks are cut out of the text (``<tool_call>`` to
    the first ``</tool_call>``), and what remains is scanned again for a leftover
    ``<tool_call>`` (the content ends there) and stray ``</tool_call>`` (dropped)."""

    def __init__(self, *, call_id_prefix: str = "call") -> None:
        super().__init__(call_id_prefix=call_id_prefix)
        self._open = False  # inside a block; its body starts at self._pos
        self._scanned = 0  # body length already searched for END
        self._rest = ""  # text outside blocks not yet settled
        self._cut = False  # the content ended at a leftover <tool_call>
        self._stray = False

    def _step(self) -> bool:
        buf, pos = self._buf, self._pos
        if not self._open:
            at, marker = _OPENING.split(buf, pos, self._final)
            self._outside(buf[pos:at])
            if marker is None:
                self._pos = at
                return False
            self._pos, self._open, self._scanned = at + len(START), True, 0
            return True
        end = buf.find(END, pos + self._scanned)
        if end < 0:
            if self._final:  # an unclosed block stays in the rest, as in parse()
                self._outside(START + buf[pos:])
                self._pos, self._open = len(buf), False
                return False
            if len(buf) - pos <= _PROBE_MAX and (m := _NAME.match(buf, pos)):
                self._announce_literal(m.group(1))
            self._scanned = max(0, len(buf) - pos - len(END) + 1)
            return False
        call, err = HermesToolParser._parse_one(buf[pos:end], self._call_id())
        self._settle(call, err)
        self._pos, self._open = end + len(END), False
        return True

    def _outside(self, text: str) -> None:
        """Scan the text outside blocks (the rest of ``parse``), as it is settled."""
        if self._cut or not text:
            return
        rest = self._rest + text
        pos = 0
        while True:
            at, marker = _EITHER.split(rest, pos, False)
            self._emit(rest[pos:at])
            if marker is None:
                self._rest = rest[at:]
                return
            if marker == START:
                self._cut, self._rest = True, ""
                return
            self._stray = True
            pos = at + len(END)

    def _end(self) -> None:
        self._emit(self._rest)  # a marker's beginning that the text ended in: plain text
        self._rest = ""
        if self._cut:
            self._errors.append(_UNCLOSED)
        if self._stray:
            self._errors.append(_STRAY)
