"""The host side of the in-container agent's protocol (``_agent.py``): framed JSON requests
over one byte stream, authenticated replies matched to requests by id.

Invariants: a reply is accepted only with a valid HMAC-SHA256 under the channel's fresh key
(a bad one fails the channel); request ids are never reused; every request gets exactly one
outcome, its reply or ``SandboxError``; the reader holds at most one frame plus 4 KiB of stderr.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import struct
from typing import Any

from agentroll.errors import SandboxError
from agentroll.sandbox._process import _Capture

log = logging.getLogger("agentroll.sandbox")

_FRAME = struct.Struct(">I")
_DOCKER_HEADER = struct.Struct(">BxxxI")
_MAX_FRAME = 256 * 1024 * 1024
_STDERR_KEEP = 4096
_MAC_SIZE = 32


class _Forged(ValueError):
    """A reply frame whose MAC does not verify."""


class AgentChannel:
    """Requests to one agent.  ``await start()`` reads its hello; then ``request()``.

    The stream is a docker attach connection (``multiplexed``: docker's 8-byte frame headers
    separate the container's stdout from its stderr) or, in tests, a subprocess's pipes.  The
    channel's first frame gives the agent a fresh 256-bit key; a reply with a bad MAC fails the
    channel, since whatever wrote it could write anything.  Request ids are random 128-bit
    strings.  Once the stream ends or breaks, every pending and later request fails at once
    with ``SandboxError``, with the agent's last stderr lines in the message.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        multiplexed: bool,
        name: str = "agent",
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._multiplexed = multiplexed
        self.name = name
        self._key = secrets.token_bytes(32)
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._hello: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._buf = bytearray()
        self._stderr = bytearray()
        self._dead: str | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def stderr_tail(self) -> str:
        return self._stderr.decode("utf-8", "replace")

    async def start(self, timeout: float) -> dict[str, Any]:
        """Send the agent its key, start reading; return its hello.  ``SandboxError`` if
        none comes (or the agent reports that it cannot isolate its commands)."""
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        self.post({"key": self._key.hex()})
        try:
            async with asyncio.timeout(timeout):
                hello = await asyncio.shield(self._hello)
        except TimeoutError:
            self._fail(f"no hello from the agent within {timeout:.0f} s")
            raise SandboxError(self._reason()) from None
        if hello.get("error"):
            self._fail(f"the agent cannot start: {hello['error']}")
            raise SandboxError(self._reason())
        return hello

    def new_id(self) -> str:
        """A fresh, unguessable request id (to ``post`` a kill for the request later)."""
        return secrets.token_hex(16)

    def post(self, msg: dict[str, Any]) -> None:
        """Send without waiting for a reply (``kill``); a dead channel drops it."""
        if self._dead is None:
            with contextlib.suppress(Exception):
                self._writer.write(_encode(msg))

    async def request(
        self, msg: dict[str, Any], *, req_id: str | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """Send ``msg`` with id ``req_id`` (default: a fresh one) and return the reply.

        Raises ``SandboxError`` when the channel is or goes dead, ``TimeoutError`` when
        ``timeout`` passes first (the request stays unanswered; the channel stays usable).
        """
        if self._dead is not None:
            raise SandboxError(self._reason())
        if req_id is None:
            req_id = self.new_id()
        msg = {**msg, "id": req_id}
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            self._writer.write(_encode(msg))
            await self._writer.drain()
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:  # (an OSError: must not be taken for a broken pipe)
            raise
        except (ConnectionError, OSError) as exc:
            self._fail(f"writing to the agent failed: {exc}")
            raise SandboxError(self._reason()) from exc
        finally:
            self._pending.pop(req_id, None)

    async def close(self) -> None:
        self._fail("the channel was closed")
        with contextlib.suppress(Exception):
            self._writer.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def _reason(self) -> str:
        tail = self.stderr_tail.strip()
        where = f"{self.name}: {self._dead}"
        return f"{where}; its last stderr: {tail[-1000:]}" if tail else where

    def _fail(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        error = SandboxError(self._reason())
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        if not self._hello.done():
            self._hello.set_exception(error)
            self._hello.exception()  # retrieved: start() may not be waiting any more

    async def _read_loop(self) -> None:
        try:
            while True:
                if self._multiplexed:
                    kind, size = _DOCKER_HEADER.unpack(
                        await self._reader.readexactly(_DOCKER_HEADER.size)
                    )
                    data = await self._reader.readexactly(size)
                    if kind == 2:
                        self._on_stderr(data)
                        continue
                else:
                    data = await self._reader.read(65536)
                    if not data:
                        raise asyncio.IncompleteReadError(b"", None)
                self._on_stdout(data)
        except asyncio.IncompleteReadError:
            self._fail("the agent's stream ended (the container stopped or was removed)")
        except (ConnectionError, OSError) as exc:
            self._fail(f"the agent's stream broke: {exc}")
        except _Forged as exc:
            log.error("%s: %s; the container is not used any more", self.name, exc)
            self._fail(f"refused a reply: {exc} (something in the container forged it)")
        except (ValueError, KeyError, RecursionError) as exc:  # RecursionError: "[[[[..."
            self._fail(f"the agent sent a malformed frame: {exc}")

    def _on_stderr(self, data: bytes) -> None:
        self._stderr += data
        del self._stderr[:-_STDERR_KEEP]
        log.debug("%s stderr: %s", self.name, data.decode("utf-8", "replace").rstrip())

    def feed_stderr(self, data: bytes) -> None:
        """Stderr that arrives on another stream (a subprocess's pipe)."""
        self._on_stderr(data)

    def _on_stdout(self, data: bytes) -> None:
        self._buf += data
        while len(self._buf) >= _FRAME.size:
            (size,) = _FRAME.unpack_from(self._buf)
            if size > _MAX_FRAME:
                raise ValueError(f"frame of {size} bytes")
            if len(self._buf) < _FRAME.size + size:
                return
            frame = bytes(self._buf[_FRAME.size : _FRAME.size + size])
            del self._buf[: _FRAME.size + size]
            mac, body = frame[:_MAC_SIZE], frame[_MAC_SIZE:]
            if not hmac.compare_digest(mac, hmac.new(self._key, body, hashlib.sha256).digest()):
                raise _Forged(f"a frame of {size} bytes carries no valid MAC")
            msg = json.loads(body)
            if not isinstance(msg, dict):
                raise ValueError(f"a frame that is not a JSON object ({type(msg).__name__})")
            if "hello" in msg and not self._hello.done():
                self._hello.set_result(msg)
                continue
            req_id = msg.get("id")
            fut = self._pending.get(req_id) if isinstance(req_id, str) else None
            if fut is not None and not fut.done():
                fut.set_result(msg)


def _encode(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    return _FRAME.pack(len(body)) + body


def capture_from(parts: list[Any], limit: int) -> _Capture:
    """Rebuild the host's ``_Capture`` from the agent's ``[head_b64, tail_b64, total]``."""
    cap = _Capture(limit)
    head, tail, total = base64.b64decode(parts[0]), base64.b64decode(parts[1]), int(parts[2])
    cap._head += head
    cap._tail += tail
    cap.total = total
    return cap
