"""Drive a parser's stream over chunks and assemble what it emitted, as an OpenAI client
would: content pieces joined, tool-call pieces grouped by index."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import msgspec

from agentroll.parsers import ParsedOutput, StreamDelta, StreamingToolParser
from agentroll.types import ToolCall


class StreamRun(msgspec.Struct):
    chunks: list[str]
    deltas: list[StreamDelta]  # one per feed, then finish's
    final: ParsedOutput

    @property
    def content(self) -> str:
        return "".join(d.content for d in self.deltas)


def chunked(text: str, cuts: Sequence[int]) -> list[str]:
    """``text`` cut at the positions ``cuts`` (any order, repeats give empty chunks)."""
    points = [0, *sorted(min(max(c, 0), len(text)) for c in cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(points)]


def run_stream(
    parser: StreamingToolParser, chunks: Sequence[str], *, call_id_prefix: str = "call"
) -> StreamRun:
    stream = parser.stream(call_id_prefix=call_id_prefix)
    deltas = [stream.feed(c) for c in chunks]
    last, final = stream.finish()
    return StreamRun(list(chunks), [*deltas, last], final)


def assemble(deltas: Sequence[StreamDelta]) -> list[tuple[str, str, Any]]:
    """The calls the deltas announce and complete, in index order: ``(id, name, arguments)``.
    Checks the delta shape on the way: the first delta of an index (and only it) carries the
    id and the name; indices come in order; an index never given arguments is dropped."""
    heads: dict[int, tuple[str, str]] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index not in heads:
                assert piece.index == len(heads), "indices must be announced in order"
                assert piece.id and piece.name, f"first delta of {piece.index} lacks id/name"
                heads[piece.index] = (piece.id, piece.name)
            else:
                assert piece.id is None and piece.name is None
            arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
    return [(*heads[i], json.loads(arguments[i])) for i in sorted(heads) if arguments.get(i, "")]


def expected_calls(calls: Sequence[ToolCall]) -> list[tuple[str, str, Any]]:
    # through JSON, as the deltas are (NaN from "NaN" compares equal only so)
    return [(c.id, c.name, json.loads(json.dumps(c.arguments))) for c in calls]


def same(a: list[tuple[str, str, Any]], b: list[tuple[str, str, Any]]) -> bool:
    """Equal, NaN included (compared by its JSON text)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
