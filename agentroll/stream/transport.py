"""A bulk HTTP/1.1 transport for httpx: each response body lands in one buffer, no copies.

Invariants: one request at a time per pooled keep-alive connection; a body with a
Content-Length is received by ``recv_into`` straight into a buffer of that size; a request
is sent again only when a reused connection closed before a byte of its answer came; every
failure is one of httpx's exception types.
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import AsyncIterator, Callable

import httpx

_HEAD_BYTES = 16 << 10  # initial receive buffer of a response head
_MAX_HEAD_BYTES = 1 << 20  # a response head (status line + headers) may not exceed this


def _bytearray_api() -> Callable[[int], bytearray] | None:
    """CPython's ``PyByteArray_FromStringAndSize(NULL, n)``: a bytearray of ``n`` bytes that
    are not zeroed first (a lease body is about 9 MB, all of it written by ``recv_into``
    before anyone reads it); None where ctypes cannot reach the C API."""
    try:
        import ctypes

        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
    except (ImportError, AttributeError):
        return None
    make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    make.restype = ctypes.py_object
    return lambda n: make(None, n)


_MAKE_BYTEARRAY = _bytearray_api()


def _uninitialized_bytearray(n: int) -> bytearray:
    """A bytearray of ``n`` bytes whose contents are undefined until written."""
    return _MAKE_BYTEARRAY(n) if _MAKE_BYTEARRAY is not None and n > 65536 else bytearray(n)


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 connection, one request at a time.  The kernel copies a
    response body with a Content-Length straight into one buffer of that size (no per-chunk
    Python work); chunked bodies and bodies delimited by the connection's end are collected
    in the head buffer (the worker sends neither, but they are valid HTTP)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep_alive = True
        self.received = 0  # bytes ever received: read-timeout progress
        self._state = "idle"  # idle | head | body | chunked | eof | failed
        self._buf = bytearray(_HEAD_BYTES)
        self._len = 0  # bytes of _buf in use
        self._body = bytearray()
        self._pos = 0
        self._no_body = False
        self._scan = 0  # chunked: parse position in _buf
        self._chunks: list[bytes] = []
        self._status = 0
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._done: asyncio.Future[bytearray] | None = None

    # asyncio.BufferedProtocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == "body":
            return memoryview(self._body)[self._pos :]
        if self._len == len(self._buf):  # only here: no view of _buf is alive now
            self._buf.extend(bytes(len(self._buf)))
        return memoryview(self._buf)[self._len :]

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self._state == "body":
            self._pos += nbytes
            if self._pos == len(self._body):
                self._finish(self._body)
            return
        start = max(0, self._len - 3)
        self._len += nbytes
        if self._state == "head":
            self._parse_head(start)
        elif self._state == "chunked":
            self._parse_chunks()
        elif self._state in ("idle", "failed"):
            self._fail(httpx.RemoteProtocolError("the server sent data nobody asked for"))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._state == "eof":
            self._finish(bytearray(self._buf[: self._len]))
        elif self._done is not None and not self._done.done():
            self._fail(
                httpx.RemoteProtocolError(
                    "the server closed the connection before the response was complete"
                    + (f" ({exc})" if exc else "")
                )
            )

    # parsing -------------------------------------------------------------------------------

    def _parse_head(self, start: int) -> None:
        end = self._buf.find(b"\r\n\r\n", start, self._len)
        if end < 0:
            if self._len > _MAX_HEAD_BYTES:
                self._fail(httpx.RemoteProtocolError("response head exceeds 1 MiB"))
            return
        lines = bytes(self._buf[:end]).split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code, _, self._reason = rest.partition(b" ")
        if not version.startswith(b"HTTP/1.") or not code.isdigit() or int(code) < 200:
            self._fail(httpx.RemoteProtocolError(f"unsupported status line {lines[0]!r}"))
            return
        self._status = int(code)
        self._headers = []
        fields: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                self._fail(httpx.RemoteProtocolError(f"malformed response header {line!r}"))
                return
            self._headers.append((name, value.strip()))
            fields[name.lower()] = value.strip().lower()
        self.keep_alive = version == b"HTTP/1.1" and fields.get(b"connection") != b"close"
        first = end + 4
        extra = self._len - first
        length = fields.get(b"content-length")
        if self._no_body or self._status in (204, 304):
            if extra:
                self._fail(httpx.RemoteProtocolError("data after a response without a body"))
            else:
                self._finish(bytearray())
        elif b"transfer-encoding" in fields:
            if fields[b"transfer-encoding"] != b"chunked":
                self._fail(httpx.RemoteProtocolError("unsupported transfer-encoding"))
                return
            self._shift(first)
            self._state, self._scan, self._chunks = "chunked", 0, []
            self._parse_chunks()
        elif length is not None:
            if not length.isdigit() or extra > int(length):
                self._fail(httpx.RemoteProtocolError(f"bad content-length {length!r}"))
                return
            self._body = _uninitialized_bytearray(int(length))
            self._body[:extra] = self._buf[first : self._len]
            self._pos, self._len = extra, 0
            if self._pos == len(self._body):
                self._finish(self._body)
            else:
                self._state = "body"
        else:  # delimited by the end of the connection
            self.keep_alive = False
            self._shift(first)
            self._state = "eof"

    def _shift(self, first: int) -> None:
        """Move ``_buf[first:_len]`` to the front (same size: _buf may be exported now)."""
        rest = self._buf[first : self._len]
        self._buf[: len(rest)] = rest
        self._len = len(rest)

    def _parse_chunks(self) -> None:
        buf = self._buf
        while True:
            line_end = buf.find(b"\r\n", self._scan, self._len)
            if line_end < 0:
                return
            try:
                size = int(bytes(buf[self._scan : line_end]).split(b";")[0].strip(), 16)
            except ValueError:
                self._fail(httpx.RemoteProtocolError("malformed chunk size"))
                return
            data = line_end + 2
            if size == 0:  # optional trailers, then an empty line
                if buf[data : data + 2] == b"\r\n":
                    end = data + 2
                else:
                    found = buf.find(b"\r\n\r\n", data, self._len)
                    if found < 0:
                        return
                    end = found + 4
                if end > self._len:
                    return
                if end != self._len:
                    self._fail(httpx.RemoteProtocolError("data after the last chunk"))
                else:
                    self._finish(bytearray(b"".join(self._chunks)))
                return
            if data + size + 2 > self._len:
                return
            if buf[data + size : data + size + 2] != b"\r\n":
                self._fail(httpx.RemoteProtocolError("malformed chunk"))
                return
            self._chunks.append(bytes(buf[data : data + size]))
            self._scan = data + size + 2

    def _finish(self, body: bytearray) -> None:
        self._state, self._len, self._body, self._chunks = "idle", 0, bytearray(), []
        done, self._done = self._done, None
        if done is not None and not done.done():
            done.set_result(body)
        if not self.keep_alive:
            self.close()

    def _fail(self, exc: Exception) -> None:
        self._state = "failed"
        self.keep_alive = False
        done, self._done = self._done, None
        if done is not None and not done.done():
            done.set_exception(exc)
        self.close()

    # use -----------------------------------------------------------------------------------

    def close(self) -> None:
        self.keep_alive = False
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    async def exchange(
        self, head: bytes, body: bytes, *, no_body: bool, read_timeout: float | None
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytearray]:
        """Send one request and wait for its complete response: ``(status, reason,
        headers, body)``.  Raises ``httpx.ReadTimeout`` when no byte came for
        ``read_timeout`` seconds and ``httpx.RemoteProtocolError`` on a broken response;
        on any error (cancellation included) the connection is closed."""
        assert self.transport is not None
        done = self._done = asyncio.get_running_loop().create_future()
        self._state, self._len, self._no_body = "head", 0, no_body
        try:
            self.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                self.transport.write(body)
            while not done.done():
                seen = self.received
                await asyncio.wait({done}, timeout=read_timeout)
                if not done.done() and self.received == seen:
                    raise httpx.ReadTimeout(f"no response byte for {read_timeout} s")
            data = done.result()
        except BaseException:
            self._done = None
            done.cancel()  # no-op when it failed: nobody else will read it
            self.close()
            raise
        return self._status, self._reason, self._headers, data


class _Body(httpx.AsyncByteStream):
    """A response body that was received in full."""

    def __init__(self, data: bytearray) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        data, self.data = self.data, bytearray()
        if data:
            # a bytearray: httpx hands chunks through untouched, and decode_lease makes its
            # arrays writable views of it.  Not kept here: httpx's response and its stream
            # refer to each other, so whatever they hold lives until the cyclic GC runs; the
            # body is freed with the last array of its batch instead
            yield typing.cast(bytes, data)


class FastTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport for plain ``http://`` that receives each response body with
    one ``recv_into`` per arrival straight into its final buffer (httpcore's 64 KiB reads
    through h11 cost more CPU than the worker takes to send the bytes).  Request bodies are
    read into memory first (fine for lease/ack/status; weights go through the default
    transport).  Keep-alive connections are pooled per host; a request on a reused one that
    the server closed before answering a byte is sent again on a new one (what browsers do;
    the worker's requests are safe to repeat); errors are httpx's own exception types."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._busy: set[_Connection] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"FastTransport speaks plain http://, not {url.scheme}://", request=request
            )
        body = await request.aread()
        timeouts = request.extensions.get("timeout", {})
        lines = [b"%s %s HTTP/1.1" % (request.method.encode(), url.raw_path)]
        lines += [
            b"%s: %s" % (k, v)
            for k, v in request.headers.raw
            if k.lower() not in (b"content-length", b"transfer-encoding")
        ]
        if body or request.method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines.append(b"Content-Length: %d" % len(body))
        head = b"\r\n".join(lines) + b"\r\n\r\n"
        key = (url.host, url.port or 80)
        while True:
            conn, reused = await self._connect(key, timeouts.get("connect"), request)
            self._busy.add(conn)
            before = conn.received
            try:
                status, reason, headers, data = await conn.exchange(
                    head, body, no_body=request.method == "HEAD", read_timeout=timeouts.get("read")
                )
                break
            except httpx.RemoteProtocolError as exc:
                if reused and conn.received == before:
                    continue  # the server closed the idle connection as we reused it: retry
                exc.request = request
                raise
            except httpx.TransportError as exc:
                exc.request = request
                raise
            finally:
                self._busy.discard(conn)
        if conn.keep_alive and not conn.closed:
            self._idle.setdefault(key, []).append(conn)
        return httpx.Response(
            status,
            headers=headers,
            stream=_Body(data),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason},
        )

    async def _connect(
        self, key: tuple[str, int], timeout: float | None, request: httpx.Request
    ) -> tuple[_Connection, bool]:
        """An idle keep-alive connection (``reused``) or a new one: ``(conn, reused)``."""
        idle = self._idle.get(key, [])
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(_Connection, key[0], key[1])
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(
                f"no connection to {key[0]}:{key[1]} within {timeout} s", request=request
            ) from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        return conn, False

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        for conn in self._busy:
            conn.close()
        self._idle.clear()
        self._busy.clear()
