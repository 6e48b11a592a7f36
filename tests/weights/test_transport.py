"""Weight transports: every transport round-trips an update exactly and refuses a corrupt,
truncated or half-sent one with ``WeightSyncError`` (never a partial update); a retry works."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from agentroll.errors import ConfigError, WeightSyncError
from agentroll.weights.http import HttpTransport
from agentroll.weights.transport import (
    MAGIC,
    DirectoryTransport,
    FrameDecoder,
    InProcessTransport,
    UpdateHeader,
    UpdateRefusedError,
    UpdateTooLargeError,
    available_versions,
    describe,
    encode_frames,
    read_update,
    run_blocking,
    write_update,
)
from agentroll.weights.update import TensorUpdate, WeightUpdate

SIZES = (3000, 0, 70_001, 17)


def make_update(version: int = 3, *, seed: int = 0, sizes: tuple[int, ...] = SIZES) -> WeightUpdate:
    rng = np.random.default_rng(seed)
    tensors = tuple(
        TensorUpdate(
            name=f"layers.{i}.weight",
            dtype="bfloat16",
            shape=(n,),
            encoding="delta" if i % 2 else "full",
            payload=rng.integers(0, 256, n, dtype=np.uint8).tobytes(),
            checksum=f"{i:032x}",
            num_changed=-1 if i % 2 == 0 else n // 6,
        )
        for i, n in enumerate(sizes)
    )
    return WeightUpdate(
        version=version, base_version=version - 1, kind="delta", tensors=tensors, digest="ab" * 16
    )


# -- framing and in-process ---------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_frames_round_trip_any_chunking(chunk: int) -> None:
    update = make_update()
    stream = b"".join(encode_frames(update, describe(update), chunk_bytes=1000))
    decoder = FrameDecoder()
    for start in range(0, len(stream), chunk):
        decoder.feed(stream[start : start + chunk])
    assert decoder.finish() == update


def test_frames_refuse_truncated_corrupt_and_trailing() -> None:
    update = make_update()
    stream = b"".join(encode_frames(update, describe(update)))
    truncated = FrameDecoder()
    truncated.feed(stream[:-1])
    with pytest.raises(WeightSyncError, match="truncated"):
        truncated.finish()
    flipped = bytearray(stream)
    flipped[-100] ^= 0x01
    with pytest.raises(WeightSyncError, match="corrupt"):
        FrameDecoder().feed(bytes(flipped))
    with pytest.raises(WeightSyncError, match="unexpected bytes"):
        FrameDecoder().feed(stream + b"x")
    with pytest.raises(WeightSyncError, match="bad magic"):
        FrameDecoder().feed(b"GET / HTTP/1.1\r\n\r\n")


def header_length(stream: bytes) -> int:
    """Bytes of the preamble and header frame at the start of an ``encode_frames`` stream."""
    return len(MAGIC) + 8 + struct.unpack_from("<Q", stream, len(MAGIC))[0]


def test_frames_are_judged_from_the_header_before_any_payload() -> None:
    update = make_update()
    stream = b"".join(encode_frames(update, describe(update)))
    seen: list[int] = []

    def refuse(header: UpdateHeader) -> None:
        seen.append(header.version)
        raise WeightSyncError("wrong base")

    decoder = FrameDecoder(check=refuse)
    with pytest.raises(UpdateRefusedError, match="wrong base"):
        decoder.feed(stream)  # the whole stream at once: refused at the header
    assert seen == [3] and decoder.buffered_bytes == 0  # no payload buffer was allocated
    head = stream[: header_length(stream)]
    with pytest.raises(
        UpdateTooLargeError,
        match=f"declares {update.payload_bytes} payload bytes, more than the 1000-byte limit",
    ):
        FrameDecoder(max_bytes=1000).feed(head)
    # a full bfloat16[3000] payload is 6000 bytes: one byte more is refused from the header
    bloated = msgspec.structs.replace(update.tensors[0], payload=bytes(6001))
    bloated_update = msgspec.structs.replace(update, tensors=(bloated, *update.tensors[1:]))
    bloated_stream = b"".join(encode_frames(bloated_update, describe(bloated_update)))
    with pytest.raises(UpdateTooLargeError, match="takes at most 6000 bytes"):
        FrameDecoder().feed(bloated_stream[: header_length(bloated_stream)])
    with pytest.raises(
        UpdateTooLargeError, match=r"header of \d+ bytes exceeds the 1024-byte limit"
    ):
        FrameDecoder(max_header_bytes=1024).feed(MAGIC + struct.pack("<Q", 1025))
    with pytest.raises(WeightSyncError, match="empty update header"):
        FrameDecoder().feed(MAGIC + struct.pack("<Q", 0))
    for bad in ({"dtype": "float8"}, {"shape": (-1, 4)}):
        odd = msgspec.structs.replace(describe(update).tensors[0], **bad)  # type: ignore[arg-type]
        header = msgspec.structs.replace(describe(update), tensors=(odd,))
        with pytest.raises(WeightSyncError, match=r"unsupported dtype|negative dimension"):
            FrameDecoder(header)


def test_frames_hold_each_payload_once() -> None:
    """The decoder never holds more than the update's payloads (one buffer each, filled in
    place: no pieces joined at the end), and what it returns is those buffers."""
    update = make_update()
    stream = b"".join(encode_frames(update, describe(update)))
    decoder = FrameDecoder()
    held = []
    for start in range(0, len(stream), 997):
        decoder.feed(stream[start : start + 997])
        held.append(decoder.buffered_bytes)
    assert header_length(stream) < update.payload_bytes
    assert max(held) == held[-1] == update.payload_bytes
    received = decoder.finish()
    assert received == update
    assert all(isinstance(t.payload, bytearray) for t in received.tensors)


async def test_in_process_round_trip_and_backpressure() -> None:
    transport = InProcessTransport(maxsize=1)
    first, second = make_update(1), make_update(2, seed=1)
    await transport.send(first)
    blocked = asyncio.create_task(transport.send(second))
    await asyncio.sleep(0)
    assert not blocked.done()  # bounded: the second send waits for the receiver
    assert await transport.receive() == first
    await blocked
    assert await transport.receive() == second


async def test_run_blocking_waits_for_its_thread_on_cancel() -> None:
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        release.wait(5)
        finished.set()

    task = asyncio.create_task(run_blocking(work))
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()  # cancelled, but still waiting for the thread
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()


# -- directory ----------------------------------------------------------------------------


def test_directory_round_trip_and_layout(tmp_path: Path) -> None:
    update = make_update(5)
    path = write_update(update, tmp_path, file_bytes=10_000)
    assert path == tmp_path / "v5"
    files = sorted(p.name for p in path.iterdir())
    assert files == ["manifest.json", *(f"payloads-{i:05d}.safetensors" for i in range(3))]
    assert read_update(path) == update
    with pytest.raises(WeightSyncError, match="already exists"):
        write_update(update, tmp_path)


async def test_directory_transport_in_order_ignores_temp(tmp_path: Path) -> None:
    (tmp_path / ".v9-crashed.tmp").mkdir()  # a writer died before its rename
    (tmp_path / ".v9-crashed.tmp" / "manifest.json").write_text("{")
    sender, receiver = DirectoryTransport(tmp_path), DirectoryTransport(tmp_path)
    pending = asyncio.create_task(receiver.receive())
    await sender.send(make_update(1, seed=1))
    assert await asyncio.wait_for(pending, 5) == make_update(1, seed=1)
    for version in (2, 3):
        await sender.send(make_update(version, seed=version))
    assert [(await receiver.receive()).version for _ in range(2)] == [2, 3]
    assert available_versions(tmp_path) == [1, 2, 3]
    late = DirectoryTransport(tmp_path, after_version=2)
    assert await late.receive() == make_update(3, seed=3)


def test_directory_commit_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    update = make_update(7)
    real_rename = os.rename
    seen: list[list[int]] = []

    def rename(src: str, dst: str) -> None:
        # every file is written, yet until this rename no reader can see the version
        assert {p.name for p in Path(src).iterdir()} >= {"manifest.json"}
        seen.append(available_versions(tmp_path))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    write_update(update, tmp_path)
    assert seen == [[]]
    assert available_versions(tmp_path) == [7]


def test_directory_failed_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.numpy

    real_save = safetensors.numpy.save_file
    calls = []

    def save_file(tensors: dict[str, np.ndarray], filename: str) -> None:
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(tensors, filename)

    monkeypatch.setattr(safetensors.numpy, "save_file", save_file)
    with pytest.raises(WeightSyncError, match="No space"):
        write_update(make_update(4), tmp_path, file_bytes=10_000)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fault", ["flip", "truncate", "missing", "manifest"])
def test_directory_refuses_damage(tmp_path: Path, fault: str) -> None:
    path = write_update(make_update(6), tmp_path, file_bytes=10_000)
    victim = path / "payloads-00001.safetensors"
    data = bytearray(victim.read_bytes())
    if fault == "flip":
        data[-5] ^= 0x10  # inside the payload bytes: safetensors cannot notice, xxh3 does
        victim.write_bytes(bytes(data))
    elif fault == "truncate":
        victim.write_bytes(bytes(data[:-5]))
    elif fault == "missing":
        victim.unlink()
    else:
        (path / "manifest.json").unlink()
    with pytest.raises(WeightSyncError):
        read_update(path)


# -- HTTP ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def cutting_proxy(url: str, cut_after: int) -> AsyncIterator[str]:
    """A TCP proxy to ``url`` that drops both connections after ``cut_after`` request bytes."""
    target = httpx.URL(url)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, up_writer = await asyncio.open_connection(target.host, target.port)
        forwarded = 0
        try:
            while forwarded < cut_after and (data := await reader.read(cut_after - forwarded)):
                up_writer.write(data)
                await up_writer.drain()
                forwarded += len(data)
        finally:
            for w in (writer, up_writer):
                w.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        yield str(target.copy_with(port=port))


async def test_http_round_trip_and_refusals() -> None:
    from weights_server import serve_weights  # here: the gloo workers import this module

    received: list[WeightUpdate] = []

    async def on_update(update: WeightUpdate) -> None:
        if update.base_version != len(received) + 2:
            raise WeightSyncError(f"wrong base {update.base_version}")
        received.append(update)

    async with serve_weights(on_update, token="s3cret") as url:
        assert url.startswith("http://127.0.0.1:")
        async with HttpTransport(url, token="s3cret", chunk_bytes=4096) as client:
            await client.send(make_update(3))
            with pytest.raises(WeightSyncError, match="HTTP 409: wrong base 5"):
                await client.send(make_update(6))
        for token in (None, "wrong"):
            async with HttpTransport(url, token=token) as anonymous:
                with pytest.raises(WeightSyncError, match="HTTP 401"):
                    await anonymous.send(make_update(4))
        async with httpx.AsyncClient() as raw:
            update = make_update(4)
            body = b"".join(encode_frames(update, describe(update)))
            auth = {"authorization": "Bearer s3cret"}
            for bad in (body[:-10], body[:-10] + b"x" * 10):
                reply = await raw.post(url, content=bad, headers=auth)
                assert reply.status_code == 400, reply.text
    assert received == [make_update(3)]


async def test_http_connection_dies_half_way_then_retry() -> None:
    from weights_server import serve_weights  # here: the gloo workers import this module

    received: list[WeightUpdate] = []

    async def on_update(update: WeightUpdate) -> None:
        received.append(update)

    update = make_update(8, sizes=(300_000, 200_000))
    async with serve_weights(on_update) as url:
        async with (
            cutting_proxy(url, cut_after=250_000) as flaky_url,
            HttpTransport(flaky_url, chunk_bytes=16_384) as client,
        ):
            with pytest.raises(WeightSyncError, match="failed"):
                await client.send(update)
        assert received == []  # the server dropped the partial upload
        async with HttpTransport(url) as client:
            await client.send(update)
    assert received == [update]


async def test_http_needs_token_off_loopback() -> None:
    from weights_server import serve_weights  # here: the gloo workers import this module

    async def on_update(update: WeightUpdate) -> None: ...

    with pytest.raises(ConfigError, match="token"):
        async with serve_weights(on_update, host="0.0.0.0"):
            pass


# -- torch.distributed (gloo) -------------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_transport import make_update
    from agentroll.errors import WeightSyncError
    from agentroll.weights.dist import broadcast_update

    rank, store, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=5))
    if mode != "ok" and rank == 0:
        real, calls = dist.broadcast, []
        def broadcast(*args, **kwargs):
            calls.append(1)
            if len(calls) == 4 and mode == "corrupt":  # a bit flips in the second bucket
                args[0][100] ^= 1
            elif len(calls) == 4:  # sizes, header and first bucket sent; then the sender fails
                if mode == "hang":
                    time.sleep(60)  # killed by the test once rank 1 has given up
                os._exit(3)
            return real(*args, **kwargs)
        dist.broadcast = broadcast
    update = make_update(11) if rank == 0 else None
    try:
        got = broadcast_update(update, src=0, bucket_bytes=4096)
        result = "OK" if got == make_update(11) else "MISMATCH"
    except WeightSyncError as exc:
        result = f"ERROR {exc}"
    # without this, a group broken by a timeout can abort the interpreter at exit
    dist.destroy_process_group()
    print(result)
    """
)


def run_ranks(tmp_path: Path, mode: str) -> list[tuple[int, str]]:
    env = {"GLOO_SOCKET_IFNAME": "lo", **os.environ, "PYTHONUNBUFFERED": "1"}
    here = str(Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(rank), str(tmp_path / "store"), mode, here],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    results = []
    for proc in reversed(procs):  # the receiver first: a hanging sender is killed after it
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
        results.append((proc.returncode, out.strip().splitlines()[-1] if out.strip() else ""))
        if mode == "hang":
            procs[0].kill()
    return results[::-1]


@pytest.mark.slow
def test_gloo_broadcast_two_processes(tmp_path: Path) -> None:
    assert run_ranks(tmp_path, "ok") == [(0, "OK"), (0, "OK")]  # 73_018 bytes: 18 buckets


@pytest.mark.slow
def test_gloo_corrupt_bucket_fails_on_every_rank(tmp_path: Path) -> None:
    (code0, line0), (code1, line1) = run_ranks(tmp_path, "corrupt")
    assert (code0, code1) == (0, 0)
    assert line0 == "ERROR a receiving rank could not verify its copy of the update"
    assert line1 == "ERROR payload of 'layers.2.weight' is corrupt (xxh3 mismatch)"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["die", "hang"])
def test_gloo_sender_fails_mid_transfer(tmp_path: Path, mode: str) -> None:
    """A sender that exits is noticed at once (connection reset); one that hangs is noticed
    when the group's 5 s timeout expires.  Either way the receiver raises WeightSyncError."""
    (code0, _), (code1, line1) = run_ranks(tmp_path, mode)
    assert code0 == (3 if mode == "die" else -9)
    assert code1 == 0 and line1.startswith("ERROR weight broadcast failed"), line1
