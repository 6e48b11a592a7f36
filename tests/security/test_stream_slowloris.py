"""Issue 30 item 7: connections that never finish a request cannot exhaust the worker.

A head with a Content-Length and no body gets 408 and the connection closes after
``body_timeout``; a head that never completes is closed after ``head_timeout``;
connections are capped per client address and in all, a new one taking the place of the
oldest idle one that never sent the token (so a trainer on the same address still gets
its lease while the cap is hit), else 503; the cap is kept below RLIMIT_NOFILE."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from agentroll.bench.stream import synthetic_trajectory
from agentroll.errors import ConfigError
from agentroll.rollout.buffer import BufferConfig
from agentroll.stream import StreamClient, StreamConfig, TrajectoryStream, serve_stream
from agentroll.stream.connections import nofile_plan
from agentroll.stream.http import HTTPConfig

TOKEN = "slowloris-token"
PARTIAL = b"POST /v1/ack HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"  # head never ends


def head(path: str = "/v1/ack", *, token: str | None = TOKEN, length: int = 100) -> bytes:
    auth = f"authorization: Bearer {token}\r\n" if token else ""
    return f"POST {path} HTTP/1.1\r\nhost: x\r\n{auth}content-length: {length}\r\n\r\n".encode()


@contextlib.asynccontextmanager
async def worker(path: Path, http: HTTPConfig) -> AsyncIterator[tuple[TrajectoryStream, str]]:
    cfg = StreamConfig(buffer=BufferConfig(capacity=64, max_staleness=None), http=http)
    async with TrajectoryStream(path, cfg) as stream, serve_stream(stream, token=TOKEN) as url:
        yield stream, url


async def opened(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> bytes:
    """What the server sent before it closed the connection (raises TimeoutError if it did
    not close within ``within`` seconds)."""
    got = b""
    async with asyncio.timeout(within):
        try:
            while chunk := await reader.read(4096):
                got += chunk
        except ConnectionResetError:
            pass
    return got


async def test_a_head_without_its_body_gets_408_and_is_closed(tmp_path: Path) -> None:
    """Before, the handler waited for the body forever and the connection stayed open:
    19,985 of them exhausted the worker's descriptors."""
    http = HTTPConfig(body_timeout=0.3)
    async with worker(tmp_path / "spool", http) as (_, url):
        conns = [await opened(url) for _ in range(3)]
        for _, writer in conns:
            writer.write(head())
        for reader, writer in conns:
            reply = await closed_by_server(reader, 5)
            assert reply.startswith(b"HTTP/1.1 408") and b"HTTPConfig.body_timeout" in reply
            writer.close()
        # without the token the head is answered 401 at once, its body never awaited
        reader, writer = await opened(url)
        writer.write(head(token=None))
        assert (await closed_by_server(reader, 5)).startswith(b"HTTP/1.1 401")
        writer.close()


async def test_a_head_that_never_completes_is_closed(tmp_path: Path) -> None:
    async with worker(tmp_path / "spool", HTTPConfig(head_timeout=0.3)) as (_, url):
        silent = await opened(url)  # sends nothing at all
        partial = await opened(url)
        partial[1].write(PARTIAL)
        assert await closed_by_server(silent[0], 5) == b""
        assert await closed_by_server(partial[0], 5) == b""
        silent[1].close()
        partial[1].close()


async def test_one_client_over_the_cap_cannot_lock_out_a_trainer(tmp_path: Path) -> None:
    """20 connections holding half-sent heads from one address (the trainer's own, as for a
    sandbox sharing the host's network): the server holds at most the cap of them, and a
    lease from that address still succeeds."""
    http = HTTPConfig(max_connections_per_client=4, max_connections=8, head_timeout=60)
    async with worker(tmp_path / "spool", http) as (stream, url):
        t = synthetic_trajectory(0, 32, turns=2, prefix="t")
        t.policy_version = np.zeros_like(t.policy_version)
        await stream.publish([t])
        attackers = [await opened(url) for _ in range(20)]
        for _, writer in attackers:
            writer.write(PARTIAL)
        closed = 0
        for reader, _ in attackers[:16]:  # the oldest ones made room for the newer ones
            await closed_by_server(reader, 5)
            closed += 1
        assert closed == 16
        async with StreamClient(url, token=TOKEN) as client:
            batch = await client.lease(max=1)
            assert batch is not None and batch.trajectories[0].id == t.id
            await client.ack([t.id])
        for _, writer in attackers:
            writer.close()


async def test_over_the_cap_with_nothing_to_evict_is_503(tmp_path: Path) -> None:
    """Connections that sent the token are never evicted, idle or not: a new one over the
    cap is refused at once with 503 and closed."""
    http = HTTPConfig(max_connections_per_client=2, max_connections=2)
    async with worker(tmp_path / "spool", http) as (_, url):
        trainers = [await opened(url) for _ in range(2)]
        for reader, writer in trainers:  # one answered request each: they hold the token
            writer.write(
                f"GET /v1/status HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n\r\n".encode()
            )
            reply = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert reply.startswith(b"HTTP/1.1 200")
        reader, writer = await opened(url)
        reply = await closed_by_server(reader, 5)
        writer.close()
        assert reply.startswith(b"HTTP/1.1 503") and b"max_connections_per_client=2" in reply
        for _, writer in trainers:
            writer.close()


def test_the_cap_stays_below_the_descriptor_limit() -> None:
    inf = resource.RLIM_INFINITY
    assert nofile_plan(512, 1024, 1 << 20) == (2048, 512)  # the soft limit is raised
    assert nofile_plan(512, 1024, inf) == (2048, 512)
    assert nofile_plan(512, 4096, 4096) == (4096, 512)  # enough already
    assert nofile_plan(512, inf, inf) == (inf, 512)
    assert nofile_plan(512, 1024, 1024) == (1024, 170)  # the cap is lowered instead
    with pytest.raises(ConfigError, match="ulimit -n"):
        nofile_plan(512, 256, 256)


async def test_serve_lowers_the_cap_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import agentroll.stream.connections as connections

    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(connections.resource, "getrlimit", lambda _: (600, 600))
    monkeypatch.setattr(connections.resource, "setrlimit", lambda _, limits: set_to.append(limits))
    with caplog.at_level(logging.WARNING, "agentroll.stream.http"):
        fitted = connections._fit_nofile(HTTPConfig(), "trajectories")
    assert (fitted.max_connections, fitted.max_connections_per_client) == (29, 29)
    assert set_to == [] and "at most 29 connections" in caplog.text
