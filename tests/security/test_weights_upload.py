"""A weight upload is judged from its header frame before any payload byte is read: a wrong
base version or tensors that do not match the model get 409, a header that declares more
than the cap (or more than a tensor can take) gets 413, at once and without the payloads
being sent at all; an upload that is accepted is held once (one buffer per payload, no
joined copy) and applies bit-exactly.  Both endpoints: the worker's ``/v1/weights`` and a
replica's ``weights_app``."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch
from weights_server import serve_weights

from agentroll.errors import WeightSyncError
from agentroll.stream.api import serve_stream
from agentroll.stream.client import StreamClient
from agentroll.stream.server import StreamConfig, TrajectoryStream
from agentroll.weights.apply import WeightStore
from agentroll.weights.exporter import WeightExporter
from agentroll.weights.http import HttpTransport
from agentroll.weights.transport import MAGIC, describe
from agentroll.weights.update import TensorUpdate, WeightUpdate, model_digest

MIB = 1 << 20
TOKEN = "s3cret"
BIG = 64 * MIB  # the upload the memory bounds are measured on


def big_update(version: int, base: int, size: int = BIG, *, kind: str = "delta") -> WeightUpdate:
    """One uint8 tensor ``w`` of ``size`` elements; as a delta, ``size`` random payload
    bytes (within what a delta of ``w`` may take); consistent transport hashes."""
    payload = np.random.default_rng(version).integers(0, 256, size, dtype=np.uint8).tobytes()
    tensor = TensorUpdate(
        name="w",
        dtype="uint8",
        shape=(size,),
        encoding="delta" if kind == "delta" else "full",
        payload=payload,
        checksum="0" * 32,
        num_changed=size // 3 if kind == "delta" else -1,
    )
    return WeightUpdate(
        version=version,
        base_version=base,
        kind=kind,  # type: ignore[arg-type]
        tensors=(tensor,),
        digest="1" * 32,
    )


def header_frame(update: WeightUpdate) -> bytes:
    """The first bytes of the upload: magic, header length, header (no payload)."""
    head = msgspec.msgpack.encode(describe(update))
    return MAGIC + struct.pack("<Q", len(head)) + head


async def post_header_only(
    url: str, update: WeightUpdate, *, chunked: bool = False
) -> httpx.Response:
    """POST the header frame of ``update`` and none of its payloads (the body announces them
    all: a Content-Length of the whole upload, or chunked), then read the reply.  A server
    that waits for the payloads never replies: the read times out and the test fails."""
    target = httpx.URL(url)
    body = header_frame(update)
    total = len(body) + update.payload_bytes
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        if chunked:
            framing = "transfer-encoding: chunked"
            sent = f"{len(body):x}\r\n".encode() + body + b"\r\n"
        else:
            framing = f"content-length: {total}"
            sent = body
        head = (
            f"POST {target.raw_path.decode()} HTTP/1.1\r\nhost: {target.host}\r\n{framing}\r\n"
            f"authorization: Bearer {TOKEN}\r\n"
            "content-type: application/x-agentroll-weights\r\n\r\n"
        )
        writer.write(head.encode() + sent)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        headers: dict[str, str] = {}
        while (line := await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        text = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
        return httpx.Response(int(status_line.split()[1]), content=text)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def worker(
    tmp_path: Path, store: WeightStore, cfg: StreamConfig | None = None
) -> AsyncIterator[str]:
    """A trajectory worker whose weights are ``store``: ``store.check`` judges each header,
    ``store.apply`` applies what arrives whole."""

    async def on_weights(update: WeightUpdate) -> None:
        store.apply(update)

    async with (
        TrajectoryStream(
            tmp_path / "spool", cfg, on_weights=on_weights, check_weights=store.check
        ) as stream,
        serve_stream(stream, token=TOKEN) as url,
    ):
        yield url


def uint8_store(version: int, size: int = BIG) -> WeightStore:
    return WeightStore({"w": torch.zeros(size, dtype=torch.uint8)}, version=version)


@contextlib.contextmanager
def traced_peak() -> Iterator[list[int]]:
    """The peak of the bytes Python allocated in the block (client and server: both run in
    this process), appended to the yielded list at its end."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


# -- (a) a wrong base: 409 from the header, the payloads never read ------------------------


async def test_a_delta_on_a_wrong_base_is_refused_before_its_payload(tmp_path: Path) -> None:
    store = uint8_store(version=4)
    wrong = big_update(version=5, base=3)
    async with worker(tmp_path, store) as url:
        # only the header is sent: the 409 comes without a single payload byte
        reply = await post_header_only(f"{url}/v1/weights", wrong)
        assert reply.status_code == 409
        assert "based on version 3" in reply.text and "version 4" in reply.text
        assert "ask for a full update" in reply.text
        # the whole upload through the client: refused, and the worker never held it
        async with StreamClient(url, token=TOKEN) as client:
            with (
                traced_peak() as peak,
                pytest.raises(WeightSyncError, match=r"HTTP 409: .*based on version 3"),
            ):
                await client.push_weights(wrong)
        assert peak[0] < BIG // 8, f"{peak[0]} bytes traced for a {BIG}-byte refused upload"
    assert store.version == 4 and not store.tensors["w"].any()


async def test_tensors_that_do_not_match_the_model_are_refused_from_the_header(
    tmp_path: Path,
) -> None:
    store = uint8_store(version=4, size=1000)
    unknown = big_update(5, 4, size=1000)
    unknown = msgspec.structs.replace(
        unknown, tensors=(msgspec.structs.replace(unknown.tensors[0], name="v"),)
    )
    reshaped = big_update(5, 4, size=4000)
    async with worker(tmp_path, store) as url:
        reply = await post_header_only(f"{url}/v1/weights", unknown)
        assert reply.status_code == 409 and "the model has no tensor 'v'" in reply.text
        reply = await post_header_only(f"{url}/v1/weights", reshaped)
        assert reply.status_code == 409
        assert "uint8[4000] in the update but uint8[1000] in the model" in reply.text


async def test_a_replica_endpoint_refuses_a_wrong_base_from_the_header() -> None:
    store = uint8_store(version=4)
    wrong = big_update(version=5, base=3)

    async def on_update(update: WeightUpdate) -> None:
        store.apply(update)

    async with serve_weights(on_update, check=store.check, token=TOKEN) as url:
        reply = await post_header_only(url, wrong)
        assert reply.status_code == 409 and "based on version 3" in reply.text
        async with HttpTransport(url, token=TOKEN) as sender:
            with traced_peak() as peak, pytest.raises(WeightSyncError, match="HTTP 409"):
                await sender.send(wrong)
        assert peak[0] < BIG // 8, f"{peak[0]} bytes traced for a {BIG}-byte refused upload"
    assert store.version == 4


# -- (b) more than the cap: 413 from the header ---------------------------------------------


async def test_a_header_declaring_more_than_the_cap_is_refused_before_its_payload(
    tmp_path: Path,
) -> None:
    store = uint8_store(version=4, size=4 * MIB)
    too_big = big_update(version=5, base=4, size=4 * MIB)
    cfg = StreamConfig(max_weights_bytes=MIB)
    async with worker(tmp_path, store, cfg) as url:
        # chunked: no Content-Length announces the size, only the header does
        reply = await post_header_only(f"{url}/v1/weights", too_big, chunked=True)
        assert reply.status_code == 413
        assert f"declares {4 * MIB} payload bytes" in reply.text
        assert f"{MIB}-byte limit (StreamConfig.max_weights_bytes)" in reply.text
    assert store.version == 4


async def test_a_payload_larger_than_its_tensor_can_take_is_refused(tmp_path: Path) -> None:
    """The model bounds an upload: a full ``w`` is its 1000 bytes, a delta at most ~2.5x
    (uint8, index encoding included); the default cap (64 GiB) is not what refuses it."""
    store = uint8_store(version=4, size=1000)
    full = big_update(5, 4, size=1000, kind="full")
    padded = msgspec.structs.replace(
        full, tensors=(msgspec.structs.replace(full.tensors[0], payload=bytes(1001)),)
    )
    delta = big_update(5, 4, size=1000)
    bloated = msgspec.structs.replace(
        delta, tensors=(msgspec.structs.replace(delta.tensors[0], payload=bytes(100_000)),)
    )
    async with worker(tmp_path, store) as url:
        for update, limit in ((padded, 1000), (bloated, 2560)):
            reply = await post_header_only(f"{url}/v1/weights", update, chunked=True)
            assert reply.status_code == 413, reply.text
            assert f"takes at most {limit} bytes" in reply.text
    assert store.version == 4


# -- (c) an accepted upload: held once, applied bit-exactly ---------------------------------


async def test_an_accepted_upload_is_held_once(tmp_path: Path) -> None:
    """Receiving a correct upload costs about one copy of it (today's join held two)."""
    got: list[int] = []

    async def on_weights(update: WeightUpdate) -> None:
        got.append(update.version)

    update = big_update(version=5, base=4)
    async with (
        TrajectoryStream(tmp_path / "spool", on_weights=on_weights) as stream,
        serve_stream(stream, token=TOKEN) as url,
        StreamClient(url, token=TOKEN) as client,
    ):
        with traced_peak() as peak:
            await client.push_weights(update)
    assert got == [5]
    assert BIG <= peak[0] < BIG * 5 // 4, f"{peak[0]} bytes traced for a {BIG}-byte upload"


def trainer_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(512, 64, generator=g),
        "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
        "head.bias": torch.arange(100, dtype=torch.int64),
    }


async def test_a_correct_update_applies_bit_exactly(tmp_path: Path) -> None:
    state = trainer_state()
    exporter = WeightExporter(lambda: state)
    store = WeightStore({n: t.clone() for n, t in state.items()}, version=0)
    async with worker(tmp_path, store) as url, StreamClient(url, token=TOKEN) as client:
        for step in range(2):
            state["embed.weight"][step, :7] += 1.0
            state["norm.weight"][3 * step] = -2.5
            delta = exporter.export()
            assert delta.kind == "delta" and delta.base_version == step
            await client.push_weights(delta, chunk_bytes=1000)
            assert store.version == step + 1
        # a full update (on any base) of newer weights also goes through the header check
        state["head.bias"][:] = 7
        exporter.export()
        await client.push_weights(exporter.full())
    assert store.version == 3
    for name, tensor in state.items():
        live = store.tensors[name]
        assert live.dtype == tensor.dtype and torch.equal(
            live.view(torch.uint8), tensor.view(torch.uint8)
        )
    assert store.verify() == model_digest({t.name: t.checksum for t in exporter.full().tensors})


# -- the worker: its fleet's version and, for engines in this process, the model's layout --

RECIPE = """
[environment]
name = "calculator"
[backend]
replicas = 1
kv_cache_mb = 16
max_num_seqs = 4
"""


async def test_the_worker_judges_uploads_by_its_fleet_and_model(
    tiny_model: Path, tmp_path: Path
) -> None:
    from agentroll.run.build import build_backend, local_weight_layout
    from agentroll.run.recipe import parse_recipe
    from agentroll.run.service import RolloutService
    from agentroll.testing import SyntheticTrainer

    recipe = parse_recipe(RECIPE)
    service = RolloutService(recipe, model_dir=tiny_model, run_dir=tmp_path)
    service.backend = build_backend(recipe, tiny_model)
    await service.backend.start()
    try:
        layout = local_weight_layout(service.backend)
        assert layout is not None and "model.embed_tokens.weight" in layout.specs
        check = service._weights_check()
        good = describe(SyntheticTrainer(tiny_model, seed=0).step())
        check(good)  # based on the fleet's version 0, tensors of the model: accepted
        first = good.tensors[0]
        faults = {
            "based on version 7, but this worker has version 0": {"base_version": 7},
            "the model has no tensor 'extra'": {
                "tensors": (msgspec.structs.replace(first, name="extra"),)
            },
            "in the update but": {
                "tensors": (msgspec.structs.replace(first, shape=(*first.shape, 2)),)
            },
        }
        for message, change in faults.items():
            with pytest.raises(WeightSyncError, match=message):
                check(msgspec.structs.replace(good, **change))  # type: ignore[arg-type]
    finally:
        await service.backend.close()
