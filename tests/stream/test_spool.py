"""The durable spool: nothing flushed is lost, nothing acknowledged comes back, torn tails
are detected and dropped, fully acknowledged segments and old acks are reclaimed."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentroll.errors import ConfigError
from agentroll.stream.segment import encode_record
from agentroll.stream.spool import ACK_LOG, Spool
from agentroll.stream.spool_config import SpoolConfig
from agentroll.types import Trajectory, decode_msgpack, encode_msgpack


def traj(i: int, tokens: int = 64, group: str = "g") -> Trajectory:
    rng = np.random.default_rng(i)
    return Trajectory(
        id=f"t{i:05d}",
        task_id=f"task{i}",
        group_id=group,
        token_ids=rng.integers(0, 32000, tokens),
        logprobs=np.where(np.arange(tokens) % 3 == 0, np.nan, -rng.random(tokens)),
        loss_mask=np.arange(tokens) % 3 != 0,
        policy_version=np.full(tokens, 3),
        kv_version=np.full(tokens, 2),
        reward=float(i),
    )


def segments(path: Path) -> list[Path]:
    return sorted(path.glob("*.seg"))


def ids(spool: Spool) -> list[str]:
    return [r.id for r in spool.pending()]


def test_flushed_records_survive_reopen_bit_exact(tmp_path: Path) -> None:
    originals = [traj(i) for i in range(20)]
    with Spool(tmp_path) as spool:
        for t in originals:
            spool.append(t)
        spool.flush()
    with Spool(tmp_path) as spool:
        records = list(spool.pending())
    assert [r.id for r in records] == [t.id for t in originals]
    for record, t in zip(records, originals, strict=True):
        assert record.data == encode_msgpack(t)
        back = decode_msgpack(record.data, Trajectory)
        np.testing.assert_array_equal(back.logprobs, t.logprobs)  # NaN included
        np.testing.assert_array_equal(back.token_ids, t.token_ids)


def test_acked_records_never_come_back_and_segments_are_deleted(tmp_path: Path) -> None:
    config = SpoolConfig(segment_bytes=4096)  # ~ 4 records per segment
    with Spool(tmp_path, config) as spool:
        for i in range(40):
            spool.append(traj(i))
        spool.flush()
        before = len(segments(tmp_path))
        assert before >= 8
        assert spool.ack([f"t{i:05d}" for i in range(30)] + ["unknown"]) == 30
        assert spool.ack(["t00001"]) == 0  # already acknowledged
        after = len(segments(tmp_path))
        assert after <= before - 6
        assert ids(spool) == [f"t{i:05d}" for i in range(30, 40)]
        stats = spool.statistics()
        assert (stats.records, stats.acked, stats.appended) == (10, 30, 40)
    with Spool(tmp_path, config) as spool:
        assert ids(spool) == [f"t{i:05d}" for i in range(30, 40)]
        spool.ack(ids(spool))
    with Spool(tmp_path, config) as spool:
        assert ids(spool) == []
    assert segments(tmp_path) == []


def finishes_alone(fn: Callable[[], list[object]]) -> list[object]:
    """``fn()`` in another thread; fails if it does not return within 5 s (it waited for
    a lock held by a stuck write or unlink)."""
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.extend(fn()))
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "a read or an ack waited for the stuck file operation"
    return done


def read_back(parts: list[bytes | tuple[int, int, int]]) -> bytes:
    """What sendfile would send for ``payload_ranges``' parts."""
    return b"".join(p if isinstance(p, bytes) else os.pread(p[0], p[2], p[1]) for p in parts)


def test_payload_ranges_locate_records_in_any_order_across_segments(tmp_path: Path) -> None:
    """A lease body is sent from the segment files: each id's stored msgpack in the order
    asked (across segment boundaries and with other records between), an id acknowledged
    meanwhile filled in by the fallback; the descriptors are dups that outlive a deleted
    segment."""
    records = [(t.id, encode_msgpack(t)) for t in (traj(i, tokens=64 + 7 * i) for i in range(40))]
    stored = dict(records)
    with Spool(tmp_path, SpoolConfig(segment_bytes=8192)) as spool:
        spool.append_many(records[:25])
        for rec in records[25:]:
            spool.append(rec)
        spool.flush()
        assert len(segments(tmp_path)) > 3
        spool.ack(["t00003", "t00030"])
        order = ["t00030", "t00000", "t00002", "t00001", "t00039", "t00003"]
        order += [f"t{i:05d}" for i in range(4, 39, 3)]
        calls: list[str] = []

        def fallback(rid: str) -> bytes:
            calls.append(rid)
            return b"<" + rid.encode() + b">"

        parts, fds = spool.payload_ranges(order, fallback)
        expect = b"".join(
            stored[rid] if rid not in ("t00003", "t00030") else b"<" + rid.encode() + b">"
            for rid in order
        )
        assert read_back(parts) == expect
        assert calls == ["t00030", "t00003"]
        assert len(fds) == len({p[0] for p in parts if isinstance(p, tuple)}) > 3
        assert not set(fds) & set(spool._read_fds.values())  # dups, not the spool's own
        assert spool.payload_ranges([], fallback) == ([], [])
        # every record acknowledged: the segments go, the dups still read what they held
        spool.ack([rid for rid, _ in records])
        spool.flush()
        assert segments(tmp_path) == [] and spool._read_fds == {}
        assert read_back(parts) == expect
        for fd in fds:
            os.close(fd)


def test_reads_and_acks_go_on_while_an_append_is_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spool's lock is not held during an append's write: a lease (payload_ranges), an
    ack and the statistics do not wait for it; the segment being written is not deleted
    even when every record before it is acknowledged."""
    records = [(t.id, encode_msgpack(t)) for t in (traj(i) for i in range(3))]
    with Spool(tmp_path) as spool:
        spool.append_many(records[:2])
        spool.flush()
        entered, release = threading.Event(), threading.Event()
        real = os.pwritev

        def stuck(fd: int, parts: list[bytes], offset: int) -> int:
            entered.set()
            assert release.wait(10)
            return real(fd, parts, offset)

        monkeypatch.setattr(os, "pwritev", stuck)
        writer = threading.Thread(target=spool.append_many, args=([records[2]],))
        writer.start()
        try:
            assert entered.wait(10)

            def others() -> list[object]:
                parts, fds = spool.payload_ranges(["t00000"], lambda rid: b"")
                body = read_back(parts)
                for fd in fds:
                    os.close(fd)
                acked = spool.ack(["t00000", "t00001"])  # the segment has no live record
                return [body, acked, spool.statistics().records]

            assert finishes_alone(others) == [records[0][1], 2, 0]
        finally:
            release.set()
            writer.join(10)
        monkeypatch.undo()
        spool.flush()
        parts, fds = spool.payload_ranges(["t00002"], bytes)
        assert len(spool) == 1 and read_back(parts) == records[2][1]
        for fd in fds:
            os.close(fd)
    with Spool(tmp_path) as spool:  # the record written meanwhile survived the acks
        assert [r.id for r in spool.pending()] == ["t00002"]


def test_collect_unlinks_outside_the_lock_and_keeps_the_acks_until_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [(t.id, encode_msgpack(t)) for t in (traj(i) for i in range(120))]
    config = SpoolConfig(segment_bytes=8192, compact_ack_log_bytes=1024)
    with Spool(tmp_path, config) as spool:
        spool.append_many(records)
        spool.flush()
        for rid, _ in records[:100]:  # one frame each: the ack log grows past 1024 bytes
            spool.ack([rid], sync=False)
        spool.sync_acks(collect=False)
        before = len(segments(tmp_path))
        entered, release = threading.Event(), threading.Event()
        real = Path.unlink

        def stuck(path: Path, missing_ok: bool = False) -> None:
            entered.set()
            assert release.wait(10)
            real(path, missing_ok=missing_ok)

        monkeypatch.setattr(Path, "unlink", stuck)
        collector = threading.Thread(target=spool.collect)
        collector.start()
        try:
            assert entered.wait(10)

            def others() -> list[object]:
                parts, fds = spool.payload_ranges(["t00110"], lambda rid: b"")
                same = read_back(parts) == records[110][1]
                for fd in fds:
                    os.close(fd)
                spool._compact_ack_log()  # refused while files are being unlinked
                return [same, spool.statistics().ack_log_compactions]

            assert finishes_alone(others) == [True, 0]
        finally:
            release.set()
            collector.join(10)
        monkeypatch.undo()
        assert len(segments(tmp_path)) < before
        assert spool.statistics().ack_log_compactions == 1  # after the unlinks: compacted
    with Spool(tmp_path, config) as spool:
        assert sorted(r.id for r in spool.pending()) == [rid for rid, _ in records[100:]]


def test_pending_skips_unflushed_and_sync_every_flushes(tmp_path: Path) -> None:
    with Spool(tmp_path, SpoolConfig(sync_every=3)) as spool:
        spool.append(traj(0))
        spool.append(traj(1))
        assert ids(spool) == []  # not durable yet
        fsyncs = spool.statistics().fsyncs
        spool.append(traj(2))
        assert spool.statistics().fsyncs == fsyncs + 1
        assert ids(spool) == ["t00000", "t00001", "t00002"]


def test_torn_tail_is_truncated_counted_and_appending_continues(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        for i in range(5):
            spool.append(traj(i))
        spool.flush()
    (seg,) = segments(tmp_path)
    good_size = seg.stat().st_size
    torn = encode_record("t00099", encode_msgpack(traj(99)))[:-7]  # a write cut short
    with open(seg, "ab") as f:
        f.write(torn)
    with Spool(tmp_path) as spool:
        assert spool.statistics().torn_bytes_dropped == len(torn)
        assert seg.stat().st_size == good_size
        assert ids(spool) == [f"t{i:05d}" for i in range(5)]
        spool.append(traj(5))
        spool.flush()
    with Spool(tmp_path) as spool:
        assert ids(spool) == [f"t{i:05d}" for i in range(6)]
        assert spool.statistics().torn_bytes_dropped == 0


@pytest.mark.parametrize("where", ["payload", "magic", "header"])
def test_corrupt_last_record_is_dropped(tmp_path: Path, where: str) -> None:
    with Spool(tmp_path) as spool:
        for i in range(3):
            spool.append(traj(i))
        spool.flush()
    (seg,) = segments(tmp_path)
    last = len(encode_record("t00002", encode_msgpack(traj(2))))
    size = seg.stat().st_size
    pos = {"payload": size - 10, "magic": size - last, "header": size - last + 5}[where]
    data = bytearray(seg.read_bytes())
    data[pos] ^= 0x40
    seg.write_bytes(bytes(data))
    with Spool(tmp_path) as spool:
        assert ids(spool) == ["t00000", "t00001"]
        assert spool.statistics().torn_bytes_dropped == last


def test_torn_ack_log_keeps_intact_acks(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        for i in range(4):
            spool.append(traj(i))
        spool.flush()
        spool.ack(["t00000"])
        first = (tmp_path / ACK_LOG).stat().st_size
        spool.ack(["t00001"])
    ack_log = tmp_path / ACK_LOG
    size = ack_log.stat().st_size
    ack_log.write_bytes(ack_log.read_bytes()[:-3])  # the second ack frame is torn
    with Spool(tmp_path) as spool:
        assert ids(spool) == ["t00001", "t00002", "t00003"]
        assert spool.statistics().torn_bytes_dropped == size - 3 - first
        assert ack_log.stat().st_size == first


def test_ack_log_is_compacted_and_stays_correct(tmp_path: Path) -> None:
    config = SpoolConfig(segment_bytes=4096, compact_ack_log_bytes=1024)
    with Spool(tmp_path, config) as spool:
        for i in range(300):
            spool.append(traj(i, tokens=4))
        spool.flush()
        for i in range(299):  # one ack frame each; acks of deleted segments are not kept
            spool.ack([f"t{i:05d}"])
        stats = spool.statistics()
        assert stats.ack_log_compactions >= 1
        assert stats.ack_log_bytes <= 1024
        assert (tmp_path / ACK_LOG).stat().st_size == stats.ack_log_bytes
    with Spool(tmp_path, config) as spool:
        assert ids(spool) == ["t00299"]


def test_duplicate_id_and_second_opener_are_refused(tmp_path: Path) -> None:
    with Spool(tmp_path) as spool:
        spool.append(traj(0))
        with pytest.raises(ValueError, match="already in the spool"):
            spool.append(traj(0))
        with pytest.raises(ConfigError, match="in use by another process"):
            Spool(tmp_path)
    with Spool(tmp_path) as spool:  # released on close
        assert ids(spool) == ["t00000"]


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="segment_bytes"):
        SpoolConfig(segment_bytes=10)
    with pytest.raises(ConfigError, match="sync_every"):
        SpoolConfig(sync_every=-1)


# -- model-based: random appends, flushes, acks and crashes that cut unflushed bytes ------

_op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 4)),
    st.tuples(st.just("flush"), st.just(0)),
    st.tuples(st.just("ack"), st.integers(0, 10_000)),
    st.tuples(st.just("crash"), st.integers(0, 10_000)),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(_op, max_size=40))
def test_random_crashes_lose_nothing_durable(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]]
) -> None:
    path = tmp_path_factory.mktemp("spool")
    config = SpoolConfig(segment_bytes=4096)
    spool = Spool(path, config)
    appended: list[str] = []  # append order
    durable: set[str] = set()
    acked: set[str] = set()
    flushed_sizes: dict[str, int] = {}
    n = 0
    try:
        for op, arg in ops:
            if op == "append":
                for _ in range(arg):
                    spool.append(traj(n, tokens=8))
                    appended.append(f"t{n:05d}")
                    n += 1
            elif op == "flush":
                spool.flush()
                durable.update(appended)
                flushed_sizes = {p.name: p.stat().st_size for p in segments(path)}
            elif op == "ack":
                live = [i for i in appended if i not in acked]
                if live:
                    chosen = live[arg % len(live)]
                    spool.ack([chosen])
                    acked.add(chosen)
            else:
                spool.close()
                segs = segments(path)
                if segs:  # lose a random part of what was not flushed in the newest segment
                    newest = segs[-1]
                    low = flushed_sizes.get(newest.name, 0)
                    size = newest.stat().st_size
                    if size > low:
                        os.truncate(newest, low + arg % (size - low + 1))
                spool = Spool(path, config)
                survivors = ids(spool)
                # survivors: every durable unacked record, in append order, never an acked one
                assert durable - acked <= set(survivors)
                assert not set(survivors) & acked
                order = {rid: k for k, rid in enumerate(appended)}
                assert survivors == sorted(survivors, key=order.__getitem__)
                # what the crash lost was never durable: forget it
                appended = [i for i in appended if i in set(survivors) or i in acked]
                durable = set(survivors) | (durable & acked)
                flushed_sizes = {p.name: p.stat().st_size for p in segments(path)}
        spool.flush()
        assert ids(spool) == [i for i in appended if i not in acked]
    finally:
        spool.close()


def test_segments_reserve_disk_in_steps_and_give_back_the_rest(tmp_path: Path) -> None:
    """An open segment reserves disk ahead of its records (fallocate KEEP_SIZE, Linux) in
    doubling steps from 4 MB, never the whole ``segment_bytes`` for a few records, without
    growing: its size is what was written, so a reopen finds no torn tail.  A close, and a
    reopen after a crash (a reservation left behind), give back what lies past the records."""
    from agentroll.stream import segment as segment_module

    linux = segment_module._fallocate is not None
    mb = 1 << 20
    config = SpoolConfig(segment_bytes=64 * mb)
    with Spool(tmp_path, config) as spool:
        spool.append_many([traj(i) for i in range(3)])
        spool.flush()
        (segment,) = segments(tmp_path)
        stat = segment.stat()
        assert stat.st_size == spool.statistics().bytes < mb
        if linux:  # reserved, one step (tmpfs and ext4 both do)
            assert 4 * mb <= stat.st_blocks * 512 < 5 * mb
        spool.append(("big", b"x" * (5 * mb)))  # past the step: double it
        if linux:
            assert 8 * mb <= segment.stat().st_blocks * 512 < 9 * mb
    stat = segment.stat()
    assert stat.st_blocks * 512 < stat.st_size + mb  # the close gave the rest back
    if linux:  # a killed process leaves its reservation behind; the reopen releases it
        fd = os.open(segment, os.O_WRONLY)
        try:
            segment_module._preallocate(fd, 0, 32 * mb)
        finally:
            os.close(fd)
        assert segment.stat().st_blocks * 512 >= 32 * mb
    with Spool(tmp_path, config) as spool:
        assert spool.statistics().torn_bytes_dropped == 0
        assert ids(spool) == [*(f"t{i:05d}" for i in range(3)), "big"]
        assert segment.stat().st_blocks * 512 < stat.st_size + mb


# -- reused segment files -------------------------------------------------------------------


def frees(path: Path) -> list[Path]:
    return sorted(path.glob("*.free"))


def same_size(prefix: str, n: int) -> list[tuple[str, bytes]]:
    """Records whose frames all have one length: 6 fill a 4096-byte segment."""
    return [(f"{prefix}{i:04d}", bytes([i % 256]) * 700) for i in range(n)]


def test_reused_files_never_bring_old_records_back(tmp_path: Path) -> None:
    """Acknowledged segments' files are kept and overwritten by new segments; after a crash
    the old records past the new ones (frames intact, at frame boundaries) do not pass."""
    config = SpoolConfig(segment_bytes=4096, recycle_segments=2)
    old, new = same_size("a", 12), same_size("b", 2)
    live = tmp_path / "live"
    with Spool(live, config) as spool:
        spool.append_many(old)
        spool.flush()
        assert len(segments(live)) == 2
        spool.ack([rid for rid, _ in old])
        assert segments(live) == [] and len(frees(live)) == 2
        spool.append_many(new)
        spool.flush()
        assert len(segments(live)) == 1 and len(frees(live)) == 1  # one file reused
        assert segments(live)[0].stat().st_size > 2 * 725  # the old records are still there
        crashed = tmp_path / "crashed"
        shutil.copytree(live, crashed)  # what a kill -9 would leave
    # a compacted ack log no longer holds the acks of deleted segments' records: only the
    # frame tags keep the old records out
    (crashed / ACK_LOG).unlink()
    with Spool(crashed, config) as spool:
        assert [(r.id, r.data) for r in spool.pending()] == new
    with Spool(live, config) as spool:  # a clean close cut the old records off
        assert [(r.id, r.data) for r in spool.pending()] == new
        assert spool.statistics().torn_bytes_dropped == 0


def test_untagged_records_of_older_spools_are_read_and_their_files_not_reused(
    tmp_path: Path,
) -> None:
    payload = encode_msgpack(traj(1))
    (tmp_path / "000000000003.seg").write_bytes(
        encode_record("old", payload) + encode_record("tagged", payload, segment=3)
    )
    # a frame tagged for another segment is a reused file's leftover: the scan stops there
    (tmp_path / "000000000005.seg").write_bytes(
        encode_record("mine", payload, segment=5) + encode_record("stale", payload, segment=4)
    )
    with Spool(tmp_path, SpoolConfig(recycle_segments=4)) as spool:
        assert sorted(ids(spool)) == ["mine", "old", "tagged"]
        spool.ack(["old", "tagged", "mine"])
        assert [p.name for p in frees(tmp_path)] == ["000000000005.free"]


def test_a_file_still_being_read_is_deleted_not_reused(tmp_path: Path) -> None:
    """A lease's descriptor (payload_ranges) keeps reading the bytes it was given even when
    its segment is acknowledged meanwhile: that file is not overwritten."""
    config = SpoolConfig(segment_bytes=4096, recycle_segments=2)
    old, new = same_size("a", 6), same_size("b", 12)
    with Spool(tmp_path, config) as spool:
        spool.append_many(old)
        spool.flush()
        parts, fds = spool.payload_ranges(["a0003"], bytes)
        spool.ack([rid for rid, _ in old])
        assert segments(tmp_path) == [] and frees(tmp_path) == []
        spool.append_many(new)
        spool.flush()
        assert read_back(parts) == old[3][1]
        spool.release(fds)
        spool.ack([rid for rid, _ in new])
        assert len(frees(tmp_path)) == 2
    with Spool(tmp_path, SpoolConfig(recycle_segments=0)) as spool:
        assert frees(tmp_path) == []  # a smaller pool deletes the rest at open
    with pytest.raises(ConfigError, match="recycle_segments"):
        SpoolConfig(recycle_segments=-1)


# -- the dropped segment ---------------------------------------------------------------------


def test_drop_copies_then_acknowledges_and_survives_reopen(tmp_path: Path) -> None:
    from agentroll.stream.dropped import DROPPED_DIR, read_dropped

    sent = [traj(i) for i in range(4)]
    with Spool(tmp_path) as spool:
        spool.append_many(sent)
        spool.flush()
        assert spool.drop(["t00001", "t00003", "unknown", "t00001"]) == 2
        assert ids(spool) == ["t00000", "t00002"]
        stats = spool.statistics()
        assert (stats.dropped, stats.dropped_records, stats.dropped_evicted) == (2, 2, 0)
        assert stats.dropped_bytes == sum(
            p.stat().st_size for p in (tmp_path / DROPPED_DIR).iterdir()
        )
    kept = list(read_dropped(tmp_path))
    assert [r.data for r in kept] == [encode_msgpack(sent[1]), encode_msgpack(sent[3])]
    with Spool(tmp_path) as spool:  # neither comes back; the dropped segment is still counted
        assert ids(spool) == ["t00000", "t00002"]
        assert spool.statistics().dropped_records == 2
        spool.append(traj(9))
        spool.flush()
        spool.drop(["t00009"])
    assert [r.id for r in read_dropped(tmp_path)] == ["t00001", "t00003", "t00009"]


def test_a_torn_tail_of_the_open_dropped_file_is_cut_at_open(tmp_path: Path) -> None:
    from agentroll.stream.dropped import DROPPED_DIR, read_dropped

    with Spool(tmp_path) as spool:
        spool.append_many([traj(0), traj(1)])
        spool.flush()
        spool.drop(["t00000", "t00001"])
    [open_file] = (tmp_path / DROPPED_DIR).glob("*.seg")  # still open: no count in its name
    with open(open_file, "ab") as f:
        f.write(b"ARS\x01torn")
    assert [r.id for r in read_dropped(tmp_path)] == ["t00000", "t00001"]  # stops at the tear
    with Spool(tmp_path) as spool:
        assert spool.statistics().dropped_records == 2
    assert [p.name for p in (tmp_path / DROPPED_DIR).iterdir()] == ["000000000001-2.seg"]


def test_dropped_retention_by_bytes_and_keeping_none(tmp_path: Path) -> None:
    from agentroll.stream.dropped import read_dropped

    size = len(encode_msgpack(traj(0)))
    cfg = SpoolConfig(dropped_max_bytes=8 * (size + 64))  # files roll at one record each
    with Spool(tmp_path / "a", cfg) as spool:
        spool.append_many([traj(i) for i in range(20)])
        spool.flush()
        for i in range(20):
            spool.drop([f"t{i:05d}"])
        stats = spool.statistics()
        assert stats.dropped == 20 and stats.dropped_bytes <= cfg.dropped_max_bytes
        assert stats.dropped_records + stats.dropped_evicted == 20 and stats.dropped_evicted > 0
    kept = [r.id for r in read_dropped(tmp_path / "a")]
    assert kept == [f"t{i:05d}" for i in range(20 - len(kept), 20)]  # the newest stay
    with Spool(tmp_path / "b", SpoolConfig(dropped_max_records=0)) as spool:
        spool.append(traj(0))
        spool.flush()
        assert spool.drop(["t00000"]) == 1 and len(spool) == 0
        stats = spool.statistics()
        assert (stats.dropped, stats.dropped_records, stats.dropped_evicted) == (1, 0, 1)
    assert list(read_dropped(tmp_path / "b")) == []


@pytest.mark.parametrize("field", ["dropped_max_records", "dropped_max_bytes"])
def test_dropped_limits_are_validated(field: str) -> None:
    with pytest.raises(ConfigError, match=f"SpoolConfig.{field}=-1"):
        SpoolConfig(**{field: -1})
