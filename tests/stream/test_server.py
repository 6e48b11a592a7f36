"""The trajectory stream end to end over a real 127.0.0.1 server: nothing lost, nothing seen
twice (lease expiry, consumer restart, worker kill -9), acks and stale drops leave the spool,
bad requests get a 4xx and the worker keeps serving, tokens are enforced."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from agentroll.bench.stream import synthetic_trajectory
from agentroll.errors import ConfigError, WeightSyncError
from agentroll.rollout.buffer import BufferConfig
from agentroll.stream import (
    StreamClient,
    StreamConfig,
    StreamError,
    TrajectoryStream,
    Undecodable,
    serve_stream,
)
from agentroll.stream.client import _Reply
from agentroll.types import Message, Trajectory
from agentroll.weights.transport import UpdateHeader
from agentroll.weights.update import TensorUpdate, WeightUpdate

TOKEN = "test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def traj(i: int, *, group_size: int = 1, version: int = 7) -> Trajectory:
    t = synthetic_trajectory(i, 64, turns=2, prefix="t", group_size=group_size)
    t.policy_version = np.where(t.loss_mask.astype(bool), version, -1).astype(np.int32)
    return t


def config(**buffer: object) -> StreamConfig:
    settings: dict[str, object] = {"capacity": 64, "max_staleness": None, "lease_ttl": 10.0}
    settings.update(buffer)
    return StreamConfig(buffer=BufferConfig(**settings), max_body_bytes=4096)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def worker(
    path: Path, cfg: StreamConfig | None = None, **kwargs: object
) -> AsyncIterator[tuple[TrajectoryStream, str]]:
    token = kwargs.pop("token", TOKEN)
    async with (
        TrajectoryStream(path, cfg or config(), **kwargs) as stream,  # type: ignore[arg-type]
        serve_stream(stream, token=token) as url,  # type: ignore[arg-type]
    ):
        yield stream, url


def segment_files(path: Path) -> list[Path]:
    return list(path.glob("*.seg"))


def append_text(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def same(a: Trajectory, b: Trajectory) -> bool:
    return (
        a.id == b.id
        and a.group_id == b.group_id
        and a.turns == b.turns
        and a.messages == b.messages
        and all(
            np.array_equal(getattr(a, k), getattr(b, k), equal_nan=k == "logprobs")
            for k in ("token_ids", "logprobs", "loss_mask", "policy_version", "kv_version")
        )
    )


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_lease_ack_round_trip_is_bit_exact_and_empties_the_spool(
    tmp_path: Path, fmt: str
) -> None:
    sent = [traj(i) for i in range(5)]
    async with worker(tmp_path) as (stream, url):
        for t in sent:
            await stream.publish([t])
        assert len(stream.spool) == 5  # durable before offered
        async with StreamClient(url, token=TOKEN, format=fmt) as client:  # type: ignore[arg-type]
            batch = await client.lease(max=10)
            assert batch is not None and batch.ttl == pytest.approx(10.0, abs=1.0)
            assert all(same(a, b) for a, b in zip(batch.trajectories, sent, strict=True))
            assert await client.lease(max=10) is None  # 204: nothing left to lease
            assert await client.ack([t.id for t in sent]) == 5
            assert await client.ack([sent[0].id]) == 0  # acked twice: nothing left
            status = await client.status()
    assert status["spool"]["records"] == 0 and status["buffer"]["acked"] == 5
    assert not segment_files(tmp_path)


async def test_a_client_without_conversation_gets_token_data_only(tmp_path: Path) -> None:
    sent = [traj(i) for i in range(4)]
    assert all(t.turns and t.messages for t in sent)
    async with worker(tmp_path) as (stream, url):
        for t in sent:
            await stream.publish([t])
        async with (
            StreamClient(url, token=TOKEN, conversation=False) as client,
            contextlib.aclosing(client.batches(max=10, wait=1.0, auto_ack=True)) as batches,
        ):
            got = await anext(batches)
        stripped = [msgspec.structs.replace(t, turns=[], messages=[]) for t in sent]
        assert all(same(a, b) for a, b in zip(got, stripped, strict=True))
        assert [t.reward for t in got] == [t.reward for t in sent]


def undecodable(i: int, field: str = "role") -> Trajectory:
    """A trajectory the worker takes and no client decodes: a message whose role is an int
    (what an older rollout let through from an environment's reply), or an int task id."""
    t = traj(i)
    if field == "role":
        t.messages = [Message(role=3, content="x")]  # type: ignore[arg-type]
    else:
        t.task_id = 5  # type: ignore[assignment]
    return t


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_an_undecodable_trajectory_is_named_and_the_rest_of_its_lease_kept(
    tmp_path: Path, fmt: str
) -> None:
    """Before, one such trajectory made every lease holding it fail as "unexpected reply ...
    is the URL an agentroll worker?", and it came back after every ttl: the trainer was
    stuck.  By default the error names it and says what to do; with ``skip`` its bytes are
    kept aside, it is acknowledged, and its batch's other trajectories are delivered."""
    sent = [traj(0), undecodable(1), traj(2)]
    clock = FakeClock()
    async with worker(tmp_path / "spool", clock=clock) as (stream, url):
        for t in sent:
            await stream.publish([t])
        async with StreamClient(url, token=TOKEN, format=fmt) as client:  # type: ignore[arg-type]
            with pytest.raises(StreamError, match=r"'t-00000001': .*on_undecodable='skip'"):
                await client.lease(max=10)
        dead = tmp_path / "dead"
        skip = StreamClient(
            url,
            token=TOKEN,
            format=fmt,  # type: ignore[arg-type]
            on_undecodable="skip",
            dead_letter_dir=dead,
        )
        async with skip as client:
            clock.now += 11  # the refused lease expires: offered again
            batch = await client.lease(max=10)
            assert batch is not None
            assert [t.id for t in batch.trajectories] == ["t-00000000", "t-00000002"]
            assert all(same(a, b) for a, b in zip(batch.trajectories, sent[::2], strict=True))
            assert client.undecodable == 1
            assert await client.ack([t.id for t in batch.trajectories]) == 2
        assert len(stream.spool) == 0  # the undecodable one was acknowledged too
        # the same through batches(), with a conversation-less consumer (which steps over
        # the messages: a bad role would not concern it)
        await stream.publish([undecodable(3, "task_id")])
        await stream.publish([traj(4)])
        skip = StreamClient(url, token=TOKEN, format=fmt, on_undecodable="skip", conversation=False)  # type: ignore[arg-type]
        async with skip as client, contextlib.aclosing(client.batches(max=10, wait=1.0)) as it:
            got = await anext(it)
            assert [t.id for t in got] == ["t-00000004"] and not got[0].messages
            assert client.undecodable == 1
            await client.ack(["t-00000004"])
        assert len(stream.spool) == 0
    [line] = (dead / "errors.jsonl").read_text().splitlines()
    record = msgspec.json.decode(line)
    assert record["id"] == "t-00000001" and "role" in record["error"]
    kept = (dead / record["file"]).read_bytes()
    raw = (msgspec.msgpack if fmt == "msgpack" else msgspec.json).decode(kept)
    assert raw["id"] == "t-00000001" and raw["messages"] == [{"role": 3, "content": "x"}]


def test_dead_letters_of_ids_that_look_alike_keep_apart(tmp_path: Path) -> None:
    from agentroll.stream.client import _write_dead_letters

    bad = [Undecodable(i, "e", i.encode()) for i in ("a/b", "a_b", "../x", "é")]
    _write_dead_letters(tmp_path, bad, ".msgpack")
    lines = [msgspec.json.decode(x) for x in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == ["a/b", "a_b", "../x", "é"]
    assert len({x["file"] for x in lines}) == 4
    assert all((tmp_path / x["file"]).read_bytes() == x["id"].encode() for x in lines)
    assert {p.parent for p in tmp_path.iterdir()} == {tmp_path}


def test_the_client_refuses_an_unknown_undecodable_policy() -> None:
    with pytest.raises(ConfigError, match="on_undecodable='drop'; use 'raise' or 'skip'"):
        StreamClient("http://127.0.0.1:1", on_undecodable="drop")  # type: ignore[arg-type]


async def test_expired_lease_is_offered_again_and_deduped(tmp_path: Path) -> None:
    clock = FakeClock()
    async with worker(tmp_path, clock=clock) as (stream, url):
        await stream.publish([traj(0)])
        async with StreamClient(url, token=TOKEN) as client:
            batches = client.batches(max=1, wait=5.0, prefetch=False)
            first = await anext(batches)
            assert [t.id for t in first] == ["t-00000000"]
            clock.now += 11  # the lease expires unacknowledged
            await stream.publish([traj(1)])
            second = await anext(batches)
            assert [t.id for t in second] == ["t-00000001"]
            assert client.skipped == 1  # t0 was re-offered, not yielded twice
            assert stream.buffer.statistics().expired_leases == 1
            await client.ack(["t-00000000", "t-00000001"])
            await batches.aclose()
        assert len(stream.spool) == 0


async def test_batches_sends_the_next_lease_before_decoding_the_last(tmp_path: Path) -> None:
    """With prefetch, the worker prepares batches k+1 and k+2 while batch k is decoded: their
    requests are on their way when k's reply is decoded (no dedupe or ack change either
    way)."""
    async with worker(tmp_path) as (stream, url):
        for i in range(6):
            await stream.publish([traj(i)])
        async with StreamClient(url, token=TOKEN) as client:
            requests = [0]
            at_decode: list[int] = []
            lease_reply, decode_lease = client._lease_reply, client._decode_lease

            async def counted(*args: object) -> tuple[int, str, bytes | bytearray]:
                requests[0] += 1
                return await lease_reply(*args)  # type: ignore[arg-type]

            def decode(reply: tuple[int, str, bytes | bytearray]) -> object:
                at_decode.append(requests[0])
                return decode_lease(reply)

            client._lease_reply = counted  # type: ignore[method-assign]
            client._decode_lease = decode  # type: ignore[method-assign,assignment]
            got: list[str] = []
            async with contextlib.aclosing(client.batches(max=2, wait=5, auto_ack=True)) as it:
                async for batch in it:
                    got += [t.id for t in batch]
                    if len(got) == 6:
                        break
        assert sorted(got) == [f"t-{i:08d}" for i in range(6)]
        assert at_decode[:3] == [3, 4, 5]  # reply k decoded after requests k+1, k+2 were made


async def test_batches_yields_a_prefetched_batch_past_an_empty_long_poll(tmp_path: Path) -> None:
    """Prefetched lease requests travel on their own connections and may reach the worker
    out of order: when a younger request took the last trajectory and an older one is
    long-polling on an empty buffer, the younger reply is yielded at once, not after the
    older one's wait (it was: a 10 s stall at the end of small streams)."""
    async with worker(tmp_path) as (stream, url):
        for i in range(2):
            await stream.publish([traj(i)])
        async with StreamClient(url, token=TOKEN) as client:
            calls = [0]
            lease_reply = client._lease_reply

            async def reordered(*args: object) -> _Reply:
                calls[0] += 1
                if calls[0] == 2:  # the first prefetch reaches the worker after the second
                    await asyncio.sleep(0.3)
                return await lease_reply(*args)  # type: ignore[arg-type]

            client._lease_reply = reordered  # type: ignore[method-assign]
            async with contextlib.aclosing(client.batches(max=1, wait=30)) as batches:
                first = await anext(batches)
                start = time.monotonic()
                async with asyncio.timeout(5):
                    second = await anext(batches)
                waited = time.monotonic() - start
            await client.ack([t.id for t in first + second])
        assert sorted(t.id for t in first + second) == ["t-00000000", "t-00000001"]
        assert waited < 2.0  # not held behind the empty long-poll (30 s)
        assert len(stream.spool) == 0


async def test_take_returns_exactly_n_never_handed_out_before(tmp_path: Path) -> None:
    clock = FakeClock()
    async with worker(tmp_path, clock=clock) as (stream, url):
        for i in range(3):
            await stream.publish([traj(i)])
        async with StreamClient(url, token=TOKEN) as client:
            first = await client.take(2, wait=5.0)
            assert [t.id for t in first] == ["t-00000000", "t-00000001"]
            clock.now += 11  # that lease expires unacknowledged: both are offered again
            for i in range(3, 5):
                await stream.publish([traj(i)])
            second = await client.take(3, wait=5.0)
            assert [t.id for t in second] == ["t-00000002", "t-00000003", "t-00000004"]
            assert client.skipped == 2


async def test_consumer_killed_mid_batch_gets_the_unacked_rest(tmp_path: Path) -> None:
    clock = FakeClock()
    seen = tmp_path / "seen.jsonl"
    async with worker(tmp_path / "spool", clock=clock) as (stream, url):
        for i in range(6):
            await stream.publish([traj(i)])
        async with StreamClient(url, token=TOKEN, seen_path=seen) as first:
            batches = first.batches(max=4, wait=0, prefetch=False)
            got = await anext(batches)
            assert len(got) == 4
            await first.ack([t.id for t in got[:2]])  # then the trainer dies
            await batches.aclose()
        clock.now += 11
        append_text(seen, '["t-0000')  # torn tail of the seen file: dropped on load
        async with StreamClient(url, token=TOKEN, seen_path=seen) as second:
            received: list[str] = []
            async for batch in second.batches(max=10, wait=0, auto_ack=True):
                received += [t.id for t in batch]
                if len(received) >= 4:
                    break
        assert sorted(received) == [f"t-0000000{i}" for i in range(2, 6)]


@pytest.mark.parametrize("damaged", ["5", '{"a": 1}', "[1, 2]", '["t", 3]'])
def test_a_damaged_seen_file_line_ends_it_like_a_torn_tail(tmp_path: Path, damaged: str) -> None:
    """JSON that is not a list of ids (a flipped bit, another program's file): what follows
    is dropped, as after a torn line (it raised TypeError from set.update before)."""
    from agentroll.stream.client import _load_seen

    seen = tmp_path / "seen.jsonl"
    seen.write_text(f'["t-1"]\n{damaged}\n["t-2"]\n')
    assert _load_seen(seen) == {"t-1"}
    assert seen.read_text() == '["t-1"]\n'


async def test_acked_before_restart_is_never_yielded_and_is_reacked(tmp_path: Path) -> None:
    seen = tmp_path / "seen.jsonl"
    seen.write_text('["t-00000000"]\n')  # acked by a previous consumer; the worker forgot it
    async with worker(tmp_path / "spool") as (stream, url):
        await stream.publish([traj(0)])
        await stream.publish([traj(1)])
        async with StreamClient(url, token=TOKEN, seen_path=seen) as client:
            batch = await anext(client.batches(max=1, wait=0, prefetch=False))
        assert [t.id for t in batch] == ["t-00000001"]
        assert "t-00000000" not in stream.spool  # re-acknowledged, left the spool


async def test_the_client_keeps_only_unacknowledged_ids_as_handed_out(tmp_path: Path) -> None:
    # a long run acknowledges millions of ids: the in-flight set must not grow with it
    async with worker(tmp_path / "spool") as (stream, url):
        for i in range(6):
            await stream.publish([traj(i)])
        async with StreamClient(url, token=TOKEN) as client:
            got: list[str] = []
            async with contextlib.aclosing(
                client.batches(max=2, wait=0, auto_ack=True, prefetch=False)
            ) as batches:
                async for batch in batches:
                    got += [t.id for t in batch]
                    if len(got) == 6:
                        break
            assert sorted(got) == [f"t-{i:08d}" for i in range(6)]
            assert client._yielded == set(got[-2:])  # auto_ack acks it at the next step
            await client.ack(got[-2:])
            assert client._yielded == set() and len(client._acked) == 6
            # a worker that offers an acknowledged id again (its ack log lost) gets it
            # acknowledged again; it is not handed out twice
            await stream.publish([traj(0)])
            batch = await client.lease(max=1, wait=1)
            assert batch is not None and await client._fresh(batch) == []
            assert "t-00000000" not in stream.spool and client._yielded == set()


async def test_worker_restart_restores_unacked_and_partial_groups(tmp_path: Path) -> None:
    cfg = config(group_size=2)
    async with worker(tmp_path, cfg) as (stream, url):
        await stream.publish([traj(0, group_size=2), traj(1, group_size=2)])
        await stream.publish([traj(2, group_size=2), traj(3, group_size=2)])
        async with StreamClient(url, token=TOKEN) as client:
            batch = await client.lease(max=2)
            assert batch is not None
            await client.ack([batch.trajectories[0].id])  # half of the first group
    async with worker(tmp_path, cfg) as (stream, url):
        assert stream.counters["restored"] == 3
        async with StreamClient(url, token=TOKEN) as client:
            partial = await client.lease(max=1)
            full = await client.lease(max=2)
    assert partial is not None and [t.id for t in partial.trajectories] == ["t-00000001"]
    assert full is not None and [t.id for t in full.trajectories] == ["t-00000002", "t-00000003"]


async def test_an_ack_after_a_restart_of_a_lease_from_before_it_is_final(
    tmp_path: Path,
) -> None:
    """A trainer acknowledges, after the worker restarted, what it leased before: the
    trajectory leaves the restored buffer as it leaves the spool, and is not offered again
    (it was, from memory, while the spool had let it go)."""
    async with worker(tmp_path) as (stream, url):
        await stream.publish([traj(0)])
        await stream.publish([traj(1)])
        async with StreamClient(url, token=TOKEN) as client:
            held = await client.lease(max=1)
    assert held is not None and [t.id for t in held.trajectories] == ["t-00000000"]
    async with worker(tmp_path) as (stream, url):
        async with StreamClient(url, token=TOKEN) as client:
            assert await client.ack(["t-00000000"]) == 1
            batch = await client.lease(max=10)
            assert batch is not None and [t.id for t in batch.trajectories] == ["t-00000001"]
            assert await client.lease(max=10) is None
        assert stream.buffer.statistics().queued == 0 and len(stream.spool) == 1


async def test_concurrent_publishers_share_fsyncs_and_back_pressure_keeps_them_durable(
    tmp_path: Path,
) -> None:
    async with worker(tmp_path, config(capacity=4)) as (stream, url):
        before = stream.spool.statistics().fsyncs
        tasks = [asyncio.create_task(stream.publish([traj(i)])) for i in range(20)]
        # the buffer has no event for "a producer waits": yield to the loop until 16 do
        while stream.buffer.statistics().waiting_producers < 16:  # noqa: ASYNC110
            await asyncio.sleep(0)
        # 20 groups are durable, 4 are offered, 16 publishers wait for buffer space
        assert len(stream.spool) == 20
        assert stream.spool.statistics().fsyncs - before <= 3  # group commit
        async with StreamClient(url, token=TOKEN) as client:
            delivered: list[str] = []
            while len(delivered) < 20:
                batch = await client.lease(max=4, wait=5)
                assert batch is not None
                delivered += [t.id for t in batch.trajectories]
                await client.ack(t.id for t in batch.trajectories)
        await asyncio.gather(*tasks)
        assert sorted(delivered) == sorted(f"t-{i:08d}" for i in range(20))
        assert len(stream.spool) == 0


async def test_a_publish_is_answered_only_after_an_fsync_that_covers_it(tmp_path: Path) -> None:
    """Publishers share fsyncs (group commit), and each publish returns only once an fsync
    that started after its records were written has finished."""
    async with worker(tmp_path, config(capacity=512)) as (stream, _):
        spool = stream.spool
        lock = threading.Lock()
        written: set[str] = set()
        durable: set[str] = set()
        fsyncs = [0]
        append_many, sync_records = spool.append_many, spool.sync_records

        def append(items: Iterable[tuple[str, bytes]]) -> None:
            items = list(items)
            append_many(items)
            with lock:
                written.update(rid for rid, _ in items)

        def slow_sync() -> None:
            with lock:
                covered = set(written)
            time.sleep(0.005)  # a slow disk: more publishers queue meanwhile
            sync_records()
            with lock:
                fsyncs[0] += 1
                durable.update(covered)

        spool.append_many = append  # type: ignore[method-assign,assignment]
        spool.sync_records = slow_sync  # type: ignore[method-assign]

        async def publish(i: int) -> None:
            await stream.publish([traj(i)])
            assert f"t-{i:08d}" in durable

        async def publisher(first: int) -> None:
            for i in range(first, 240, 16):
                await publish(i)

        await asyncio.gather(*(publisher(k) for k in range(16)))
        assert len(durable) == 240 and len(spool) == 240
        # shared: one fsync per publish would be 240; 16 publishers usually share ~15-25,
        # and 31 were seen on a loaded 2-core machine (publishers resumed late by the event
        # loop trickle in, so an fsync that starts at once covers fewer)
        assert fsyncs[0] <= 240 // 4


async def test_publishes_that_arrive_during_an_fsync_share_the_next_one(tmp_path: Path) -> None:
    """One thread writes a round, fdatasyncs it and answers it; the publishes queued while
    that fdatasync waits on the disk are the next round: one writev and one fdatasync for
    all of them, and none is answered before it (every publish still waits for an fsync
    that covers it: the test above)."""
    async with worker(tmp_path, config(capacity=512)) as (stream, _):
        spool = stream.spool
        committer = stream._records
        assert committer is not None
        rounds: list[int] = []
        fsyncs: list[int] = []  # the records written when each fdatasync began
        waiting: list[int] = []  # publishes queued (none written) when the first one ended
        append_many, sync_records = spool.append_many, spool.sync_records

        def append(items: Iterable[tuple[str, bytes]]) -> None:
            items = list(items)
            rounds.append(len(items))
            append_many(items)

        def slow_sync() -> None:
            fsyncs.append(sum(rounds))
            if len(fsyncs) == 1:  # a disk that answers once 7 more publishes are queued
                deadline = time.monotonic() + 5
                while len(committer._queued) < 7 and time.monotonic() < deadline:
                    time.sleep(0.001)
                waiting.append(len(committer._queued))
            sync_records()

        spool.append_many = append  # type: ignore[method-assign,assignment]
        spool.sync_records = slow_sync  # type: ignore[method-assign]
        first = asyncio.create_task(stream.publish([traj(0)]))
        while not fsyncs:  # noqa: ASYNC110 (the commit thread has no event to wait on)
            await asyncio.sleep(0.001)
        rest = [asyncio.create_task(stream.publish([traj(i)])) for i in range(1, 8)]
        await asyncio.gather(first, *rest)
        assert len(spool) == 8
        assert waiting == [7]  # nothing is written while an fdatasync is in flight
        assert rounds == [1, 7]  # the seven queued during the first fdatasync: one round
        assert fsyncs == [1, 8]  # ... and one fdatasync, after their writev


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_dead_writer_thread_fails_publishes_instead_of_hanging(tmp_path: Path) -> None:
    async with worker(tmp_path, config(capacity=64)) as (stream, _):
        await stream.publish([traj(0)])

        def die(jobs: object) -> None:
            raise SystemExit("simulated crash of the writer thread")

        stream._write_records = die  # type: ignore[method-assign,assignment]
        with pytest.raises(RuntimeError, match="writer thread stopped"):
            await asyncio.wait_for(stream.publish([traj(1)]), 10)
        with pytest.raises(RuntimeError, match="writer thread has stopped"):
            await asyncio.wait_for(stream.publish([traj(2)]), 10)


def test_a_round_is_cut_after_the_job_that_reaches_the_limit() -> None:
    from agentroll.stream.server import _Job, _round

    jobs = [_Job(records=[(f"r{i}", b"x" * 10)] * 2) for i in range(5)]  # 20 bytes each
    assert _round(jobs, 45) == (jobs[:3], jobs[3:])
    assert _round(jobs, 40) == (jobs[:2], jobs[2:])
    assert _round(jobs, 1000) == (jobs, [])
    assert _round(jobs, 1) == (jobs[:1], jobs[1:])


async def test_status_is_consistent_while_commits_are_half_done(tmp_path: Path) -> None:
    """A status read while a commit has changed the spool but not yet answered its caller
    (records appended, fsync in flight; acks applied, ack-log fsync in flight; a stale drop
    not yet in the spool) still balances: ``lost_count`` is 0 at every such moment."""
    from agentroll.run.loop import lost_count

    async with worker(tmp_path, config(max_staleness=0)) as (stream, _):
        spool = stream.spool
        held = threading.Event()
        release = threading.Event()
        sync_records, sync_acks = spool.sync_records, spool.sync_acks

        def hold(sync: Callable[..., None]) -> Callable[..., None]:
            def held_sync(*args: object, **kwargs: object) -> None:
                held.set()
                release.wait(10)
                sync(*args, **kwargs)

            return held_sync

        async def balanced_while(lane: str, work: Awaitable[object]) -> None:
            held.clear()
            release.clear()
            if lane == "records":
                spool.sync_records = hold(sync_records)  # type: ignore[method-assign]
            else:
                spool.sync_acks = hold(sync_acks)  # type: ignore[method-assign]
            task = asyncio.ensure_future(work)
            assert await asyncio.to_thread(held.wait, 10)
            try:
                assert lost_count(stream.status()) == 0, stream.status()
            finally:
                release.set()
                spool.sync_records, spool.sync_acks = sync_records, sync_acks  # type: ignore[method-assign]
                await task
            assert lost_count(stream.status()) == 0

        await balanced_while("records", stream.publish([traj(0, version=1)]))
        assert stream.status()["stream"]["published"] == 1
        await stream.publish([traj(1, version=1)])
        await balanced_while("acks", stream.ack(["t-00000000"]))
        stream.buffer.set_trainer_version(2)  # t-00000001 is stale now: dropped
        assert lost_count(stream.status()) == 0  # counted, not in the spool's acks yet
        await stream.ack([])  # the drop reaches the spool
        status = stream.status()
        assert lost_count(status) == 0 and status["spool"]["records"] == 0
        assert status["stream"]["dropped_stale"] == 1 and status["stream"]["acked"] == 1


def make_update(version: int) -> WeightUpdate:
    payload = np.arange(5000, dtype=np.uint8).tobytes()
    tensor = TensorUpdate(
        name="w", dtype="uint8", shape=(5000,), encoding="full", payload=payload, checksum="0" * 32
    )
    return WeightUpdate(
        version=version, base_version=version - 1, kind="full", tensors=(tensor,), digest="1" * 32
    )


async def test_weights_are_applied_and_stale_trajectories_leave_the_spool(tmp_path: Path) -> None:
    applied: list[WeightUpdate] = []

    async def on_weights(update: WeightUpdate) -> None:
        if update.version == 99:
            raise WeightSyncError("wrong base version 98; this replica is at 3")
        applied.append(update)

    cfg = config(max_staleness=1)
    async with worker(tmp_path, cfg, on_weights=on_weights) as (stream, url):
        await stream.publish([traj(0, version=1)])
        await stream.publish([traj(1, version=3)])
        async with StreamClient(url, token=TOKEN) as client:
            await client.push_weights(make_update(3), chunk_bytes=1000)
            assert applied == [make_update(3)]  # bit-exact after a streamed upload
            with pytest.raises(WeightSyncError, match="wrong base"):
                await client.push_weights(make_update(99))
            batch = await client.lease(max=10)
            assert batch is not None and [t.id for t in batch.trajectories] == ["t-00000001"]
            status = await client.status()
        assert status["policy_version"] == 3 and status["trainer_version"] == 3
        assert stream.counters["dropped_stale"] == 1
        await stream.ack([])  # one more group commit: the drop ack is durable by now
        assert "t-00000000" not in stream.spool and "t-00000001" in stream.spool
        async with httpx.AsyncClient(headers=AUTH) as raw:
            bad = await raw.post(f"{url}/v1/weights", content=b"not a weight stream")
            assert bad.status_code == 400 and "malformed weight upload" in bad.text


async def test_weight_uploads_are_judged_from_their_header(tmp_path: Path) -> None:
    """``check_weights`` sees each upload's header before its payloads: a refusal is a 409
    and ``on_weights`` never runs; a header declaring more than ``max_weights_bytes`` is a
    413 naming it; a worker that takes no weights says so at once."""
    headers: list[int] = []
    applied: list[int] = []

    def check(header: UpdateHeader) -> None:
        headers.append(header.version)
        if header.base_version != 2:
            raise WeightSyncError(f"based on version {header.base_version}, not 2")

    async def on_weights(update: WeightUpdate) -> None:
        applied.append(update.version)

    cfg = msgspec.structs.replace(config(), max_weights_bytes=4999)
    async with worker(tmp_path / "a", on_weights=on_weights, check_weights=check) as (_, url):
        async with StreamClient(url, token=TOKEN) as client:
            with pytest.raises(WeightSyncError, match="HTTP 409: based on version 98, not 2"):
                await client.push_weights(make_update(99))
            await client.push_weights(make_update(3))
        assert headers == [99, 3] and applied == [3]
    async with (
        worker(tmp_path / "b", cfg, on_weights=on_weights) as (_, url),
        StreamClient(url, token=TOKEN) as client,
    ):
        with pytest.raises(
            WeightSyncError,
            match=r"HTTP 413: .*5000 payload bytes, more than the 4999-byte limit "
            r"\(StreamConfig.max_weights_bytes\)",
        ):
            await client.push_weights(make_update(4))
    async with worker(tmp_path / "c") as (_, url), StreamClient(url, token=TOKEN) as client:
        with pytest.raises(WeightSyncError, match="HTTP 409: this worker takes no weight"):
            await client.push_weights(make_update(5))
    assert applied == [3]


async def test_a_push_may_name_the_resume_policy(tmp_path: Path) -> None:
    """``push_weights(policy=)`` reaches an ``on_weights`` that takes ``policy``; one that
    cannot is refused with why (nothing applied); an unknown policy is a 400."""
    seen: list[tuple[int, str | None]] = []

    async def with_policy(update: WeightUpdate, *, policy: str | None = None) -> None:
        seen.append((update.version, policy))

    async def without(update: WeightUpdate) -> None:
        seen.append((update.version, "never"))

    async with (
        worker(tmp_path / "a", on_weights=with_policy) as (_, url),
        StreamClient(url, token=TOKEN) as client,
    ):
        await client.push_weights(make_update(1), policy="restart")
        await client.push_weights(make_update(2))
        with pytest.raises(WeightSyncError, match="HTTP 400: policy='sometimes'"):
            await client.push_weights(make_update(3), policy="sometimes")
    assert seen == [(1, "restart"), (2, None)]
    async with (
        worker(tmp_path / "b", on_weights=without) as (_, url),
        StreamClient(url, token=TOKEN) as client,
    ):
        with pytest.raises(WeightSyncError, match="its own resume policy"):
            await client.push_weights(make_update(4), policy="keep")
        await client.push_weights(make_update(5))
    assert seen[2:] == [(5, "never")]


async def test_bad_requests_get_4xx_and_the_worker_keeps_serving(tmp_path: Path) -> None:
    async with worker(tmp_path) as (stream, url):
        await stream.publish([traj(0)])
        async with httpx.AsyncClient(base_url=url, headers=AUTH) as raw:
            r = await raw.post("/v1/ack", content=b"\xc1garbage")
            assert r.status_code == 400 and "malformed msgpack body" in r.text
            r = await raw.post(
                "/v1/ack", content=b'{"ids": 5}', headers={"content-type": "application/json"}
            )
            assert r.status_code == 400 and "Expected `array`" in r.text
            r = await raw.post("/v1/ack", content=b"x" * 5000)
            assert r.status_code == 413 and "4096-byte limit" in r.text

            async def chunked() -> AsyncIterator[bytes]:
                for _ in range(10):
                    yield b"x" * 1000

            r = await raw.post("/v1/ack", content=chunked())
            assert r.status_code == 413
            r = await raw.post("/v1/lease?max=abc")
            assert r.status_code == 400 and "bad query parameter" in r.text
            r = await raw.post("/v1/lease?max=0")
            assert r.status_code == 400 and "max=0" in r.text
            r = await raw.post("/v1/lease?wait=1e9")
            assert r.status_code == 400
            r = await raw.get("/v1/nope")
            assert r.status_code == 404
            r = await raw.get("/v1/lease")
            assert r.status_code == 405
            metrics = await raw.get("/metrics")
            assert metrics.status_code == 200
            assert "agentroll_stream_published_total 1" in metrics.text
            for line in metrics.text.splitlines():
                assert line.startswith("# TYPE agentroll_") or line.startswith("agentroll_")
        async with StreamClient(url, token=TOKEN, format="json") as client:  # still serving
            batch = await client.lease(max=1)
            assert batch is not None and batch.trajectories[0].id == "t-00000000"


async def test_token_is_required_on_every_route(tmp_path: Path) -> None:
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match="stream token is empty"):
            async with (
                TrajectoryStream(tmp_path / "a") as stream,
                serve_stream(stream, token=empty),
            ):
                pass
    async with worker(tmp_path / "b", token="s3cret") as (stream, url):
        async with httpx.AsyncClient(base_url=url) as raw:
            for method, path in [
                ("POST", "/v1/lease"),
                ("POST", "/v1/ack"),
                ("POST", "/v1/weights"),
                ("GET", "/v1/status"),
                ("GET", "/metrics"),
            ]:
                r = await raw.request(method, path)
                assert r.status_code == 401, path
                r = await raw.request(method, path, headers={"authorization": "Bearer wrong"})
                assert r.status_code == 401, path
            ok = await raw.get("/metrics", headers={"authorization": "Bearer s3cret"})
            assert ok.status_code == 200
        async with StreamClient(url, token="wrong") as client:
            with pytest.raises(StreamError, match="wrong token"):
                await client.lease()
        async with StreamClient(url, token="s3cret") as client:
            assert await client.lease() is None


async def test_unreachable_worker_is_a_stream_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with StreamClient(f"http://127.0.0.1:{port}", token=TOKEN, timeout=2) as client:
        with pytest.raises(StreamError, match="check that the worker is running"):
            await client.lease()


# -- kill -9 of a real worker process --------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from agentroll.bench.stream import synthetic_trajectory
    from agentroll.stream.auth import ensure_token
    from agentroll.rollout.buffer import BufferConfig
    from agentroll.stream import StreamConfig, TrajectoryStream, serve_stream

    async def main(path, port, first, count, ttl):
        cfg = StreamConfig(buffer=BufferConfig(capacity=1000, max_staleness=None, lease_ttl=ttl))
        token = ensure_token(Path(path).parent, None)  # the same file at the restart
        async with TrajectoryStream(path, cfg) as stream, serve_stream(
            stream, port=port, token=token
        ):
            for i in range(first, first + count):
                await stream.publish([synthetic_trajectory(i, 64, turns=2, prefix="t")])
            print("ready", flush=True)
            await asyncio.Event().wait()

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                     float(sys.argv[5])))
    """
)


def start_worker(
    path: Path, port: int, first: int, count: int, ttl: float
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(path), str(port), str(first), str(count), str(ttl)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # published and durable when it says so
    assert line.strip() == "ready", f"worker failed to start (exit {proc.poll()})"
    return proc


@pytest.mark.slow
async def test_worker_kill9_then_restart_delivers_everything_exactly_once(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    spool, seen = tmp_path / "spool", tmp_path / "seen.jsonl"
    all_ids = [f"t-{i:08d}" for i in range(80)]
    yielded: list[str] = []
    worker_a = await asyncio.to_thread(start_worker, spool, port, 0, 60, 3600.0)
    try:
        consumer = StreamClient(url, run_dir=tmp_path, seen_path=seen)
        batches = consumer.batches(max=10, wait=5, prefetch=False)
        for k in range(3):
            batch = await anext(batches)
            yielded += [t.id for t in batch]
            if k < 2:
                await consumer.ack(t.id for t in batch)  # 0..19 acked, 20..29 in flight
    finally:
        worker_a.send_signal(signal.SIGKILL)
        worker_a.wait()
    assert yielded == all_ids[:30]
    # restarted on the same dir (and port); publishes 20 more; short ttl for the next step
    worker_b = await asyncio.to_thread(start_worker, spool, port, 60, 20, 1.0)
    try:
        async with asyncio.timeout(60):
            while len(yielded) < 80:  # the same consumer goes on: 20..29 are not yielded again
                batch = await anext(batches)
                yielded += [t.id for t in batch]
                await consumer.ack(t.id for t in batch if t.id < "t-00000070")
            assert sorted(yielded) == all_ids and len(set(yielded)) == 80
            await consumer.ack(all_ids[20:30])  # done with the batch that was in flight
            await batches.aclose()
            await consumer.aclose()  # the trainer dies holding 70..79 unacknowledged
            async with StreamClient(url, run_dir=tmp_path, seen_path=seen) as restarted:
                again: list[str] = []
                async for batch in restarted.batches(max=10, wait=5, auto_ack=True):
                    again += [t.id for t in batch]
                    if len(again) >= 10:
                        break
                assert sorted(again) == all_ids[70:]  # exactly what it had not acknowledged
                await restarted.ack(again)
                status = await restarted.status()
            assert status["spool"]["records"] == 0
    finally:
        worker_b.send_signal(signal.SIGKILL)
        worker_b.wait()
