"""The stream's HTTP/1.1 server (agentroll.stream.http) over raw sockets: keep-alive,
pipelining, limits, bad HTTP, 100-continue, sendfile bodies, disconnects and shutdown."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from agentroll.errors import ConfigError
from agentroll.stream.connections import _bulk_sndbuf, sndbuf_choice
from agentroll.stream.http import (
    App,
    FileRange,
    HTTPConfig,
    HTTPError,
    Request,
    Response,
    serve,
)


class Conn:
    """A raw client connection: send bytes, read responses (head + content-length body)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        n = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(self.reader.readexactly(n), 10) if n else b""
        return status, headers, body

    async def at_eof(self) -> bool:
        return await asyncio.wait_for(self.reader.read(1), 10) == b""


@asynccontextmanager
async def server(app: App, **kw: object) -> AsyncIterator[tuple[str, int]]:
    async with serve(app, **kw) as url:  # type: ignore[arg-type]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield host, int(port)


@asynccontextmanager
async def connect(addr: tuple[str, int]) -> AsyncIterator[Conn]:
    reader, writer = await asyncio.open_connection(*addr)
    try:
        yield Conn(reader, writer)
    finally:
        writer.close()


def request(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\n{headers}"
    if body or method == "POST":
        head += f"content-length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


async def echo(req: Request) -> Response:
    body = await req.body(1000)
    return Response.text(200, f"{req.method} {req.path} {sorted(req.query.items())} {body!r}")


async def boom(req: Request) -> Response:
    raise RuntimeError("bug in a handler")


async def refuse(req: Request) -> Response:
    raise HTTPError(409, "refused: wrong base version")


APP = App(
    {"/echo": {"GET": echo, "POST": echo}, "/boom": {"GET": boom}, "/refuse": {"GET": refuse}}
)


async def test_keep_alive_pipelining_and_routing() -> None:
    async with server(APP) as addr, connect(addr) as c:
        # three pipelined requests in one write: answered in order on the same connection
        await c.send(
            request("GET", "/echo?a=1&b=x%20y")
            + request("POST", "/echo", b"hello")
            + request("GET", "/nope")
        )
        status, _, body = await c.response()
        assert (status, body) == (200, b"GET /echo [('a', '1'), ('b', 'x y')] b''")
        status, _, body = await c.response()
        assert (status, body) == (200, b"POST /echo [] b'hello'")
        status, _, body = await c.response()
        assert status == 404 and b"/nope" in body
        await c.send(request("POST", "/refuse"))
        status, headers, body = await c.response()
        assert status == 405 and headers["allow"] == "GET" and b"use GET" in body
        await c.send(request("GET", "/refuse"))
        assert (await c.response())[::2] == (409, b"refused: wrong base version")
        await c.send(request("GET", "/boom"))
        status, _, body = await c.response()
        assert status == 500 and b"see its log" in body
        await c.send(request("GET", "/echo", headers="connection: close\r\n"))
        status, headers, _ = await c.response()
        assert status == 200 and headers["connection"] == "close"
        assert await c.at_eof()


async def test_pipelined_responses_come_in_request_order() -> None:
    gate = asyncio.Event()

    async def slow(req: Request) -> Response:
        await gate.wait()
        return Response.text(200, "slow")

    async def fast(req: Request) -> Response:
        return Response.text(200, "fast")

    app = App({"/slow": {"GET": slow}, "/fast": {"GET": fast}})
    async with server(app) as addr, connect(addr) as c:
        await c.send(request("GET", "/slow") + request("GET", "/fast"))
        await asyncio.sleep(0.05)
        gate.set()
        assert (await c.response())[2] == b"slow"
        assert (await c.response())[2] == b"fast"


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"BLAH / HTTP/1.1\r\n\r\n", 400),
        (b"GET /" + b"x" * 9000 + b" HTTP/1.1\r\nhost: x\r\n\r\n", 414),
        (b"GET / HTTP/1.1\r\n" + b"x-a: " + b"y" * 70000 + b"\r\n\r\n", 431),
        (b"GET /echo HTTP/1.1\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n", None),
    ],
)
async def test_bad_http_gets_4xx_then_close_and_the_server_keeps_serving(
    data: bytes, status: int | None
) -> None:
    async with server(APP) as addr:
        async with connect(addr) as c:
            await c.send(data)
            got, headers, body = await c.response()
            if status is None:  # an upgrade request is served as plain HTTP/1.1, then closed
                assert got == 200 and headers["connection"] == "close"
            else:
                assert got == status and headers["connection"] == "close" and body
            assert await c.at_eof()
        async with connect(addr) as c:
            await c.send(request("GET", "/echo"))
            assert (await c.response())[0] == 200


async def test_body_limits_and_a_response_before_the_body_closes_the_connection() -> None:
    async with server(APP) as addr:
        async with connect(addr) as c:  # declared too large: refused before the body is read
            await c.send(request("POST", "/echo", b"z" * 200_000))
            status, headers, body = await c.response()
            assert status == 413 and b"1000-byte limit" in body
            assert headers["connection"] == "close"  # its body was not read: no reuse
            assert await c.at_eof()  # a clean close (FIN), not a reset, despite unread data
        async with connect(addr) as c:  # chunked, no length: refused once past the limit
            chunked = b"".join(b"%x\r\n%s\r\n" % (300, b"z" * 300) for _ in range(5)) + b"0\r\n\r\n"
            await c.send(
                b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + chunked
            )
            status, _, body = await c.response()
            assert status == 413 and b"exceeds the 1000-byte limit" in body
        async with connect(addr) as c:  # a malformed chunk: 400, not a hang
            await c.send(
                b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
            )
            status, _, body = await c.response()
            assert status == 400
            assert await c.at_eof()


async def test_expect_100_continue_is_answered_when_the_handler_reads_the_body() -> None:
    async with server(APP) as addr, connect(addr) as c:
        await c.send(
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nexpect: 100-continue\r\n\r\n"
        )
        line = await asyncio.wait_for(c.reader.readuntil(b"\r\n\r\n"), 10)
        assert line == b"HTTP/1.1 100 Continue\r\n\r\n"
        await c.send(b"abc")
        assert (await c.response())[2] == b"POST /echo [] b'abc'"


async def test_file_ranges_are_sent_exactly_and_their_descriptors_closed(tmp_path: Path) -> None:
    data = os.urandom(12 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    sent: list[Response] = []
    closed: list[bool] = []

    def closer(fd: int) -> Callable[[], None]:
        return lambda: closed.append(os.close(fd) is None)

    cuts = [(0, 5), (1 << 20, 5 << 20), (7 << 20, (12 << 20) - (7 << 20))]

    async def files(req: Request) -> Response:
        fd = os.open(path, os.O_RDONLY)
        parts: list[bytes | memoryview | FileRange] = [b"HEAD"]
        for offset, count in cuts:
            parts += [FileRange(fd, offset, count), b"|"]
        response = Response(200, parts, "application/octet-stream", on_close=closer(fd))
        sent.append(response)
        return response

    want = b"HEAD" + b"".join(data[o : o + n] + b"|" for o, n in cuts)
    async with server(App({"/f": {"GET": files}})) as addr, connect(addr) as c:
        await c.send(request("GET", "/f"))
        await asyncio.sleep(0.3)  # the reader lags: the socket fills up and sendfile waits
        status, headers, body = await c.response()
        assert status == 200 and int(headers["content-length"]) == len(want) and body == want
        await c.send(request("GET", "/f"))  # the connection is still in sync
        assert (await c.response())[2] == want
    assert len(sent) == 2 and closed == [True, True]


async def test_a_client_leaving_mid_response_or_mid_wait_is_noticed(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(32 << 20))
    left = asyncio.Event()
    responses: list[Response] = []
    fds: list[int] = []
    closed = asyncio.Event()

    async def wait(req: Request) -> Response:
        await req.disconnected()
        left.set()
        return Response.text(200, "nobody reads this")

    async def big(req: Request) -> Response:
        fd = os.open(path, os.O_RDONLY)
        responses.append(Response(200, [FileRange(fd, 0, 32 << 20)], on_close=closed.set))
        fds.append(fd)
        return responses[-1]

    app = App({"/wait": {"GET": wait}, "/big": {"GET": big}})
    async with server(app) as addr:
        async with connect(addr) as c:
            await c.send(request("GET", "/wait"))
            await asyncio.sleep(0.05)
        await asyncio.wait_for(left.wait(), 5)
        async with connect(addr) as c:
            await c.send(request("GET", "/big"))
            await c.reader.readuntil(b"\r\n\r\n")
            await c.reader.readexactly(1 << 20)
        await asyncio.wait_for(closed.wait(), 5)  # the send failed: on_close ran anyway
        os.close(fds[0])
        async with connect(addr) as c:
            await c.send(request("GET", "/echo?still=serving"))
            assert (await c.response())[0] == 404  # no /echo in this app: but answered


async def test_token_and_shutdown() -> None:
    with pytest.raises(ConfigError, match="needs a token"):
        async with serve(APP, host="0.0.0.0"):
            pass
    waiting = asyncio.Event()
    stop = asyncio.Event()

    async def poll(req: Request) -> Response:
        waiting.set()
        await stop.wait()
        return Response(204)

    app = App({"/poll": {"GET": poll}, "/echo": {"GET": echo}}, token="s3cret")
    auth = "authorization: Bearer s3cret\r\n"
    async with server(app, on_exit=stop.set) as addr:
        async with connect(addr) as c:
            await c.send(request("GET", "/echo"))
            status, headers, _ = await c.response()
            assert status == 401 and headers["www-authenticate"] == "Bearer"
            await c.send(request("GET", "/echo", headers="authorization: Bearer nope\r\n"))
            assert (await c.response())[0] == 401
            await c.send(request("GET", "/echo", headers=auth))
            assert (await c.response())[0] == 200
        idle_reader, idle_writer = await asyncio.open_connection(*addr)
        poller = Conn(*await asyncio.open_connection(*addr))
        await poller.send(request("GET", "/poll", headers=auth))
        await asyncio.wait_for(waiting.wait(), 5)
    # leaving the block: the long-poll was ended by on_exit and answered, idle ones closed
    status, headers, _ = await poller.response()
    assert status == 204 and headers["connection"] == "close"
    assert await poller.at_eof()
    assert await asyncio.wait_for(idle_reader.read(1), 5) == b""
    idle_writer.close()
    poller.writer.close()


async def test_httpx_round_trip() -> None:
    async with serve(APP) as url, httpx.AsyncClient(base_url=url) as client:
        r = await client.post("/echo?q=1", content=b"hi")
        assert r.status_code == 200 and r.text == "POST /echo [('q', '1')] b'hi'"
        r = await client.post("/echo", content=b"x" * 5000)
        assert r.status_code == 413
        r = await client.get("/echo")
        assert r.status_code == 200


async def test_idle_and_trickling_connections_are_closed() -> None:
    async with (
        server(APP, config=HTTPConfig(head_timeout=0.3, idle_timeout=0.3)) as addr,
        connect(addr) as idle,
        connect(addr) as trickle,
        connect(addr) as busy,
    ):
        await idle.send(request("GET", "/echo"))
        assert (await idle.response())[0] == 200
        await trickle.send(b"GET /echo HTTP/1.1\r\nhost")  # and never the rest
        for _ in range(6):  # a client that keeps asking is not cut off
            await asyncio.sleep(0.1)
            await busy.send(request("GET", "/echo"))
            assert (await busy.response())[0] == 200
        assert await idle.at_eof() and await trickle.at_eof()


async def test_memoryview_parts_count_bytes_not_items() -> None:
    import numpy as np

    words = np.arange(5, dtype=np.int32)

    async def view(req: Request) -> Response:
        return Response(200, [b"<", memoryview(words), b">"], "application/octet-stream")

    async with server(App({"/v": {"GET": view}})) as addr, connect(addr) as c:
        await c.send(request("GET", "/v"))
        status, headers, body = await c.response()
        assert (
            status == 200
            and headers["content-length"] == "22"
            and body == b"<" + words.tobytes() + b">"
        )


async def test_send_buffer_is_raised_only_where_that_beats_autotuning() -> None:
    assert sndbuf_choice(4 << 20, 4 << 20) == 4 << 20  # these machines: 8 MiB (doubled)
    assert sndbuf_choice(212992, 4 << 20) is None  # a stock kernel: autotuning reaches more
    seen: list[int] = []

    async def probe(req: Request) -> Response:
        sock = req._conn.transport.get_extra_info("socket")  # type: ignore[union-attr]
        seen.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
        return Response(204)

    async with server(App({"/p": {"GET": probe}})) as addr, connect(addr) as c:
        await c.send(request("GET", "/p"))
        assert (await c.response())[0] == 204
    want = _bulk_sndbuf()
    if want is not None:
        assert seen == [2 * want]  # inherited from the listening socket


async def test_a_big_upload_is_flow_controlled_and_arrives_whole() -> None:
    import hashlib

    data = os.urandom(24 << 20)
    paused: list[bool] = []

    async def upload(req: Request) -> Response:
        h, size = hashlib.sha256(), 0
        async for chunk in req.stream():
            h.update(chunk)
            size += len(chunk)
            transport = req._conn.transport
            assert transport is not None
            paused.append(not transport.is_reading())
            await asyncio.sleep(0.001)  # a slow consumer: the body queue fills up
        return Response.text(200, f"{size} {h.hexdigest()}")

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1 << 20):
            yield data[i : i + (1 << 20)]

    async with serve(App({"/up": {"POST": upload}})) as url, httpx.AsyncClient() as client:
        r = await client.post(f"{url}/up", content=chunks(), timeout=60)  # chunked
        assert r.text == f"{len(data)} {hashlib.sha256(data).hexdigest()}"
        r = await client.post(f"{url}/up", content=data, timeout=60)  # content-length
        assert r.text == f"{len(data)} {hashlib.sha256(data).hexdigest()}"
    assert any(paused)  # reading stopped while more than _BODY_QUEUE bytes waited
