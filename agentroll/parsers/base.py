"""What a tool-call parser returns, whole (``ParsedOutput``) or as a stream of deltas.

Invariants: parsing never raises on model output (problems come back as error strings); a
stream's content deltas joined and stripped are the final parse's content; its tool-call
deltas assemble to the final parse's calls (a call announced by name and never given
arguments was rejected: it is among the errors); ``finish()`` returns ``parse(whole text)``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Protocol, runtime_checkable

import msgspec

from agentroll.types import ToolCall


class ParsedOutput(msgspec.Struct, kw_only=True):
    """An assistant turn split into visible content, tool calls and parse errors."""

    content: str
    tool_calls: list[ToolCall]
    errors: list[str]


@runtime_checkable
class ToolParser(Protocol):
    """Turns assistant text into calls.  Must never raise on any input."""

    def parse(self, text: str, *, call_id_prefix: str = "call") -> ParsedOutput: ...


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of one streamed tool call, as OpenAI streams them: the first delta of an
    ``index`` carries ``id`` and ``name``; ``arguments`` pieces concatenate to JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class StreamDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one ``feed`` (or ``finish``) adds: visible text and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = []


class StreamingParser(ABC):
    """Incremental parsing of one assistant turn: ``feed`` text as it is sampled, then
    ``finish``.  Content is emitted as soon as it cannot be the start of a call; a call is
    announced (``index``, ``id``, ``name``) once its name is read and gets its arguments, as
    one JSON text, when it closes well-formed.  An announced call that turns out malformed
    (or named otherwise in the end) never gets arguments: consumers drop it, and the final
    parse lists it among the errors; a well-formed one is then announced again under a new
    index.  Subclasses implement ``_feed`` and ``_finish`` with the ``_emit``, ``_announce``,
    ``_complete`` and ``_reject`` helpers.
    """

    def __init__(self, *, call_id_prefix: str = "call") -> None:
        self._prefix = call_id_prefix
        self._calls: list[ToolCall] = []
        self._errors: list[str] = []
        self._content: list[str] = []  # every content piece emitted so far
        self._pending_text: list[str] = []
        self._pending_calls: list[ToolCallDelta] = []
        self._num_indices = 0
        self._announced: tuple[int, str, str] | None = None  # index, id, name
        self._result: ParsedOutput | None = None

    def feed(self, text: str) -> StreamDelta:
        """Parse ``text`` (the next piece of the turn); returns what it settled.  Raises
        ``RuntimeError`` after ``finish`` (start a new stream for a new turn)."""
        if self._result is not None:
            raise RuntimeError("feed() after finish(): open a new stream for the next turn")
        if text:
            self._feed(text)
        return self._take()

    def finish(self) -> tuple[StreamDelta, ParsedOutput]:
        """Settle what was held back (an unclosed call becomes an error); returns the last
        delta and the whole turn's parse.  A second call returns an empty delta."""
        if self._result is not None:
            return StreamDelta(), self._result
        self._finish()
        self._result = ParsedOutput(
            content="".join(self._content).strip(),
            tool_calls=list(self._calls),
            errors=list(self._errors),
        )
        return self._take(), self._result

    @abstractmethod
    def _feed(self, text: str) -> None: ...

    @abstractmethod
    def _finish(self) -> None: ...

    # -- helpers for subclasses ----------------------------------------------------------

    def _take(self) -> StreamDelta:
        delta = StreamDelta(content="".join(self._pending_text), tool_calls=self._pending_calls)
        self._pending_text = []
        self._pending_calls = []
        return delta

    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._pending_text.append(text)

    def _call_id(self) -> str:
        """The id of the next call: ``{prefix}_{k}``, k counting the turn's calls and errors."""
        return f"{self._prefix}_{len(self._calls) + len(self._errors)}"

    def _announce(self, name: str, call_id: str | None = None) -> None:
        """Say that the open call is named ``name`` (once per call; a name no trajectory could
        hold, with a lone surrogate, waits for the call's end)."""
        if self._announced is not None or not name or not _is_encodable(name):
            return
        call_id = call_id or self._call_id()
        index = self._new_index()
        self._announced = (index, call_id, name)
        self._pending_calls.append(ToolCallDelta(index=index, id=call_id, name=name))

    def _announce_literal(self, literal: str) -> None:
        """``_announce`` the name a JSON string literal spells (nothing if it spells none)."""
        try:
            name = json.loads(literal)
        except ValueError:
            return
        if isinstance(name, str):
            self._announce(name)

    def _complete(self, call: ToolCall) -> None:
        """The open call closed well-formed: record it and send its arguments."""
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        announced, self._announced = self._announced, None
        if announced is not None and announced[1:] == (call.id, call.name):
            self._pending_calls.append(ToolCallDelta(index=announced[0], arguments=arguments))
        else:
            self._pending_calls.append(
                ToolCallDelta(
                    index=self._new_index(), id=call.id, name=call.name, arguments=arguments
                )
            )
        self._calls.append(call)

    def _settle(self, call: ToolCall | None, error: str) -> None:
        """The open call closed: ``_complete`` it, or ``_reject`` it with ``error``."""
        if call is not None:
            self._complete(call)
        else:
            self._reject(error)

    def _reject(self, error: str) -> None:
        """The open call (if any) is malformed: record ``error``; its announcement stays
        without arguments."""
        self._announced = None
        self._errors.append(error)

    def _new_index(self) -> int:
        self._num_indices += 1
        return self._num_indices - 1


@runtime_checkable
class StreamingToolParser(ToolParser, Protocol):
    """A parser that can also parse a turn as it is generated."""

    def stream(self, *, call_id_prefix: str = "call") -> StreamingParser: ...


def _is_encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
