"""Streamed choices: sampled ids to text deltas to OpenAI ``delta`` objects with tool calls.

Invariants: text is emitted as soon as it decodes to whole characters (a token that ends
inside a UTF-8 sequence waits for the next); the end-of-turn token is never text; the reply
recorded for the session is exactly what the deltas carried (content and tool calls), so
the client's next call matches it.
"""

from __future__ import annotations

import json
from typing import Any

from agentroll.chat import ChatTokenizer
from agentroll.parsers import StreamingToolParser, ToolParser
from agentroll.types import Message, ToolCall


class TextStream:
    """Incremental detokenisation: feed ids, get the new text."""

    __slots__ = ("_ids", "_prefix", "_read", "_tok")

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # a few tokens before the unread ones: decoders need the context
        self._read = 0

    def feed(self, ids: list[int]) -> str:
        eot = self._tok.eot_id
        self._ids.extend(i for i in ids if i != eot)
        if len(self._ids) == self._read:
            return ""
        decode = self._tok.decode
        before = decode(self._ids[self._prefix : self._read]) if self._read > self._prefix else ""
        text = decode(self._ids[self._prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""  # mid-character: wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]

    def flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        decode = self._tok.decode
        before = decode(self._ids[self._prefix : self._read]) if self._read > self._prefix else ""
        text = decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(before) :]


def _openai_delta(content: str, calls: list[Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        out = []
        for d in calls:
            entry: dict[str, Any] = {"index": d.index}
            fn: dict[str, Any] = {"arguments": d.arguments}
            if d.id is not None:
                entry["id"], entry["type"] = d.id, "function"
            if d.name is not None:
                fn["name"] = d.name
            entry["function"] = fn
            out.append(entry)
        delta["tool_calls"] = out
    return delta


class ChoiceStream:
    """One streamed choice: ids in, OpenAI deltas out; ``finish`` gives the reply."""

    def __init__(self, tokenizer: ChatTokenizer, parser: ToolParser, *, call_prefix: str) -> None:
        self._text = TextStream(tokenizer)
        self._parser = parser
        self._prefix = call_prefix
        # a plugin parser without a streaming side: text is held and parsed at the end
        self._inc = (
            parser.stream(call_id_prefix=call_prefix)
            if isinstance(parser, StreamingToolParser)
            else None
        )
        self._held: list[str] = []
        self._content: list[str] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments...]

    def _note(self, content: str, calls: list[Any]) -> dict[str, Any]:
        if content:
            self._content.append(content)
        for d in calls:
            entry = self._calls.setdefault(d.index, [d.id or "", d.name or ""])
            if d.id and not entry[0]:
                entry[0] = d.id
            if d.name and not entry[1]:
                entry[1] = d.name
            entry.append(d.arguments)
        return _openai_delta(content, calls)

    def feed(self, ids: list[int]) -> dict[str, Any]:
        """The delta for newly sampled ``ids`` (empty when nothing can be shown yet)."""
        text = self._text.feed(ids)
        if not text:
            return {}
        if self._inc is None:
            self._held.append(text)
            return {}
        d = self._inc.feed(text)
        return self._note(d.content, d.tool_calls)

    def finish(self) -> tuple[dict[str, Any], Message, list[str]]:
        """The last delta, the reply as the client received it, and the parse errors."""
        rest = self._text.flush()
        if self._inc is None:
            parsed = self._parser.parse("".join([*self._held, rest]), call_id_prefix=self._prefix)
            deltas = [
                _Delta(i, c.id, c.name, _json(c.arguments)) for i, c in enumerate(parsed.tool_calls)
            ]
            tail = self._note(parsed.content, deltas)
            errors = list(parsed.errors)
        else:
            if rest:
                d = self._inc.feed(rest)
                first = self._note(d.content, d.tool_calls)
            else:
                first = {}
            d, parsed = self._inc.finish()
            tail = _merge(first, self._note(d.content, d.tool_calls))
            errors = list(parsed.errors)
        content = "".join(self._content).strip()
        by_index = {c.id: c for c in parsed.tool_calls}
        calls: list[ToolCall] = []
        for index in sorted(self._calls):
            cid, name, *args = self._calls[index]
            known = by_index.get(cid)
            arguments = known.arguments if known is not None else _loads("".join(args))
            calls.append(ToolCall(id=cid, name=name, arguments=arguments))
        return tail, Message(role="assistant", content=content, tool_calls=calls), errors


class _Delta:
    __slots__ = ("arguments", "id", "index", "name")

    def __init__(self, index: int, cid: str, name: str, arguments: str) -> None:
        self.index, self.id, self.name, self.arguments = index, cid, name, arguments


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _loads(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    if "content" in b:
        out["content"] = out.get("content", "") + b["content"]
    if "tool_calls" in b:
        out["tool_calls"] = [*out.get("tool_calls", []), *b["tool_calls"]]
    return out


__all__ = ["ChoiceStream", "TextStream"]
