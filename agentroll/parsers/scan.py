"""Text scanning shared by the streaming parsers: markers, JSON extents, a buffered driver.

Invariants: a scan finds the same things whatever the chunking of its input (text that
could still be the start of a marker is held back, never a character more); every search
starts where the last one stopped (less a marker's length), so a turn costs linear time;
positions inside an open region are relative to its start, which stays put until it closes.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Iterable

from agentroll.parsers.base import StreamingParser


class Markers:
    """A set of literal markers, none a prefix or an overlapping suffix of another."""

    def __init__(self, markers: Iterable[str]) -> None:
        self.markers = tuple(sorted(markers, key=len, reverse=True))
        self.pattern = re.compile("|".join(map(re.escape, self.markers)))
        self.maxlen = len(self.markers[0])
        self._prefixes = {m[:k] for m in self.markers for k in range(1, len(m))}

    def split(self, buf: str, pos: int, final: bool) -> tuple[int, str | None]:
        """``(a, marker)``: ``buf[pos:a]`` is plain text and ``marker`` starts at ``a``; with
        no marker, ``buf[a:]`` is held back as the possible start of one (nothing when
        ``final``)."""
        m = self.pattern.search(buf, pos)
        if m is not None:
            return m.start(), m.group()
        return (len(buf) if final else self.held_from(buf, pos)), None

    def held_from(self, buf: str, pos: int) -> int:
        """Where the longest suffix of ``buf[pos:]`` that begins a marker starts."""
        n = len(buf)
        for k in range(min(self.maxlen - 1, n - pos), 0, -1):
            if buf[n - k :] in self._prefixes:
                return n - k
        return n

    def could_start(self, text: str) -> bool:
        """Whether ``text`` (the rest of a buffer) is a proper prefix of a marker."""
        return len(text) < self.maxlen and text in self._prefixes

    def starting(self, buf: str, pos: int) -> str | None:
        """The marker at ``buf[pos]``, if any."""
        m = self.pattern.match(buf, pos)
        return m.group() if m else None


_OUTSIDE = re.compile(r'["{}\[\]]')
_INSIDE = re.compile(r'["\\]')


class JsonScanner:
    """Finds the brackets of a JSON value outside its strings, fed as the text grows.
    ``pos`` is relative to the value's start; ``depth`` counts open brackets."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self._in_string = False

    def next_bracket(self, buf: str, base: int) -> tuple[int, str] | None:
        """The next bracket outside strings, as ``(position relative to base, char)`` with
        ``depth`` updated; ``None`` when ``buf`` ends first."""
        while True:
            if self._in_string:
                m = _INSIDE.search(buf, base + self.pos)
                if m is None:
                    self.pos = len(buf) - base
                    return None
                if m.group() == "\\":
                    if m.end() >= len(buf):  # the escaped character is still to come
                        self.pos = m.start() - base
                        return None
                    self.pos = m.end() + 1 - base
                    continue
                self._in_string = False
                self.pos = m.end() - base
                continue
            m = _OUTSIDE.search(buf, base + self.pos)
            if m is None:
                self.pos = len(buf) - base
                return None
            self.pos = m.end() - base
            char = m.group()
            if char == '"':
                self._in_string = True
                continue
            self.depth += 1 if char in "{[" else -1
            return m.start() - base, char


_COMPACT_AT = 1 << 16


class BufferedStream(StreamingParser):
    """A stream driven by ``_step``: ``self._buf[self._pos:]`` is the text not yet settled;
    ``_step`` settles some of it and says whether it can go on, ``self._final`` telling it
    that no more text will come."""

    def __init__(self, *, call_id_prefix: str = "call") -> None:
        super().__init__(call_id_prefix=call_id_prefix)
        self._buf = ""
        self._pos = 0
        self._final = False

    def _feed(self, text: str) -> None:
        buf, self._buf = self._buf, ""
        if self._pos >= _COMPACT_AT and self._pos * 2 >= len(buf):
            buf, self._pos = buf[self._pos :], 0
        buf += text  # in place: `buf` holds the only reference
        self._buf = buf
        while self._step():
            pass

    def _finish(self) -> None:
        self._final = True
        while self._step():
            pass
        self._end()

    @abstractmethod
    def _step(self) -> bool: ...

    def _end(self) -> None:
        """Called once after the last step of ``finish``."""
