"""A small asyncio HTTP/1.1 server for the trajectory stream's API (httptools parses).

Invariants: responses go out in request order, one handler at a time per connection; every
request gets exactly one response while its peer is there; a body is read only on demand;
every wait on the peer is bounded (``HTTPConfig``); a response's descriptors are closed
once it was sent or failed.  Not supported: TLS, HTTP/2, protocol upgrades, trailers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import math
import os
import socket
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httptools
import msgspec

from agentroll._net import is_loopback
from agentroll.errors import ConfigError
from agentroll.stream.connections import _bulk_sndbuf, _fit_nofile, _Server

logger = logging.getLogger("agentroll.stream.http")

_MAX_URL = 8 << 10  # bytes of a request target
_MAX_HEAD = 64 << 10  # bytes of all header names and values of a request
_MAX_HEADERS = 128
_BODY_QUEUE = 4 << 20  # received body bytes waiting for the handler before reading pauses
_PIPELINE = 16  # requests waiting behind the current one before reading pauses
_LINGER = 5.0  # seconds a closing connection discards what the peer still sends
_ONE_WRITE = 64 << 10  # bytes of a body sent in the same write as its head
_STREAM_BUFFER = 1 << 20  # bytes of a streamed body buffered before waiting for the client


class HTTPConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Time limits and connection caps of ``serve``; invalid values raise ``ConfigError``.

    ``head_timeout``: seconds from a connection's start, or a request's first byte, to its
    complete head; ``body_timeout``: seconds a handler reading the body waits for its next
    bytes (408, and the connection closes); ``idle_timeout``: seconds a keep-alive connection
    waits for its next request; ``max_connections`` and ``max_connections_per_client``:
    connections held at once, in all and from one client address."""

    head_timeout: float = 10.0
    body_timeout: float = 10.0
    idle_timeout: float = 75.0
    max_connections: int = 512
    max_connections_per_client: int = 64

    def __post_init__(self) -> None:
        for name in ("head_timeout", "body_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < math.inf):
                raise ConfigError(
                    f"HTTPConfig.{name}={value!r}; use a finite number of seconds > 0"
                )
        for name in ("max_connections", "max_connections_per_client"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"HTTPConfig.{name}={value!r}; use an int >= 1")
        if self.max_connections_per_client > self.max_connections:
            raise ConfigError(
                f"HTTPConfig.max_connections_per_client={self.max_connections_per_client} "
                f"exceeds max_connections={self.max_connections}; use at most that"
            )


class _Reject(Exception):
    """Raised in a parser callback: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class HTTPError(Exception):
    """Raise in a handler to answer ``status`` with ``message`` as text."""

    def __init__(self, status: int, message: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = tuple(headers)


@dataclass(frozen=True)
class FileRange:
    """``count`` bytes at ``offset`` of the open file ``fd``, sent with sendfile."""

    fd: int
    offset: int
    count: int


@dataclass
class Response:
    """Status, headers and a body made of byte strings and file ranges, sent in order.
    ``on_close`` is called once the response was sent or failed (once): it gives back what
    the response holds, e.g. closes or returns the descriptors of its ranges' files.

    ``stream``: a body produced while it is sent (server-sent events), after ``parts``, with
    chunked transfer encoding.  When the client leaves, the iterator is closed (cancelled
    where it waits), so what produces it stops."""

    status: int = 200
    parts: Sequence[bytes | memoryview | FileRange] = ()
    content_type: str | None = None
    headers: Sequence[tuple[str, str]] = ()
    on_close: Callable[[], None] | None = None
    stream: AsyncIterator[bytes] | None = None

    @classmethod
    def text(cls, status: int, text: str, headers: Sequence[tuple[str, str]] = ()) -> Response:
        return cls(status, [text.encode()], "text/plain; charset=utf-8", headers)

    @classmethod
    def data(cls, body: bytes | memoryview, content_type: str, status: int = 200) -> Response:
        return cls(status, [body], content_type)

    def length(self) -> int:
        return sum(
            p.count if isinstance(p, FileRange) else memoryview(p).nbytes for p in self.parts
        )

    def release(self) -> None:
        """Call ``on_close`` (idempotent)."""
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()


Handler = Callable[["Request"], Awaitable[Response]]


class Request:
    """One parsed request: ``method``, ``path``, ``query`` (last value of each name),
    ``headers`` (lower-case names; repeated ones joined with ", "); the body on demand."""

    def __init__(self, conn: _Connection, method: str, target: bytes, headers: dict[str, str]):
        self._conn = conn
        self.method = method
        if target[:1] == b"/" and not any(c in target for c in b"%?#"):
            # the common case (an origin-form path, nothing to unquote): no URL parsing
            self.path = target.decode("latin-1")
            self.query: dict[str, str] = {}
        else:
            url = httptools.parse_url(target)
            self.path = urllib.parse.unquote(url.path.decode("latin-1"))
            query = (url.query or b"").decode("latin-1")
            self.query = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
        self.headers = headers
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._complete = False
        self._arrived = asyncio.Event()
        self._broken = False  # the body was malformed: the connection closes after this
        self.keep_alive = True
        self.continued = False  # 100 Continue was sent

    # fed by the connection ------------------------------------------------------------------

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._queued += len(chunk)
        self._arrived.set()
        if self._queued > _BODY_QUEUE:
            self._conn._pause("body")

    def _end(self) -> None:
        self._complete = True
        self._arrived.set()

    def _break(self) -> None:
        self._broken = True
        self._arrived.set()

    # for handlers ---------------------------------------------------------------------------

    @property
    def body_complete(self) -> bool:
        """Every byte of the body was received (and no more are coming)."""
        return self._complete

    async def stream(self, limit: int | None = None, hint: str = "") -> AsyncIterator[bytes]:
        """The body's chunks as they arrive (chunked bodies decoded); ``HTTPError(413)``
        (its message ending with ``hint``) beyond ``limit`` bytes, declared or sent.  Raises
        ``ConnectionError`` when the peer left before the end of the body."""
        declared = self.headers.get("content-length", "")
        if limit is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPError(
                413, f"request body of {declared} bytes exceeds the {limit}-byte limit{hint}"
            )
        self._conn._continue(self)
        size = 0
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._queued -= len(chunk)
                if self._queued <= _BODY_QUEUE // 2:
                    self._conn._resume("body")
                size += len(chunk)
                if limit is not None and size > limit:
                    raise HTTPError(413, f"request body exceeds the {limit}-byte limit{hint}")
                yield chunk
            if self._complete:
                return
            if self._broken:
                raise HTTPError(400, "malformed request body")
            if self._conn.lost.done():
                raise ConnectionError("the client closed the connection during the request body")
            self._arrived.clear()
            timeout = self._conn.config.body_timeout
            try:
                async with asyncio.timeout(timeout):
                    await self._arrived.wait()  # set by the connection on data, the end, loss
            except TimeoutError:
                raise HTTPError(
                    408,
                    f"no byte of the request body came for {timeout:g} s "
                    "(HTTPConfig.body_timeout); send the body right after the head",
                ) from None

    async def body(self, limit: int) -> bytes:
        """The whole body; ``HTTPError(413)`` beyond ``limit`` bytes (declared or sent)."""
        return b"".join([chunk async for chunk in self.stream(limit)])

    async def disconnected(self) -> None:
        """Return once the client has closed the connection."""
        await asyncio.shield(self._conn.lost)

    def on_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once the client has closed the connection (at once if it has);
        returns a function that cancels this."""
        lost = self._conn.lost

        def fire(_: asyncio.Future[None]) -> None:
            callback()

        def cancel() -> None:
            lost.remove_done_callback(fire)

        lost.add_done_callback(fire)
        return cancel


@dataclass
class App:
    """Routes (``path -> method -> handler``) behind an optional bearer token.

    ``fallback`` answers the paths no route names (an app with path parameters routes them
    itself).  ``authorize``, when set, replaces the token check: it returns why a request is
    refused (answered 401), or None.  ``error`` renders every refusal the server or the app
    makes (bad HTTP, limits, auth, no route, a failed handler) in the app's own format;
    default: plain text."""

    routes: dict[str, dict[str, Handler]]
    token: str | None = None
    fallback: Handler | None = None
    authorize: Callable[[Request], str | None] | None = None
    error: Callable[[int, str], Response] | None = None
    _expected: bytes | None = field(init=False, default=None)

    def refusal(
        self, status: int, message: str, headers: Sequence[tuple[str, str]] = ()
    ) -> Response:
        """``status`` with ``message``, in the app's error format."""
        if self.error is None:
            return Response.text(status, message, headers)
        response = self.error(status, message)
        if headers:
            response.headers = [*response.headers, *headers]
        return response

    def __post_init__(self) -> None:
        if self.token is not None:
            if not self.token.strip():
                raise ConfigError("App token is empty; give a non-empty bearer token or None")
            self._expected = f"Bearer {self.token}".encode()

    async def handle(self, request: Request) -> Response:
        if self.authorize is not None:
            refused = self.authorize(request)
            if refused is not None:
                return self.refusal(401, refused, [("www-authenticate", "Bearer")])
            request._conn.trusted = True
        elif self._expected is not None:
            given = request.headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self._expected):
                return self.refusal(
                    401,
                    "missing or wrong bearer token: send 'Authorization: Bearer <token>' with "
                    "the token the worker was started with (its run directory's "
                    "stream.token, or $AGENTROLL_STREAM_TOKEN)",
                    [("www-authenticate", "Bearer")],
                )
            # a client that proved it holds the token: its connection is never evicted
            request._conn.trusted = True
        methods = self.routes.get(request.path)
        if methods is None:
            if self.fallback is not None:
                return await self.fallback(request)
            return self.refusal(404, f"no route {request.path!r}")
        handler = methods.get(request.method)
        if handler is None:
            allow = ", ".join(sorted(methods))
            return self.refusal(
                405, f"{request.method} is not allowed here; use {allow}", [("allow", allow)]
            )
        return await handler(request)


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers in order, writes the
    responses (file ranges with sendfile).

    Why not uvicorn + Starlette, which serve the weight endpoints: most of a lease body is spool
    records already in the page cache, and this server sends them with ``sendfile(2)``: no read into
    user memory, no copy into a transport buffer (the worker's CPU is what bounds the stream on a
    small machine).  What it does not do: TLS (put a proxy in front), HTTP/2, protocol upgrades,
    trailers.

    Invariants:
    - one request at a time per connection: a pipelined request is parsed, but its handler starts
      once the response before it is complete (responses go out in request order);
    - every request gets exactly one response while its peer is there: ``HTTPError`` from a handler
      becomes a text reply with its status, any other exception a 500 (logged), and the server keeps
      serving; malformed HTTP gets 400 and the connection is closed;
    - a request body is read only when the handler asks (``body`` with a limit, or ``stream``), and
      reading pauses while more than ``_BODY_QUEUE`` bytes of it wait to be consumed; a response
      sent before its request's body was read closes the connection after it (after a half-close, so
      the peer reads the response rather than a reset);
    - every wait on the peer is bounded (``HTTPConfig``): a request head must be complete
      ``head_timeout`` seconds after the connection opened or the head's first byte came, a handler
      reading the body gets 408 after ``body_timeout`` seconds without a byte of it (the connection
      then closes), an idle keep-alive connection is closed after ``idle_timeout``;
    - the descriptors a ``Response`` owns are closed once it was sent or failed (or the connection
      is gone), so the files it reads may be unlinked meanwhile.
    """

    def __init__(self, server: _Server) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = self._loop.create_future()
        self._pending: collections.deque[Request] = collections.deque()
        self._current: Request | None = None  # the request being parsed
        self._task: asyncio.Task[None] | None = None
        self._url = b""
        self._head: dict[str, str] = {}
        self._head_bytes = 0
        self._paused: set[str] = set()
        self._drained: asyncio.Future[None] | None = None
        self._write_fd = -1  # a dup of the socket: waits for writability during sendfile
        self._closing = False
        self._discard = False  # after a half-close: what arrives is dropped
        self._idle_timer: asyncio.TimerHandle | None = None
        self._deadline: float | None = None  # when _idle_close closes the connection
        self._in_head = False  # a request head has begun and is not complete
        self.config = server.config
        self.client = ""  # the peer's address: what max_connections_per_client counts
        self.trusted = False  # sent the app's token once (a connection kept over an idle one)
        self.counted = False  # held in the server's connection tables

    # asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # pause_writing as soon as anything is buffered, resume_writing when it drained:
        # the signal that a sendfile may start
        transport.set_write_buffer_limits(high=0, low=0)
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refused = self._server.admit(self)
        if refused is not None:
            self._closing = self._discard = True
            self._write_response(self._server.app.refusal(503, refused))
            transport.close()
            return
        self._arm_timer(self.config.head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.forget(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if not self.lost.done():
            self.lost.set_result(None)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if self._write_fd >= 0:
            self._loop.remove_writer(self._write_fd)
            os.close(self._write_fd)
            self._write_fd = -1
        for request in self._pending:
            request._arrived.set()

    def data_received(self, data: bytes) -> None:
        if self._discard or self._closing:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self._reject(cause.status, cause.message)
            else:
                self._reject(400, f"malformed HTTP request: {exc}")

    def eof_received(self) -> bool | None:
        return None  # close our side too: no request can come after the client's EOF

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._head, self._head_bytes = b"", {}, 0
        self._in_head = True
        if self._task is None:  # the head's first byte: from now on head_timeout applies
            self._arm_timer(self.config.head_timeout)

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > _MAX_URL:
            raise _Reject(414, f"request target longer than {_MAX_URL} bytes; send a shorter URL")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > _MAX_HEAD or len(self._head) > _MAX_HEADERS:
            raise _Reject(
                431,
                f"more than {_MAX_HEAD} bytes or {_MAX_HEADERS} header fields; send fewer "
                "or shorter headers",
            )
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self._head[key] = f"{self._head[key]}, {text}" if key in self._head else text

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_timer()
        method = self._parser.get_method().decode("latin-1")
        try:
            request = Request(self, method, self._url, self._head)
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError) as exc:
            raise _Reject(400, f"bad request target {self._url[:200]!r}") from exc
        request.keep_alive = self._parser.should_keep_alive()
        self._current = request
        self._pending.append(request)
        if len(self._pending) > _PIPELINE:
            self._pause("pipeline")
        if self._task is None:
            self._task = self._loop.create_task(self._serve())

    def on_body(self, body: bytes) -> None:
        if self._current is not None:
            self._current._feed(body)

    def on_message_complete(self) -> None:
        if self._current is not None:
            self._current._end()
            self._current = None

    # flow control ----------------------------------------------------------------------------

    def _pause(self, why: str) -> None:
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._paused.add(why)

    def _resume(self, why: str) -> None:
        if why in self._paused:
            self._paused.discard(why)
            if not self._paused and self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def _continue(self, request: Request) -> None:
        """An ``Expect: 100-continue`` request's handler reads the body: tell the client."""
        if (
            request.headers.get("expect", "").lower() == "100-continue"
            and not request._complete
            and not request.continued
            and self.transport is not None
            and not self.transport.is_closing()
        ):
            request.continued = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    # serving ---------------------------------------------------------------------------------

    def _reject(self, status: int, message: str) -> None:
        """A response to bad HTTP (no handler runs for it), then the connection closes."""
        self._closing = True
        if self._current is not None:  # its handler may be waiting for the rest of the body
            self._current._break()
            self._current = None
        if self._task is None and self.transport is not None and not self.transport.is_closing():
            self._write_response(self._server.app.refusal(status, message))
            self._half_close()
        # else: the request in progress is answered first, then the connection closes

    async def _serve(self) -> None:
        """Answer the pending requests in order while the connection lives."""
        try:
            while self._pending and not self.lost.done():
                request = self._pending[0]
                self._server.active += 1
                try:
                    response = await self._respond(request)
                    self._pending.popleft()
                    self._resume("pipeline")
                    close = self._closing or not request.keep_alive or self._server.closing
                    close = close or not request.body_complete
                    try:
                        await self._send(response, close=close)
                    finally:
                        response.release()
                finally:
                    self._server.active -= 1
                    self._server.idle.set()
                if close:
                    self._half_close()
                    return
        except (ConnectionError, OSError) as exc:
            logger.debug("connection failed while sending a response: %s", exc)
            self._abort()
        except asyncio.CancelledError:
            self._abort()
            raise
        finally:
            self._task = None
            if self._closing and not self._discard:
                self._half_close()
            elif not self._pending:
                # a head begun meanwhile (pipelined) has head_timeout; none, idle_timeout
                self._arm_timer(
                    self.config.head_timeout if self._in_head else self.config.idle_timeout
                )

    async def _respond(self, request: Request) -> Response:
        try:
            return await self._server.app.handle(request)
        except HTTPError as exc:
            return self._server.app.refusal(exc.status, exc.message, exc.headers)
        except ConnectionError:
            return self._server.app.refusal(
                400, "the client closed the connection during the request"
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s %s failed", request.method, request.path)
            return self._server.app.refusal(500, "internal error in the worker (see its log)")

    def _write_response(self, response: Response) -> None:
        """A refusal written at once (bytes parts only), the connection closing after it."""
        assert self.transport is not None
        body = b"".join(bytes(p) for p in response.parts if not isinstance(p, FileRange))
        self.transport.write(self._head_of(response, close=True) + body)

    def _write_head(self, response: Response, *, close: bool) -> None:
        assert self.transport is not None
        self.transport.write(self._head_of(response, close=close))

    @staticmethod
    def _head_of(response: Response, *, close: bool) -> bytes:
        try:
            reason = HTTPStatus(response.status).phrase
        except ValueError:
            reason = ""
        lines = [f"HTTP/1.1 {response.status} {reason}"]
        if response.stream is not None:
            lines.append("transfer-encoding: chunked")
        elif response.status not in (204, 304):
            lines.append(f"content-length: {response.length()}")
        if response.content_type is not None:
            lines.append(f"content-type: {response.content_type}")
        lines += [f"{k}: {v}" for k, v in response.headers]
        if close:
            lines.append("connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _send(self, response: Response, *, close: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        parts = response.parts
        if (
            response.stream is None
            and len(parts) == 1
            and isinstance(parts[0], bytes)
            and len(parts[0]) <= _ONE_WRITE
            and response.status not in (204, 304)
        ):  # a small reply: head and body in one write (one segment, one syscall)
            transport.write(self._head_of(response, close=close) + parts[0])
            return
        self._write_head(response, close=close)
        sock_fd = -1
        for part in response.parts if response.status not in (204, 304) else ():
            if transport.is_closing():
                raise ConnectionError("the client closed the connection during the response")
            if not isinstance(part, FileRange):
                if part:
                    transport.write(part if isinstance(part, bytes) else memoryview(part).cast("B"))
                continue
            # sendfile goes straight to the socket: first what the transport buffered
            while self._drained is not None and not self._drained.done():
                await asyncio.wait({self._drained, self.lost}, return_when=asyncio.FIRST_COMPLETED)
                if self.lost.done():
                    raise ConnectionError("the client closed the connection during the response")
            if sock_fd < 0:
                sock_fd = transport.get_extra_info("socket").fileno()
            offset, left = part.offset, part.count
            while left:  # one call per range (a spool record) while the socket takes them
                try:
                    sent = os.sendfile(sock_fd, part.fd, offset, left)
                except BlockingIOError:
                    await self._writable(sock_fd)
                    continue
                if sent == 0:
                    raise OSError(f"sendfile: the file ended {left} bytes early (truncated?)")
                offset += sent
                left -= sent
        if response.stream is not None:
            await self._send_stream(transport, response.stream)

    async def _send_stream(self, transport: asyncio.Transport, body: AsyncIterator[bytes]) -> None:
        """Send ``body`` in chunked encoding while the client is there; the iterator is closed
        in every case (cancelled in its wait when the client leaves)."""
        it = aiter(body)
        try:
            while True:
                step: asyncio.Future[bytes] = asyncio.ensure_future(anext(it))
                if not step.done():
                    waits: set[asyncio.Future[Any]] = {step, self.lost}
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # the client left while the body was being produced
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
                    raise ConnectionError("the client closed the connection during the response")
                try:
                    chunk = step.result()
                except StopAsyncIteration:
                    break
                if transport.is_closing():
                    raise ConnectionError("the client closed the connection during the response")
                if chunk:
                    transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                if transport.get_write_buffer_size() > _STREAM_BUFFER:
                    await self._drain()
            transport.write(b"0\r\n\r\n")
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _drain(self) -> None:
        """Wait until the transport's buffer drained (or the client left: ConnectionError)."""
        while self._drained is not None and not self._drained.done():
            await asyncio.wait({self._drained, self.lost}, return_when=asyncio.FIRST_COMPLETED)
            if self.lost.done():
                raise ConnectionError("the client closed the connection during the response")

    async def _writable(self, fd: int) -> None:
        """Wait until the socket takes more (on a dup of it: asyncio keeps the original
        for its transport)."""
        if self._write_fd < 0:
            self._write_fd = os.dup(fd)
        ready = self._loop.create_future()
        self._loop.add_writer(self._write_fd, _resolve, ready)
        try:
            await asyncio.wait({ready, self.lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if self._write_fd >= 0:
                self._loop.remove_writer(self._write_fd)
        if self.lost.done():
            raise ConnectionError("the client closed the connection during the response")

    def _arm_timer(self, seconds: float) -> None:
        """Close the connection if no complete request head arrives within ``seconds``
        (an idle keep-alive, a head sent a byte at a time, a connection that sends nothing).
        One timer handle per connection: a later deadline is checked when it fires, so a
        request costs no new handle (cancelled ones would pile up in the loop's heap)."""
        self._deadline = self._loop.time() + seconds
        timer = self._idle_timer
        if timer is None or timer.when() > self._deadline:
            if timer is not None:
                timer.cancel()
            self._idle_timer = self._loop.call_at(self._deadline, self._idle_close)

    def _disarm_timer(self) -> None:
        self._deadline = None  # the handle stays; it finds no deadline when it fires

    def _idle_close(self) -> None:
        self._idle_timer = None
        deadline = self._deadline
        if deadline is None:
            return
        if self._loop.time() < deadline:
            self._idle_timer = self._loop.call_at(deadline, self._idle_close)
            return
        if self._task is None and self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _half_close(self) -> None:
        """Stop sending (FIN after what is buffered) and drop what still arrives, so the
        client reads the response rather than a reset; closed for good after ``_LINGER``
        seconds or when the client closes."""
        transport = self.transport
        if transport is None or transport.is_closing() or self._discard:
            return
        self._discard = True
        self._paused.clear()
        transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
            self._loop.call_later(_LINGER, transport.close)
        else:
            transport.close()

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close_idle(self) -> None:
        """Server shutdown: close now unless a request is being answered."""
        if self._task is None and self.transport is not None:
            self.transport.close()

    @property
    def evictable(self) -> bool:
        """Whether a new connection may take this one's place: it never sent the token and
        no request of it is being answered."""
        return not self.trusted and self._task is None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a selector callback may run again before it is removed
        future.set_result(None)


@contextlib.asynccontextmanager
async def serve(
    app: App,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    what: str = "the API",
    on_exit: Callable[[], None] | None = None,
    grace: float = 5.0,
    config: HTTPConfig | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` for the duration of the block; yields the base URL (``port=0`` picks a
    free port).  A non-loopback ``host`` needs ``app.token`` (``ConfigError`` naming
    ``what`` otherwise).  ``config``: time limits and connection caps (the caps lowered to
    what RLIMIT_NOFILE allows).  On exit: ``on_exit`` runs (e.g. to end long-polls), the
    listener closes, requests being answered get up to ``grace`` seconds, then every
    connection is closed, also when the block is cancelled."""
    if app.token is None and app.authorize is None and not is_loopback(host):
        raise ConfigError(f"serving {what} on {host!r} needs a token (or bind 127.0.0.1)")
    state = _Server(app, _fit_nofile(config or HTTPConfig(), what))
    sock = socket.create_server((host, port))
    # small replies must not wait for the client's delayed ACK (accepted sockets inherit it)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sndbuf = _bulk_sndbuf()
    if sndbuf is not None:  # accepted connections inherit it too
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(state), sock=sock)
    try:
        bound = sock.getsockname()[1]
        url_host = f"[{host}]" if ":" in host else host
        yield f"http://{url_host}:{bound}"
    finally:
        state.closing = True
        if on_exit is not None:
            on_exit()
        server.close()
        for conn in list(state.connections):
            conn.close_idle()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                while state.active:
                    state.idle.clear()
                    await state.idle.wait()
        for conn in list(state.connections):
            if conn.transport is not None:
                conn.transport.abort()
            if conn._task is not None:
                conn._task.cancel()
        await server.wait_closed()
