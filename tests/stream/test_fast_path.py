"""The stream's fast path: ``decode_lease`` is bit-exact with the reference decoders and
yields writable, unaliased arrays; ``FastTransport`` speaks HTTP/1.1 correctly (Content-Length
bodies split across reads, chunked, close-delimited, no-body statuses, keep-alive reuse,
malformed replies and silence become httpx errors); the spool's split sync keeps fully
acknowledged segments until ``collect`` and loses nothing across a reopen."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentroll.bench.stream import synthetic_trajectory
from agentroll.stream.spool import Spool
from agentroll.stream.spool_config import SpoolConfig
from agentroll.stream.transport import FastTransport
from agentroll.stream.wire import LeaseBatch, decode_lease
from agentroll.types import (
    TOKEN_ARRAY_DTYPES,
    Trajectory,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
)


def batch(n: int = 3) -> LeaseBatch:
    return LeaseBatch(
        lease_id="L1",
        expires_at=123.5,
        ttl=60.0,
        trainer_version=4,
        trajectories=[synthetic_trajectory(i, 96, turns=3, group_size=1) for i in range(n)],
    )


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_decode_lease_is_bit_exact_with_writable_unaliased_arrays(fmt: str) -> None:
    original = batch()
    if fmt == "json":
        body = encode_json(original)
        got, ref = decode_lease(body, json=True), decode_json(body, LeaseBatch)
    else:
        body = encode_msgpack(original)
        got, ref = decode_lease(body), decode_msgpack(body, LeaseBatch)
    assert (got.lease_id, got.expires_at, got.ttl, got.trainer_version) == ("L1", 123.5, 60.0, 4)
    for a, b, o in zip(got.trajectories, ref.trajectories, original.trajectories, strict=True):
        assert isinstance(a, Trajectory)
        assert encode_msgpack(a) == encode_msgpack(b) == encode_msgpack(o)  # NaNs included
        for name, dtype in TOKEN_ARRAY_DTYPES.items():
            arr = getattr(a, name)
            assert arr.dtype == dtype and arr.flags.writeable
    first, second = got.trajectories[0], got.trajectories[1]
    before = second.token_ids.copy()
    first.token_ids[:] = -5  # a view of the batch buffer: writing it touches nobody else
    assert np.array_equal(second.token_ids, before)


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_decode_lease_without_conversation_keeps_everything_but_turns_and_messages(
    fmt: str,
) -> None:
    original = batch()
    assert all(t.turns and t.messages for t in original.trajectories)
    body = encode_json(original) if fmt == "json" else encode_msgpack(original)
    got = decode_lease(body, json=fmt == "json", conversation=False)
    assert (got.lease_id, got.expires_at, got.ttl, got.trainer_version) == ("L1", 123.5, 60.0, 4)
    for a, o in zip(got.trajectories, original.trajectories, strict=True):
        assert a.turns == [] and a.messages == []
        assert encode_msgpack(a) == encode_msgpack(
            msgspec.structs.replace(o, turns=[], messages=[])
        )  # every other field bit-exact, NaNs included
        for name, dtype in TOKEN_ARRAY_DTYPES.items():
            arr = getattr(a, name)
            assert arr.dtype == dtype and arr.flags.writeable
    first, second = got.trajectories[:2]
    first.turns.append(original.trajectories[0].turns[0])  # fresh lists, not one shared default
    assert second.turns == []


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_decode_lease_without_conversation_still_rejects_a_malformed_conversation(
    fmt: str,
) -> None:
    """Skipped fields are stepped over, not trusted: a body that ends inside a trajectory's
    messages, or whose skipped part is not msgpack (or JSON) at all, is an error."""
    is_json = fmt == "json"
    body = encode_json(batch(1)) if is_json else encode_msgpack(batch(1))
    cut = body.rindex(b"Fix the failing test")
    with pytest.raises(msgspec.DecodeError):
        decode_lease(body[:cut], json=is_json, conversation=False)
    marker = body.index(b"messages") + len(b"messages")
    if is_json:  # `"messages":[...` -> `"messages":[}...`: a bracket the parser must match
        at = body.index(b"[", marker) + 1
        broken = body[:at] + b"}" + body[at:]
    else:
        broken = body[:marker] + b"\xc1" + body[marker + 1 :]  # 0xc1: never used in msgpack
    with pytest.raises(msgspec.DecodeError):
        decode_lease(broken, json=is_json, conversation=False)
    decode_lease(body, json=is_json, conversation=False)  # the intact body decodes


def test_decode_lease_without_conversation_builds_nothing_of_it() -> None:
    """The skipped fields are not decoded into their types at all: a conversation of the
    wrong shape (well-formed msgpack) fails the full decoder and passes this one."""
    raw = msgspec.msgpack.decode(encode_msgpack(batch(2)))
    raw["trajectories"][1]["messages"] = [7, {"role": 3}]
    raw["trajectories"][1]["turns"] = "not a list"
    body = msgspec.msgpack.encode(raw)
    with pytest.raises(msgspec.ValidationError):
        decode_lease(body)
    got = decode_lease(body, conversation=False)
    assert [t.messages for t in got.trajectories] == [[], []]
    assert got.trajectories[1].id == batch(2).trajectories[1].id


def test_decode_lease_rejects_malformed_bodies() -> None:
    body = encode_msgpack(batch(1))
    with pytest.raises(msgspec.DecodeError):
        decode_lease(body[:-10])
    raw = msgspec.msgpack.decode(body)
    raw["trajectories"][0]["logprobs"]["dtype"] = "O"
    with pytest.raises(ValueError, match="dtype"):
        decode_lease(msgspec.msgpack.encode(raw))
    raw["trajectories"][0]["logprobs"]["dtype"] = "not-a-dtype"
    with pytest.raises(ValueError, match="dtype"):
        decode_lease(msgspec.msgpack.encode(raw))


# what numpy's dtype parser makes of names a peer may send: "," and ",4" raised SyntaxError
# (out of both decoders), "i4,i4" is a structured dtype, "(2,)i4" a sub-array
@pytest.mark.parametrize("name", [",", ",4", "i4,i4", "(2,)i4", "O", "U4", "M8", "V4", "c8"])
@pytest.mark.parametrize("conversation", [True, False])
def test_decode_lease_takes_only_plain_number_dtypes(name: str, conversation: bool) -> None:
    raw = msgspec.msgpack.decode(encode_msgpack(batch(1)))
    raw["trajectories"][0]["token_ids"]["dtype"] = name
    body = msgspec.msgpack.encode(raw)
    with pytest.raises(ValueError, match="dtype"):
        decode_lease(body, conversation=conversation)
    with pytest.raises(msgspec.ValidationError, match="dtype"):  # the spool's restore path
        decode_msgpack(msgspec.msgpack.encode(raw["trajectories"][0]), Trajectory)


# -- FastTransport against a scripted HTTP/1.1 server --------------------------------------

BIG = bytes(range(256)) * 1200  # 307200 bytes: received into a buffer that is not zeroed
REPLIES: dict[str, list[bytes]] = {
    "/big": [
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BIG) + BIG[:1000],
        BIG[1000:150_000],
        BIG[150_000:],
    ],
    # a head and a body arriving in several writes
    "/len": [b"HTTP/1.1 200 OK\r\nContent-Le", b"ngth: 11\r\nX-A: 1\r\n\r\nhel", b"lo world"],
    "/chunked": [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"5\r\nhello\r\n6;ext=1\r\n wor",
        b"ld\r\n0\r\nTrailer: x\r\n\r\n",
    ],
    "/nobody": [b"HTTP/1.1 204 No Content\r\n\r\n"],
    "/bad": [b"garbage\r\n\r\n"],
}


@asynccontextmanager
async def scripted_server() -> AsyncIterator[tuple[str, list[int]]]:
    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1].decode()
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if path == "/silent":
                    await asyncio.sleep(30)
                if path == "/hangup":  # a keep-alive reply, then the server goes away
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
                    break
                if path == "/close":
                    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
                    await writer.drain()
                    break
                for piece in REPLIES[path]:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()


async def test_fast_transport_speaks_http11() -> None:
    async with (
        scripted_server() as (url, connections),
        httpx.AsyncClient(base_url=url, transport=FastTransport(), timeout=5.0) as client,
    ):
        r = await client.post("/len", content=b"x" * 100)
        assert (r.status_code, r.content, r.headers["x-a"]) == (200, b"hello world", "1")
        r = await client.get("/len")
        assert r.content == b"hello world"
        assert connections[0] == 1  # kept alive and reused
        r = await client.get("/chunked")
        assert r.content == b"hello world"
        r = await client.get("/big")
        assert r.content == BIG
        r = await client.post("/nobody", content=b"{}")
        assert (r.status_code, r.content) == (204, b"")
        r = await client.get("/close")
        assert r.content == b"until the end"
        r = await client.get("/len")  # the closed connection is not reused
        assert r.content == b"hello world"
        for _ in range(3):  # an idle connection the server closed is not a failure
            assert (await client.get("/hangup")).content == b"ok"
        with pytest.raises(httpx.RemoteProtocolError, match="status line"):
            await client.get("/bad")
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/silent", timeout=httpx.Timeout(5.0, read=0.2))
        r = await client.get("/len")  # a failed connection is dropped, a fresh one works
        assert r.content == b"hello world"


async def test_fast_transport_reports_a_refused_connection() -> None:
    async with scripted_server() as (url, _):
        pass  # the port is closed now
    async with httpx.AsyncClient(transport=FastTransport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{url}/len")
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.get("https://127.0.0.1:1/")


# -- the spool's split sync ----------------------------------------------------------------


def test_acked_segments_stay_until_collect_and_nothing_is_lost(tmp_path: Path) -> None:
    trajs = [synthetic_trajectory(i, 64, turns=2) for i in range(6)]
    with Spool(tmp_path, SpoolConfig(segment_bytes=4096)) as spool:
        for t in trajs:
            spool.append(t)
        spool.sync_records()
        segments = len(list(tmp_path.glob("*.seg")))
        assert segments > 1  # small segments: the first ones roll over
        spool.ack([t.id for t in trajs[:3]], sync=False)
        spool.flush(collect=False)
        assert len(list(tmp_path.glob("*.seg"))) == segments  # durable, not yet deleted
        assert spool.collectable()
        spool.collect()
        assert len(list(tmp_path.glob("*.seg"))) < segments
        assert not spool.collectable()
        spool.ack([trajs[3].id], sync=False)
        spool.sync_acks(collect=False)
    with Spool(tmp_path) as spool:
        assert [r.id for r in spool.pending()] == [t.id for t in trajs[4:]]
        assert [decode_msgpack(r.data, Trajectory).id for r in spool.pending()] == [
            t.id for t in trajs[4:]
        ]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536])
def test_hand_framed_lease_body_equals_msgspec_encoding(n: int) -> None:
    from agentroll.stream.api import _msgpack_array_header, _RawLeaseBatch

    items = [msgspec.msgpack.encode(i) for i in range(n)]
    head = {"lease_id": "L", "expires_at": 1.5, "ttl": 2.0, "trainer_version": 3}
    expected = msgspec.msgpack.encode(
        _RawLeaseBatch(**head, trajectories=[msgspec.Raw(x) for x in items])
    )
    prefix = msgspec.msgpack.encode(_RawLeaseBatch(**head, trajectories=[]))
    assert b"".join([prefix[:-1], _msgpack_array_header(n), *items]) == expected


async def test_a_received_body_is_not_kept_by_the_response() -> None:
    """httpx's response and its stream refer to each other (a cycle): the body handed out
    must not stay reachable from them, or every lease's buffer lives until the cyclic GC."""
    from agentroll.stream.transport import _Body

    body = _Body(bytearray(b"abc"))
    parts = [part async for part in body]
    assert parts == [bytearray(b"abc")] and body.data == bytearray()


_BODY = encode_msgpack(batch(2))
_JBODY = encode_json(batch(2))


def _mutated(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    out = bytearray(data)
    for at, cut, insert in edits:  # replace out[at:at+cut] with insert (positions wrap)
        i = at % (len(out) + 1)
        out[i : i + cut] = insert
    return bytes(out)


_EDITS = st.lists(
    st.tuples(st.integers(0, 1 << 20), st.integers(0, 8), st.binary(max_size=6)),
    min_size=1,
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(edits=_EDITS, fmt=st.sampled_from(["msgpack", "json"]), conversation=st.booleans())
def test_a_damaged_lease_body_decodes_consistently_or_raises_a_value_error(
    edits: list[tuple[int, int, bytes]], fmt: str, conversation: bool
) -> None:
    """Whatever bytes arrive, the decoders answer with self-consistent trajectories or a
    ValueError (msgspec's errors are ValueErrors): never SyntaxError, TypeError, ..."""
    body = _mutated(_BODY if fmt == "msgpack" else _JBODY, edits)
    try:
        got = decode_lease(body, json=fmt == "json", conversation=conversation)
        alone = (
            decode_msgpack(body, LeaseBatch) if fmt == "msgpack" else decode_json(body, LeaseBatch)
        )
    except ValueError:
        return
    for t in [*got.trajectories, *alone.trajectories]:
        for name, dtype in TOKEN_ARRAY_DTYPES.items():
            arr = getattr(t, name)
            assert arr.dtype == dtype and arr.shape == t.token_ids.shape


@settings(max_examples=300, deadline=None)
@given(
    name=st.text(alphabet=",()[]<>|:0123456789ibufcOSUVMmb ", max_size=8),
    field=st.sampled_from(list(TOKEN_ARRAY_DTYPES)),
)
def test_any_dtype_name_decodes_or_raises_a_value_error(name: str, field: str) -> None:
    """The dtype names of a body are the peer's: numpy's parser raised SyntaxError for ","
    (out of both decoders) and took structured and sub-array names."""
    raw = msgspec.msgpack.decode(_BODY)
    raw["trajectories"][0][field]["dtype"] = name
    body = msgspec.msgpack.encode(raw)
    for decode in (
        lambda: decode_lease(body).trajectories,
        lambda: decode_lease(body, conversation=False).trajectories,
        lambda: decode_msgpack(body, LeaseBatch).trajectories,
    ):
        try:
            trajectories = decode()
        except ValueError:
            continue
        assert getattr(trajectories[0], field).dtype == TOKEN_ARRAY_DTYPES[field]
