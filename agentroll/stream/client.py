"""Trainer side of the trajectory stream: an async httpx client, plus the wire records.

Invariants: a consumer sees each trajectory id at most once -- ids already yielded by this
client are skipped when a lease expiry re-offers them, and with ``seen_path`` the
acknowledged ids survive a restart (an id is persisted only after the worker confirmed the
ack, so a crash in between re-delivers rather than loses); a re-offered trajectory that was
acknowledged already is acknowledged again, so it leaves the worker.  Every httpx error
becomes a ``StreamError`` (weights: ``WeightSyncError``) whose message says what to do.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import hashlib
import json
import logging
import os
import sys
import typing
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

import httpx
import msgspec
import numpy as np

from agentroll._fs import fsync_path
from agentroll.errors import ConfigError, StreamError
from agentroll.stream.auth import TOKEN_ENV, check_token, load_token
from agentroll.types import (
    TOKEN_ARRAY_DTYPES,
    Trajectory,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
    wire_dtype,
)

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.stream.client")

WireFormat = Literal["msgpack", "json"]
_ACKS_IN_FLIGHT = 4  # batches(auto_ack=True): acks sent and not yet answered, at most
#: batches(prefetch=True): lease requests in flight ahead of the consumer, each on its own
#: connection (the worker's send buffer holds about one lease: two keep the next ones
#: coming while a batch is decoded)
_LEASES_IN_FLIGHT = 2
_Reply = tuple[int, str, bytes | bytearray]  # an undecoded reply: status, content type, body
MSGPACK = "application/msgpack"
JSON = "application/json"


# -- wire records (shared with agentroll.stream.server) ------------------------------------


class LeaseRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/lease`` (query parameters of the same names override it)."""

    max: Annotated[int, msgspec.Meta(ge=1)] = 64
    wait: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    trainer_version: Annotated[int, msgspec.Meta(ge=0)] | None = None


class LeaseBatch(msgspec.Struct, kw_only=True):
    """A lease: ack its trajectories by id within ``ttl`` seconds (``expires_at``: the
    worker's wall clock) or they are offered again."""

    lease_id: str
    expires_at: float
    ttl: float
    trainer_version: int
    trajectories: list[Trajectory]


class AckRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/ack``."""

    ids: list[str]


class AckReply(msgspec.Struct, kw_only=True):
    """Reply of ``POST /v1/ack``: how many trajectories left the worker's spool."""

    acked: int


class _RawLeaseBatch(msgspec.Struct, kw_only=True):
    """A lease body whose trajectories are left undecoded (finding the ones that fail)."""

    lease_id: str
    expires_at: float
    ttl: float
    trainer_version: int
    trajectories: list[msgspec.Raw]


class _IdOnly(msgspec.Struct):
    id: str


class Undecodable(msgspec.Struct, frozen=True):
    """A leased trajectory this client could not decode: its id, why, and its bytes as
    they came (msgpack or JSON)."""

    id: str
    error: str
    data: bytes


OnUndecodable = Literal["raise", "skip"]


# -- persisted acknowledgements ------------------------------------------------------------


def _load_seen(path: Path) -> set[str]:
    """Ids in a seen file: one JSON list per line; a torn last line is dropped."""
    seen: set[str] = set()
    if not path.exists():
        return seen
    data = path.read_bytes()
    good = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            ids = json.loads(line)
        except ValueError:
            break
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            break  # damaged: what follows is dropped like a torn tail
        seen.update(ids)
        good += len(line)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return seen


def _append_seen(path: Path, ids: list[str]) -> None:
    with open(path, "ab") as f:
        f.write(json.dumps(ids).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


# -- bulk HTTP/1.1 transport ---------------------------------------------------------------

_HEAD_BYTES = 16 << 10  # initial receive buffer of a response head
_MAX_HEAD_BYTES = 1 << 20  # a response head (status line + headers) may not exceed this


def _write_dead_letters(directory: Path, bad: list[Undecodable], suffix: str) -> None:
    """Each of ``bad`` as ``<id><suffix>`` (its bytes as leased) and a line of
    ``errors.jsonl``, fsync'd before they are acknowledged."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for b in bad:
        # the id made a file name, and a hash of it: two ids never share a file
        safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in b.id)
        digest = hashlib.blake2b(b.id.encode(), digest_size=6).hexdigest()
        name = f"{safe[:150]}-{digest}{suffix}"
        with open(directory / name, "wb") as f:
            f.write(b.data)
            os.fsync(f.fileno())
        lines.append(json.dumps({"id": b.id, "file": name, "error": b.error}) + "\n")
    with open(directory / "errors.jsonl", "a") as f:
        f.writelines(lines)
        os.fsync(f.fileno())
    fsync_path(directory)


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


# -- fast lease decoding -------------------------------------------------------------------


def _wire_types(data: type, skip: tuple[str, ...] = ()) -> tuple[type, type]:
    """Mirror structs of ``Trajectory`` and ``LeaseBatch`` whose per-token arrays decode as
    ``{dtype, data}`` with ``data`` of type ``data`` (derived from the fields of
    ``Trajectory``, so they cannot drift from it).  Fields in ``skip`` are left out: msgspec
    steps over them in the body without building their objects."""
    tag = f"{data.__name__}{'_' if skip else ''}{'_'.join(skip)}"
    array = msgspec.defstruct(f"_WireArray_{tag}", [("dtype", str), ("data", data)], gc=False)
    hints = typing.get_type_hints(Trajectory)
    fields: list[Any] = []
    for f in msgspec.structs.fields(Trajectory):
        if f.name in skip:
            continue
        typ = array if f.name in TOKEN_ARRAY_DTYPES else hints[f.name]
        if f.required:
            fields.append((f.name, typ))
        elif f.name in TOKEN_ARRAY_DTYPES:
            fields.append((f.name, typ | None, None))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, typ, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, typ, f.default))
    traj = msgspec.defstruct(f"_WireTrajectory_{tag}", fields, kw_only=True, gc=False)
    batch = msgspec.defstruct(
        f"_WireLeaseBatch_{tag}",
        [
            (f.name, list[traj] if f.name == "trajectories" else f.type)  # type: ignore[valid-type]
            for f in msgspec.structs.fields(LeaseBatch)
        ],
        kw_only=True,
    )
    return traj, batch


#: the fields ``conversation=False`` leaves out: a trajectory's turns and messages are about
#: 85 of the ~110 Python objects a decoded trajectory is made of (its token arrays are 15)
CONVERSATION_FIELDS = ("turns", "messages")
_SKIPPED: dict[bool, tuple[str, ...]] = {True: (), False: CONVERSATION_FIELDS}
# msgpack: arrays are zero-copy views of the (writable) response buffer; JSON: base64 is
# decoded straight into one bytearray per array.  Indexed by ``conversation``.
_MSGPACK_WIRE = {c: _wire_types(memoryview, skip) for c, skip in _SKIPPED.items()}
_JSON_WIRE = {c: _wire_types(bytearray, skip) for c, skip in _SKIPPED.items()}
_MSGPACK_LEASE: dict[bool, msgspec.msgpack.Decoder[Any]] = {
    c: msgspec.msgpack.Decoder(types[1]) for c, types in _MSGPACK_WIRE.items()
}
_JSON_LEASE: dict[bool, msgspec.json.Decoder[Any]] = {
    c: msgspec.json.Decoder(types[1]) for c, types in _JSON_WIRE.items()
}
# one trajectory of a lease body, decoded as decode_lease does (split_lease, the slow path)
_MSGPACK_ITEM: dict[bool, msgspec.msgpack.Decoder[Any]] = {
    c: msgspec.msgpack.Decoder(types[0]) for c, types in _MSGPACK_WIRE.items()
}
_JSON_ITEM: dict[bool, msgspec.json.Decoder[Any]] = {
    c: msgspec.json.Decoder(types[0]) for c, types in _JSON_WIRE.items()
}
_DTYPES: dict[str, np.dtype[Any]] = {}
_ARRAY_FIELDS = tuple(TOKEN_ARRAY_DTYPES)


def _dtype(name: str) -> np.dtype[Any]:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = wire_dtype(name)
        if len(_DTYPES) < 64:
            _DTYPES[name] = dtype
    return dtype


def _trajectories(wires: list[Any]) -> list[Trajectory]:
    """The ``Trajectory`` of each decoded wire trajectory (its arrays: views of their data)."""
    asdict, frombuffer, dtypes = msgspec.structs.asdict, np.frombuffer, _DTYPES
    out = []
    for w in wires:
        fields = asdict(w)
        for name in _ARRAY_FIELDS:
            arr = fields[name]
            if arr is None:
                del fields[name]
            else:
                fields[name] = frombuffer(arr.data, dtypes.get(arr.dtype) or _dtype(arr.dtype))
        out.append(Trajectory(**fields))
    return out


def decode_lease(
    data: bytes | bytearray, *, json: bool = False, conversation: bool = True
) -> LeaseBatch:
    """Decode a ``LeaseBatch`` body (msgpack, or JSON with ``json``) like
    ``decode_msgpack(data, LeaseBatch)`` but ~3x faster: per-token arrays are not copied out
    of ``data``.  With msgpack they are writable views of one bytearray holding the body
    (``data`` itself if it is a bytearray, else a copy of it), kept alive by the arrays: the
    batch's memory is freed when its last array is (``arr.copy()`` to detach one).  With
    JSON each array owns the bytearray its base64 decodes into.  ``conversation=False``
    leaves each trajectory's ``turns`` and ``messages`` empty: they are stepped over in the
    body (still checked to be well-formed msgpack or JSON), never built.  Raises
    ``msgspec.ValidationError`` or ``ValueError`` on a malformed body."""
    # everything decoded here stays alive: the cyclic GC, which would run several full
    # passes over the batch's objects while they are built, waits until the end
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        if json:
            wire = _JSON_LEASE[conversation].decode(data)
        else:
            buffer = data if isinstance(data, bytearray) else bytearray(data)
            wire = _MSGPACK_LEASE[conversation].decode(buffer)
        wire.trajectories = _trajectories(wire.trajectories)
        return LeaseBatch(**msgspec.structs.asdict(wire))
    finally:
        if gc_enabled:
            gc.enable()


def split_lease(
    data: bytes | bytearray, *, json: bool = False, conversation: bool = True
) -> tuple[LeaseBatch, list[Undecodable]]:
    """A lease body that ``decode_lease`` refused, one trajectory at a time: the batch of
    those that decode and the ones that do not (a field of another type, another version's
    record).  Raises ``ValueError`` when the body is not a lease at all, or a trajectory's id
    cannot be read (it could not be acknowledged)."""
    mod: Any = msgspec.json if json else msgspec.msgpack
    try:
        raw = mod.decode(data, type=_RawLeaseBatch)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"not a lease body: {exc}") from exc
    item_decoder = (_JSON_ITEM if json else _MSGPACK_ITEM)[conversation]
    good: list[Trajectory] = []
    bad: list[Undecodable] = []
    for item in raw.trajectories:
        blob = bytes(item)
        try:
            # as decode_lease decodes it (a conversation-less consumer steps over the turns
            # and messages); msgpack arrays: views of a writable copy of the record
            good += _trajectories([item_decoder.decode(blob if json else bytearray(blob))])
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            try:
                tid = mod.decode(blob, type=_IdOnly).id
            except msgspec.MsgspecError:
                raise ValueError(f"a leased trajectory without a readable id: {exc}") from exc
            bad.append(Undecodable(tid, str(exc), blob))
    fields = msgspec.structs.asdict(raw)
    fields["trajectories"] = good
    return LeaseBatch(**fields), bad


async def _first_reply(leasing: collections.deque[asyncio.Future[_Reply]]) -> _Reply:
    """Take the oldest lease request in ``leasing`` that has finished, waiting for one to
    finish.  Requests go out on separate connections and may reach the worker out of order;
    one that found the buffer empty (a younger one took what was there) long-polls, and
    must not hold back the younger reply that has trajectories.  Raises the request's
    ``StreamError``."""
    if not any(f.done() for f in leasing):
        await asyncio.wait(leasing, return_when=asyncio.FIRST_COMPLETED)
    done = next(f for f in leasing if f.done())
    leasing.remove(done)
    return done.result()


class StreamClient:
    """Consume a worker's trajectory stream at ``url`` (e.g. ``http://127.0.0.1:8600``).

    ``token``: the worker's bearer token; None takes ``load_token(run_dir, env=token_env)``
    (``$AGENTROLL_STREAM_TOKEN``, else the worker's ``<run_dir>/stream.token``), and
    ``ConfigError`` says where to find one when neither has it: every worker requires one.
    ``format``: body encoding of requests and replies (msgpack is ~3x denser than JSON's
    base64 arrays).  ``seen_path``: a file of acknowledged ids that makes the dedupe survive
    a restart of the consumer (it grows by ~40 bytes per trajectory).  ``timeout``: seconds
    per request on top of a lease's ``wait``.  ``conversation=False``: leased trajectories
    come without their ``turns`` and ``messages`` (empty lists), for a trainer that uses
    only their token arrays, reward and ids; they are stepped over in the body, never built
    into objects, which saves about a third of a consumer's CPU (``agentroll bench
    stream``).  Use as ``async with StreamClient(...)``.  Leased trajectories come from
    ``decode_lease``: with msgpack their arrays are writable views of their batch's receive
    buffer (freed with the batch's last array).  A leased trajectory that does not decode
    (another version's record, a field of another type) raises ``StreamError`` naming it
    (``on_undecodable="raise"``), or, with ``"skip"``, is written to ``dead_letter_dir``
    (``<id>.msgpack`` or ``.json``, and a line in ``errors.jsonl``), acknowledged, counted
    in ``undecodable`` and logged; the rest of its batch is delivered either way."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        run_dir: str | Path | None = None,
        token_env: str = TOKEN_ENV,
        format: WireFormat = "msgpack",
        seen_path: str | Path | None = None,
        timeout: float = 30.0,
        conversation: bool = True,
        on_undecodable: OnUndecodable = "raise",
        dead_letter_dir: str | Path | None = None,
    ) -> None:
        if on_undecodable not in ("raise", "skip"):
            raise ConfigError(
                f"StreamClient on_undecodable={on_undecodable!r}; use 'raise' or 'skip'"
            )
        if format not in ("msgpack", "json"):
            raise ConfigError(f"StreamClient format={format!r}; use 'msgpack' or 'json'")
        if timeout <= 0:
            raise ConfigError(f"StreamClient timeout={timeout}; use a positive number of seconds")
        if token is None:
            token = load_token(run_dir, env=token_env)
        self.url = url.rstrip("/")
        self.token = check_token(token, "StreamClient token")
        self.format: WireFormat = format
        self.timeout = timeout
        self.conversation = conversation
        self.on_undecodable: OnUndecodable = on_undecodable
        self.dead_letter_dir = Path(dead_letter_dir) if dead_letter_dir is not None else None
        self.undecodable = 0  # leased trajectories set aside (on_undecodable="skip")
        self.seen_path = Path(seen_path) if seen_path is not None else None
        self._mime = MSGPACK if format == "msgpack" else JSON
        headers = {"accept": self._mime, "content-type": self._mime}
        headers["authorization"] = f"Bearer {self.token}"
        self._headers = headers
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            # plain http (what serve_stream speaks): FastTransport; https (a TLS proxy in
            # front of the worker): httpx's default transport
            transport=FastTransport() if self.url.startswith("http://") else None,
        )
        self._weights_client: httpx.AsyncClient | None = None  # streamed uploads: httpcore
        # handed to the consumer by this process and not acknowledged yet (in-flight ids only)
        self._yielded: set[str] = set()
        # acknowledged (by this process or a persisted one): grows with the run, about 100
        # bytes an id (a set of str), and ``seen_path`` about 35 bytes an id on disk
        self._acked: set[str] = set()
        if self.seen_path is not None:
            self._acked = _load_seen(self.seen_path)
        self.skipped = 0  # re-offered trajectories not yielded again

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()
        if self._weights_client is not None:
            await self._weights_client.aclose()

    def _encode(self, obj: Any) -> bytes:
        return encode_msgpack(obj) if self.format == "msgpack" else encode_json(obj)

    def _decode(self, ctype: str, data: bytes | bytearray, typ: Any) -> Any:
        try:
            if typ is LeaseBatch:
                return decode_lease(
                    data, json=ctype.startswith(JSON), conversation=self.conversation
                )
            if ctype.startswith(JSON):
                return decode_json(bytes(data), typ)
            return decode_msgpack(bytes(data), typ)
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            raise StreamError(
                f"unexpected reply from {self.url} ({ctype or 'no content type'}): {exc}; "
                "is the URL an agentroll worker of the same version?"
            ) from exc

    async def _request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        extra_timeout: float = 0.0,
        headers: dict[str, str] | None = None,
    ) -> _Reply:
        """One request: ``(status, content type, body)``; the body as the transport received
        it (one bytearray from ``FastTransport``: not copied again).  Raises ``StreamError``
        for a transport failure or a 4xx/5xx reply."""
        timeout = httpx.Timeout(self.timeout + extra_timeout, connect=10.0)
        request = self._client.build_request(
            method, path, content=body or None, timeout=timeout, headers=headers
        )
        try:
            response = await self._client.send(request, stream=True)
            try:
                parts = [part async for part in response.aiter_bytes()]
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise StreamError(
                f"request {path} to the worker at {self.url} failed: {exc!r}; check that the "
                "worker is running and reachable (it retries safely: leases expire, acks repeat)"
            ) from exc
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self._check(path, response.status_code, data)
        return response.status_code, response.headers.get("content-type", ""), data

    def _check(self, path: str, status: int, data: bytes | bytearray) -> None:
        if status < 400:
            return
        if status == 401:
            raise StreamError(
                f"the worker at {self.url} refused {path}: wrong token; pass the worker's "
                "token as StreamClient(token=...), or its run directory as run_dir=... (the "
                "worker writes it to <run_dir>/stream.token)"
            )
        text = bytes(data[:4096]).decode("utf-8", "replace").strip()
        raise StreamError(f"the worker at {self.url} refused {path}: HTTP {status}: {text}")

    async def lease(
        self, max: int = 64, wait: float = 0.0, *, trainer_version: int | None = None
    ) -> LeaseBatch | None:
        """Lease up to ``max`` trajectories (whole groups; at least one group), waiting up to
        ``wait`` seconds for one; None if none came.  No dedupe here (see ``batches``).
        Raises ``StreamError``."""
        batch, bad = self._decode_lease(await self._lease_reply(max, wait, trainer_version))
        if bad:
            await self._set_aside(bad)
        return batch

    async def _lease_reply(self, max: int, wait: float, trainer_version: int | None) -> _Reply:
        """The undecoded reply of one lease request: ``(status, content type, body)``."""
        request = LeaseRequest(max=max, wait=wait, trainer_version=trainer_version)
        return await self._request("POST", "/v1/lease", self._encode(request), extra_timeout=wait)

    def _decode_lease(self, reply: _Reply) -> tuple[LeaseBatch | None, list[Undecodable]]:
        """The batch of a lease reply (None for 204) and the trajectories in it this client
        cannot decode (see ``split_lease``: the slow path, taken only when the whole body
        was refused)."""
        status, ctype, data = reply
        if status == 204:
            return None, []
        json = ctype.startswith(JSON)
        try:
            return decode_lease(data, json=json, conversation=self.conversation), []
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            try:
                return split_lease(data, json=json, conversation=self.conversation)
            except ValueError:
                raise StreamError(
                    f"unexpected reply from {self.url} ({ctype or 'no content type'}): {exc}; "
                    "is the URL an agentroll worker of the same version?"
                ) from exc

    async def _set_aside(self, bad: list[Undecodable]) -> None:
        """Leased trajectories that do not decode: a ``StreamError`` (``on_undecodable=
        "raise"``: they are offered again after the lease's ttl, and again refused), or
        written to ``dead_letter_dir`` (durably), acknowledged and counted in
        ``undecodable`` (``"skip"``)."""
        first = bad[0]
        what = f"{len(bad)} leased trajectories ({first.id!r}: {first.error})"
        if self.on_undecodable == "raise":
            raise StreamError(
                f"the worker at {self.url} sent {what} that this client cannot decode; the "
                "worker offers them again after the lease's ttl.  Fix what produced them (an "
                "older or newer agentroll, a field of another type), or pass "
                "StreamClient(on_undecodable='skip', dead_letter_dir=...) to keep their bytes "
                "aside and acknowledge them"
            )
        if self.dead_letter_dir is not None:
            suffix = ".msgpack" if self.format == "msgpack" else ".json"
            await asyncio.to_thread(_write_dead_letters, self.dead_letter_dir, bad, suffix)
        logger.warning(
            "set aside %s%s", what, f" in {self.dead_letter_dir}" if self.dead_letter_dir else ""
        )
        await self.ack([b.id for b in bad])
        self.undecodable += len(bad)

    async def ack(self, ids: Iterable[str]) -> int:
        """Acknowledge trajectories by id: they leave the worker for good.  Returns how many
        left its spool (0 for ids acknowledged before).  Persists the ids to ``seen_path``
        after the worker confirmed.  Raises ``StreamError``; retrying is safe."""
        ids = list(ids)
        if not ids:
            return 0
        _, ctype, data = await self._request("POST", "/v1/ack", self._encode(AckRequest(ids=ids)))
        reply: AckReply = self._decode(ctype, data, AckReply)
        fresh = [i for i in ids if i not in self._acked]
        self._acked.update(ids)
        self._yielded.difference_update(ids)  # ``_fresh`` checks ``_acked`` first
        if self.seen_path is not None and fresh:
            await asyncio.to_thread(_append_seen, self.seen_path, fresh)
        return reply.acked

    async def _fresh(self, batch: LeaseBatch) -> list[Trajectory]:
        """The trajectories of ``batch`` never handed out by this client (now marked as
        handed out); ones acknowledged before a restart are acknowledged again."""
        fresh: list[Trajectory] = []
        again: list[str] = []
        for traj in batch.trajectories:
            if traj.id in self._acked:
                again.append(traj.id)  # acknowledged before a restart of either side
            elif traj.id not in self._yielded:
                fresh.append(traj)
        self.skipped += len(batch.trajectories) - len(fresh)
        if again:
            await self.ack(again)
        self._yielded.update(t.id for t in fresh)
        return fresh

    async def take(
        self, n: int, wait: float = 5.0, *, trainer_version: int | None = None
    ) -> list[Trajectory]:
        """Exactly ``n`` trajectories never handed out before (deduped as ``batches`` does),
        leasing as often as needed; whole groups when ``n`` is a multiple of the group size.
        For a trainer that steps on fixed-size batches.  Raises ``StreamError``."""
        out: list[Trajectory] = []
        while len(out) < n:
            batch = await self.lease(n - len(out), wait, trainer_version=trainer_version)
            if batch is not None:
                out.extend(await self._fresh(batch))
        return out

    async def batches(
        self,
        max: int = 64,
        wait: float = 5.0,
        *,
        auto_ack: bool = False,
        trainer_version: int | None = None,
        prefetch: bool = True,
    ) -> AsyncGenerator[list[Trajectory], None]:
        """Lease batches forever (break out of the loop to stop) and yield each as a list of
        trajectories never yielded before (a batch of only re-offered ones is not yielded).
        With ``auto_ack`` a batch is acknowledged when the consumer asks for the next one:
        the ack is sent then and completes while the next batches are leased and decoded (up
        to 4 acks in flight; a failed ack raises at a later step).  Acks in flight when the
        loop stops are completed when the generator is closed: use
        ``async with contextlib.aclosing(client.batches(...)) as batches`` to have it done
        when the block ends rather than at garbage collection.  The batch yielded last is
        not acknowledged when the loop stops (a break and an exception look the same to the
        generator, and the consumer may not have finished it): ``ack`` its ids once it is
        done with them; until then this client does not hand them out again, and the worker
        offers them again after their lease ttl.  Without ``auto_ack`` call ``ack``.  With
        ``prefetch`` the next two leases are requested while the consumer works on the
        current batch, and whichever reply comes first is used first (a request that found
        nothing long-polls without holding the others back; when the loop stops, leases in
        flight are cancelled; anything they had leased is offered again after its ttl).
        Raises ``StreamError``."""
        leasing: collections.deque[asyncio.Future[_Reply]]
        leasing = collections.deque()  # lease requests in flight, oldest first
        acking: collections.deque[asyncio.Future[int]] = collections.deque()
        try:
            while True:
                if not leasing:
                    leasing.append(
                        asyncio.ensure_future(self._lease_reply(max, wait, trainer_version))
                    )
                reply = await _first_reply(leasing)
                if prefetch and reply[0] != 204:
                    # the next requests go out before this reply is decoded: the worker
                    # prepares and sends the next batches (on their own connections) while
                    # this one is decoded and used
                    while len(leasing) < _LEASES_IN_FLIGHT:
                        leasing.append(
                            asyncio.ensure_future(self._lease_reply(max, wait, trainer_version))
                        )
                    await asyncio.sleep(0)  # let them send their requests first
                batch, bad = self._decode_lease(reply)
                if bad:
                    await self._set_aside(bad)
                if batch is None:
                    continue
                fresh = await self._fresh(batch)
                if not fresh:
                    continue
                yield fresh
                if auto_ack:
                    while acking and (acking[0].done() or len(acking) >= _ACKS_IN_FLIGHT):
                        await acking.popleft()  # raises the StreamError of a failed ack
                    acking.append(asyncio.ensure_future(self.ack([t.id for t in fresh])))
        finally:
            for pending in leasing:
                pending.cancel()
            if leasing:
                await asyncio.wait(leasing)
            for pending in leasing:
                if not pending.cancelled():
                    pending.exception()  # retrieved: a failed prefetch is not reported
            if acking:
                await asyncio.wait(acking)  # acks that were sent are completed, not dropped
                failed = [
                    exc for a in acking if not a.cancelled() and (exc := a.exception()) is not None
                ]
                if failed and sys.exc_info()[0] in (None, GeneratorExit):
                    raise failed[0]

    async def push_weights(self, update: WeightUpdate, *, chunk_bytes: int = 1 << 20) -> None:
        """Stream a full or delta ``WeightUpdate`` to the worker, which applies it before
        replying.  Raises ``WeightSyncError`` when it was refused or the upload failed
        (nothing was applied then)."""
        from agentroll.weights.http import HttpTransport

        if self._weights_client is None:  # streams the upload (FastTransport would buffer it)
            self._weights_client = httpx.AsyncClient(
                headers=self._headers, timeout=httpx.Timeout(self.timeout, connect=10.0)
            )
        transport = HttpTransport(
            f"{self.url}/v1/weights",
            token=self.token,
            chunk_bytes=chunk_bytes,
            client=self._weights_client,
        )
        await transport.send(update)

    async def status(self) -> dict[str, Any]:
        """The worker's ``/v1/status`` (buffer, spool, versions, uptime).  Raises
        ``StreamError``."""
        _, _, data = await self._request("GET", "/v1/status", headers={"accept": JSON})
        try:
            out: dict[str, Any] = json.loads(data)
        except ValueError as exc:
            raise StreamError(f"unexpected status reply from {self.url}: {exc}") from exc
        return out
