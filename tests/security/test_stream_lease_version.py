"""Issue 30 item 3: a lease's ``trainer_version`` cannot make the worker drop what it holds.

A version above the newest weights the worker received is refused (409, saying what to
send) and changes nothing; what the buffer does drop as stale (after a real weight push)
stays on disk in the spool's dropped segment, bit-exact, up to its retention limit, and
is counted in status and metrics."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest

from agentroll.bench.stream import synthetic_trajectory
from agentroll.rollout.buffer import BufferConfig
from agentroll.stream import (
    StreamClient,
    StreamConfig,
    StreamError,
    TrajectoryStream,
    serve_stream,
)
from agentroll.stream.dropped import read_dropped
from agentroll.stream.spool_config import SpoolConfig
from agentroll.types import Trajectory, encode_msgpack
from agentroll.weights.update import TensorUpdate, WeightUpdate

TOKEN = "lease-version-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def traj(i: int, version: int = 0) -> Trajectory:
    t = synthetic_trajectory(i, 32, turns=2, prefix="t")
    t.policy_version = np.where(t.loss_mask.astype(bool), version, -1).astype(np.int32)
    return t


def config(**spool: Any) -> StreamConfig:
    return StreamConfig(
        buffer=BufferConfig(capacity=256, max_staleness=1, lease_ttl=30.0),
        spool=SpoolConfig(**spool),
    )


def update(version: int) -> WeightUpdate:
    payload = bytes(range(100))
    tensor = TensorUpdate(
        name="w", dtype="uint8", shape=(100,), encoding="full", payload=payload, checksum="0" * 32
    )
    return WeightUpdate(
        version=version, base_version=version - 1, kind="full", tensors=(tensor,), digest="1" * 32
    )


@contextlib.asynccontextmanager
async def worker(path: Path, cfg: StreamConfig, **kw: Any) -> AsyncIterator[tuple[Any, str]]:
    async with (
        TrajectoryStream(path, cfg, **kw) as stream,
        serve_stream(stream, token=TOKEN) as url,
    ):
        yield stream, url


async def test_a_version_no_weights_had_is_refused_and_drops_nothing(tmp_path: Path) -> None:
    """The attack of the issue: 128 spooled trajectories, one POST /v1/lease with a huge
    trainer_version.  Before, all 128 were counted stale, left the spool, and every later
    group was dropped on arrival; now the request is refused and nothing changes."""
    async with worker(tmp_path / "spool", config()) as (stream, url):
        for i in range(128):
            await stream.publish([traj(i)])
        async with httpx.AsyncClient(base_url=url) as raw:
            for version in ("99999999999999999999", "1"):  # a step count is refused too
                r = await raw.post(f"/v1/lease?trainer_version={version}", headers=AUTH)
                assert r.status_code == 409, r.text
                assert "policy_version" in r.text and "last weights you pushed" in r.text
            r = await raw.post("/v1/lease?trainer_version=99999999999999999999")  # no token
            assert r.status_code == 401
        status = stream.status()
        assert status["stream"]["dropped_stale"] == 0 and status["trainer_version"] == 0
        assert status["spool"]["records"] == 128 and len(stream.spool) == 128
        await stream.publish([traj(128)])  # a new group is still offered, not dropped
        async with StreamClient(url, token=TOKEN) as client:
            batch = await client.lease(max=200, trainer_version=0)
        assert batch is not None and len(batch.trajectories) == 129


async def test_the_version_of_the_last_push_is_accepted(tmp_path: Path) -> None:
    async def on_weights(u: WeightUpdate) -> None:
        pass

    async with worker(tmp_path / "spool", config(), on_weights=on_weights) as (stream, url):
        await stream.publish([traj(0, version=0)])
        async with StreamClient(url, token=TOKEN) as client:
            await client.push_weights(update(1))
            assert (await client.status())["policy_version"] == 1
            batch = await client.lease(max=1, trainer_version=1)
            assert batch is not None  # staleness 1 <= max_staleness 1
            with pytest.raises(StreamError, match=r"409.*trainer_version=2"):
                await client.lease(max=1, trainer_version=2)


async def test_in_process_leases_are_checked_before_admission_hears_the_version(
    tmp_path: Path,
) -> None:
    from agentroll.run.service import _NotingStream

    noted: list[int] = []
    service = SimpleNamespace(note_trainer_version=noted.append)
    stream = _NotingStream(tmp_path / "spool", config(), service=service)  # type: ignore[arg-type]
    async with stream:
        await stream.publish([traj(0)])
        with pytest.raises(ValueError, match="trainer_version=7 is above the newest weights"):
            await stream.lease(1, trainer_version=7)
        assert noted == [] and stream.buffer.statistics().trainer_version == 0
        assert await stream.lease(1, trainer_version=0) is not None and noted == [0]


async def test_stale_drops_stay_on_disk_counted_up_to_the_retention_limit(
    tmp_path: Path,
) -> None:
    """A real push to version 3 makes three version-0 trajectories stale: they leave the
    spool's pending records, but each is in the dropped segment, bit-exact, counted; with a
    limit of two the oldest goes and is counted as evicted."""
    sent = [traj(i, version=0) for i in range(3)]

    async def on_weights(u: WeightUpdate) -> None:
        pass

    spool_dir = tmp_path / "spool"
    cfg = config(dropped_max_records=2)
    async with worker(spool_dir, cfg, on_weights=on_weights) as (stream, url):
        for t in sent:
            await stream.publish([t])
        async with StreamClient(url, token=TOKEN) as client:
            for v in (1, 2, 3):
                await client.push_weights(update(v))
            await stream.ack([])  # one more ack round: the drops are in the spool now
            status = await client.status()
            async with httpx.AsyncClient(base_url=url, headers=AUTH) as raw:
                metrics = (await raw.get("/metrics")).text
    assert status["stream"]["dropped_stale"] == 3 and status["spool"]["records"] == 0
    spool = status["spool"]
    assert (spool["dropped"], spool["dropped_records"], spool["dropped_evicted"]) == (3, 2, 1)
    assert "agentroll_spool_dropped_records 2" in metrics
    assert "agentroll_spool_dropped_evicted_total 1" in metrics
    kept = list(read_dropped(spool_dir))
    assert [r.id for r in kept] == [t.id for t in sent[1:]]
    assert [r.data for r in kept] == [encode_msgpack(t) for t in sent[1:]]
    # after a restart the dropped segment is still there, and nothing dropped comes back
    async with worker(spool_dir, cfg) as (stream, _):
        assert stream.counters["restored"] == 0
        assert stream.status()["spool"]["dropped_records"] == 2
    assert [r.id for r in read_dropped(spool_dir)] == [t.id for t in sent[1:]]
