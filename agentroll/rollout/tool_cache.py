"""The result cache of pure tools (``@tool(pure=True)``), per rollout engine: pure logic.

A key is the tool's name, its validated arguments, the task id when the tool reads the
episode state and the sandbox's state digest when it reads the sandbox (the engine computes
those).  Invariants: only results without an error or with a ``tool_error`` are kept (a
timeout or a crash says nothing about the key); a tool whose result for a key differs from
the cached one (found by re-executing sampled hits, or by two calls that both missed) is
impure from then on: its entries are dropped, it is never cached again, and the mismatch
is recorded for ``agentroll validate``.  No I/O.
"""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import xxhash

from agentroll.errors import ConfigError
from agentroll.types import ToolResult

#: errors that are a function of the key; other failures are never cached
CACHEABLE_ERRORS = (None, "tool_error")


class Impurity(msgspec.Struct, frozen=True, kw_only=True):
    """A key for which ``tool`` returned two different results."""

    tool: str
    key: str
    cached: str
    fresh: str


class ToolCache:
    """Cached results of pure tools.  ``verify_rate``: the chance that a hit is executed
    again and compared (the first ``verify_first`` hits of each tool always are);
    ``max_entries``: the most results kept (the oldest go first)."""

    def __init__(
        self,
        *,
        verify_rate: float = 0.05,
        verify_first: int = 2,
        max_entries: int = 65_536,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= verify_rate <= 1.0:
            raise ConfigError(f"tool cache verify_rate {verify_rate}: use a value in [0, 1]")
        if verify_first < 0 or max_entries < 1:
            raise ConfigError("tool cache verify_first must be >= 0 and max_entries >= 1")
        self.verify_rate = verify_rate
        self.verify_first = verify_first
        self.max_entries = max_entries
        self._rng = random.Random(seed)
        self._entries: dict[str, tuple[str, str, str | None]] = {}  # key -> (tool, content, error)
        self._hits_of: dict[str, int] = {}
        self.impure: dict[str, Impurity] = {}  # tool -> its first mismatch
        self.counters = {"hits": 0, "misses": 0, "verified": 0, "uncacheable": 0, "joined": 0}

    @staticmethod
    def key(
        tool: str, arguments: dict[str, Any], *, task_id: str | None, sandbox: str | None
    ) -> str:
        """The key of a call: a hash of the tool, its arguments (canonical JSON), and the
        task id and sandbox digest where the tool reads them (None: it does not)."""
        blob = json.dumps(
            [tool, arguments, task_id, sandbox], sort_keys=True, default=repr, ensure_ascii=False
        )
        return xxhash.xxh3_128_hexdigest(blob.encode("utf-8", "surrogatepass"))

    def enabled(self, tool: str) -> bool:
        """False once ``tool`` was found impure."""
        return tool not in self.impure

    def lookup(self, tool: str, key: str) -> tuple[ToolResult | None, bool]:
        """``(cached result or None, whether to execute anyway and compare)``; counts a hit
        or a miss.  The cached result has an empty ``call_id``: ``for_call`` fills it."""
        got = self._entries.get(key) if self.enabled(tool) else None
        if got is None:
            self.counters["misses"] += 1
            return None, False
        self.counters["hits"] += 1
        n = self._hits_of[tool] = self._hits_of.get(tool, 0) + 1
        verify = n <= self.verify_first or self._rng.random() < self.verify_rate
        _, content, error = got
        return ToolResult(call_id="", name=tool, content=content, error=error, cached=True), verify

    def joined(self) -> None:
        """The miss just counted shared the result of the same key's run in flight: it
        counts as a hit (``joined`` says how many hits were of this kind)."""
        self.counters["misses"] -= 1
        self.counters["hits"] += 1
        self.counters["joined"] += 1

    def store(self, tool: str, key: str, result: ToolResult) -> bool:
        """Record what executing ``tool`` for ``key`` returned (after a miss or a verified
        hit); returns False when it differs from what the cache holds (the tool is impure
        from now on)."""
        if not self.enabled(tool):
            return True
        if result.error not in CACHEABLE_ERRORS:
            self.counters["uncacheable"] += 1
            return True
        fresh = (tool, result.content, result.error)
        held = self._entries.get(key)
        if held is not None:
            self.counters["verified"] += 1
            if held != fresh:
                self.impure[tool] = Impurity(tool=tool, key=key, cached=held[1], fresh=fresh[1])
                self._entries = {k: v for k, v in self._entries.items() if v[0] != tool}
                return False
            return True
        if len(self._entries) >= self.max_entries:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = fresh
        return True

    def stats(self) -> dict[str, Any]:
        """Counters, entries held and the tools found impure (by name)."""
        return {**self.counters, "entries": len(self._entries), "impure": sorted(self.impure)}


def for_call(result: ToolResult, call_id: str) -> ToolResult:
    """A cached result as the answer to the call ``call_id`` (it took no time)."""
    return msgspec.structs.replace(result, call_id=call_id, duration=0.0)


__all__ = ["CACHEABLE_ERRORS", "Impurity", "ToolCache", "for_call"]
