"""Process plumbing of the local sandbox: bounded output capture and process-group kills.

Invariants: a captured stream holds at most ``limit`` bytes (head and tail, cut on whole
UTF-8 characters) however much is written; ``_killpg`` never raises for a group that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path


class _Capture:
    """Keeps the first and last bytes of a stream in bounded memory and counts the rest."""

    __slots__ = ("_head", "_head_cap", "_tail", "_tail_cap", "total")

    def __init__(self, limit: int) -> None:
        self._head_cap = limit // 2
        self._tail_cap = limit - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data or not self._tail_cap:
            return
        if len(data) >= self._tail_cap:
            self._tail[:] = data[-self._tail_cap :]
        else:
            self._tail += data
            excess = len(self._tail) - self._tail_cap
            if excess > 0:
                del self._tail[:excess]

    @property
    def elided(self) -> int:
        return self.total - len(self._head) - len(self._tail)

    def text(self) -> str:
        """UTF-8 text (errors replaced) with a marker where bytes were elided."""
        if not self.elided:
            return (self._head + self._tail).decode("utf-8", "replace")
        # Cut whole characters only, so the seams do not show replacement characters.
        head_cut = _incomplete_utf8_suffix(self._head)
        tail_cut = 0
        while tail_cut < min(3, len(self._tail)) and self._tail[tail_cut] & 0xC0 == 0x80:
            tail_cut += 1
        head = self._head[: len(self._head) - head_cut].decode("utf-8", "replace")
        tail = self._tail[tail_cut:].decode("utf-8", "replace")
        return f"{head}\n...[elided {self.elided + head_cut + tail_cut} bytes]...\n{tail}"


def _incomplete_utf8_suffix(data: bytearray) -> int:
    """Length of a trailing, incomplete UTF-8 sequence (0 if the data ends on a boundary)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        if byte < 0xC0:
            return 0
        need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
        return back if need > back else 0
    return 0


class _ExecProtocol(asyncio.SubprocessProtocol):
    """Feeds both output pipes into bounded captures; futures for exit and pipe EOF.

    ``Process.wait()`` is not used because it also waits for the pipes to close, which a
    background child holding stdout can postpone forever.
    """

    def __init__(self, max_output: int, loop: asyncio.AbstractEventLoop) -> None:
        self.stdout = _Capture(max_output)
        self.stderr = _Capture(max_output)
        self.exited: asyncio.Future[None] = loop.create_future()
        self.drained: asyncio.Future[None] = loop.create_future()
        self._open_fds = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        (self.stdout if fd == 1 else self.stderr).feed(raw)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open_fds.discard(fd)
        if not self._open_fds and not self.drained.done():
            self.drained.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


def _killpg(pgid: int) -> None:
    # After a normal exit the leader is already reaped; the group id stays reserved by the
    # kernel as long as any member lives, so this reaches only our leftovers (or nobody).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """The children process ``pid`` forked that are still its own ([] if it is gone)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_early(transport: asyncio.SubprocessTransport) -> None:
    """Kill a command's group right after it started, and the children its leader forked so
    far: bubblewrap's child sets ``--die-with-parent`` only after the clone, in a session of
    its own, so a leader killed in between left the whole sandbox running (seen under CPU
    load when an exec was cancelled while starting).  Children are read only while the
    leader is not reaped, so their pids are still its children's."""
    pid = transport.get_pid()
    children = _children(pid) if transport.get_returncode() is None else []
    _killpg(pid)
    for child in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


def _kill_spawned(spawn: asyncio.Task[tuple[asyncio.SubprocessTransport, _ExecProtocol]]) -> None:
    """Done-callback of a spawn whose caller was cancelled: kill the group, drop the pipes."""
    if spawn.cancelled() or spawn.exception() is not None:
        return
    transport, _ = spawn.result()
    _kill_early(transport)
    transport.close()
