"""The durable spool: finished trajectories on disk until a trainer acknowledges them.

Invariants: a record is durable once ``flush`` returned; on open a torn or corrupt tail of
every segment is truncated, counted and logged, so ``pending`` yields only checked records;
an acknowledged record is never yielded again, and its segment goes (or is kept for reuse)
once every record in it is acknowledged durably; a stale drop is copied before its ack.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import msgspec

from agentroll._fs import fsync_path
from agentroll.errors import ConfigError
from agentroll.stream.dropped import DROPPED_DIR, _DroppedLog
from agentroll.stream.segment import (
    _RECORD,
    _SEGMENT_SUFFIX,
    _encode_ack,
    _frame_head,
    _preallocate,
    _record_id,
    _reserve_to,
    _retire_file,
    _scan_acks,
    _scan_records,
    _Segment,
)
from agentroll.stream.spool_config import SpoolConfig, SpoolRecord, SpoolStats
from agentroll.types import Trajectory, encode_msgpack

logger = logging.getLogger("agentroll.stream.spool")

ACK_LOG = "acks.log"
LOCK_FILE = "LOCK"
_WRITEV_RECORDS = 300  # 3 buffers per record: under IOV_MAX (1024)
_FREE_SUFFIX = ".free"  # a fully acknowledged segment's file kept for reuse


class Spool:
    """An open spool directory (created if missing); one process at a time (``ConfigError``
    if another process holds it).  Use as a context manager or call ``close``.

    A directory of append-only segment files (``segment``) plus an ack log.  A fully
    acknowledged segment's file is kept for reuse (``SpoolConfig.recycle_segments``): a new
    segment then overwrites blocks that are already allocated, so an fsync writes data
    without a journal commit for the file's size and blocks.  ``drop`` copies stale records
    to the dropped segment (``dropped/``, the same frames; ``read_dropped`` reads it), makes
    the copy durable, and only then acknowledges them.

    Methods are synchronous and thread-safe: one lock guards the index and is held for
    little file I/O (the ack log's small writes, a rollover, the fsync of
    ``ack(sync=True)``); appends take turns on a second lock and write outside the first, so
    a read or an ack never waits for an append's write, nor for ``collect``'s unlinks.
    Async callers run them in a thread.

    Raises ``OSError`` from the filesystem as is (disk full, permissions)."""

    def __init__(self, path: str | Path, config: SpoolConfig | None = None) -> None:
        self.path = Path(path)
        self.config = config or SpoolConfig()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._stats = SpoolStats()
        self._lock_fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._lock_fd)
            raise ConfigError(
                f"spool {self.path} is in use by another process; give each worker its own "
                "spool directory (or stop the other worker first)"
            ) from exc
        self._segments: dict[int, _Segment] = {}
        self._pending: dict[str, tuple[int, int, int]] = {}  # id -> (segment, offset, length)
        self._unflushed: set[str] = set()
        self._syncing: set[str] = set()  # being fsync'd by sync_records (lock not held)
        self._active: _Segment | None = None
        self._fd: int | None = None
        self._append_lock = threading.Lock()  # one appender at a time (writes outside _lock)
        self._writing: _Segment | None = None  # the segment an append is writing to
        self._unlinking = 0  # forgotten segments whose files collect() is deleting
        self._read_fds: dict[int, int] = {}  # segment -> O_RDONLY fd (reading payloads)
        self._lent: dict[int, int] = {}  # fd -> segment, dups payload_ranges handed out
        self._free: list[Path] = []  # files of acknowledged segments kept for reuse
        self._freeing = 0  # ... and ones collect() is renaming into that pool
        self._next_segment = 1
        self._ack_dirty = False
        self._closed = False
        self._dropped: _DroppedLog | None = None
        try:
            self._recover()
            self._dropped = _DroppedLog(self.path / DROPPED_DIR, self.config)
        except BaseException:
            self.close()
            raise

    # -- open / recovery -------------------------------------------------------------------

    def _recover(self) -> None:
        ack_path = self.path / ACK_LOG
        acked: set[str] = set()
        if ack_path.exists():
            data = ack_path.read_bytes()
            ids, good = _scan_acks(data)
            acked.update(ids)
            if good < len(data):
                self._truncate(ack_path, good, len(data) - good, "ack log")
        # reusable files: their numbers are never given again (their old records are tagged
        # with them); beyond the pool's size they are deleted
        free = sorted(
            (int(p.name[: -len(_FREE_SUFFIX)]), p)
            for p in self.path.glob(f"*{_FREE_SUFFIX}")
            if p.name[: -len(_FREE_SUFFIX)].isdigit()
        )
        for number, _ in free:
            self._next_segment = max(self._next_segment, number + 1)
        keep = len(free) - self.config.recycle_segments
        for _, free_path in free[: max(0, keep)]:
            free_path.unlink(missing_ok=True)
        self._free = [free_path for _, free_path in free[max(0, keep) :]]
        numbers = sorted(
            int(p.name[: -len(_SEGMENT_SUFFIX)])
            for p in self.path.glob(f"*{_SEGMENT_SUFFIX}")
            if p.name[: -len(_SEGMENT_SUFFIX)].isdigit()
        )
        for number in numbers:
            seg_path = self._segment_path(number)
            data = seg_path.read_bytes()
            records, good, torn, untagged = _scan_records(data, number)
            if good < len(data):
                self._stats.torn_records_dropped += torn
                self._truncate(seg_path, good, len(data) - good, "segment")
            else:
                # records a killed process wrote but did not fsync are about to be offered:
                # make them durable first, and give back what it reserved past them
                with open(seg_path, "r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
                self._stats.fsyncs += 1
            seg = self._segments[number] = _Segment(number, seg_path, good, recyclable=not untagged)
            for rid, offset, length in records:
                if rid in acked:
                    seg.acked.add(rid)
                elif rid not in self._pending:
                    seg.live += 1
                    self._pending[rid] = (number, offset, length)
            self._next_segment = max(self._next_segment, number + 1)
        self._ack_fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._stats.ack_log_bytes = os.fstat(self._ack_fd).st_size
        # acks written by a killed process may sit in the page cache only: make them durable
        # before deleting the segments they cover
        os.fsync(self._ack_fd)
        fsync_path(self.path)
        self._stats.fsyncs += 1
        for seg in list(self._segments.values()):
            if seg.live == 0 and seg is not self._writing:
                self._delete_segment(seg)
        if self._stats.ack_log_bytes > self.config.compact_ack_log_bytes:
            self._compact_ack_log()
        self._refresh_stats()
        if self._pending:
            logger.info("spool %s: %d unacknowledged records", self.path, len(self._pending))

    def _truncate(self, path: Path, good: int, dropped: int, what: str) -> None:
        logger.warning(
            "spool %s: dropped a torn or corrupt tail of %d bytes from %s %s",
            self.path,
            dropped,
            what,
            path.name,
        )
        with open(path, "r+b") as f:
            f.truncate(good)
            os.fsync(f.fileno())
        self._stats.fsyncs += 1
        self._stats.torn_bytes_dropped += dropped

    def _segment_path(self, number: int) -> Path:
        return self.path / f"{number:012d}{_SEGMENT_SUFFIX}"

    # -- writing ---------------------------------------------------------------------------

    def append(self, item: Trajectory | tuple[str, bytes]) -> None:
        """Append one trajectory (or ``(id, encode_msgpack(trajectory))``).  The record is
        written to the OS (it survives a killed process, not a power loss) and becomes
        durable at the next ``flush``.  Raises ``ValueError`` if the id is already pending."""
        self.append_many([item])

    def append_many(self, items: Iterable[Trajectory | tuple[str, bytes]]) -> None:
        """Append several records as ``append`` does, with one ``writev`` per segment (and
        per ~300 records) instead of one per record: a thread writing a group commit gives
        the GIL up a few times, not once per record (each time it waits up to the switch
        interval to get it back).  Raises ``ValueError``, with nothing written, if an id is
        already pending or repeated, or a record is too large."""
        framed: list[tuple[str, bytes, bytes]] = []  # (id, id as utf-8, payload)
        for item in items:
            if isinstance(item, Trajectory):
                rid, payload = item.id, encode_msgpack(item)
            else:
                rid, payload = item
            framed.append((rid, _record_id(rid, payload), payload))
        if len({rid for rid, _, _ in framed}) != len(framed):
            raise ValueError("the same trajectory id twice in one append; ids must be unique")
        limit = self.config.segment_bytes
        auto = False
        # appenders take turns; the spool lock is not held while the bytes are written, so
        # reads (a lease's payload_ranges), acks and fsyncs go on meanwhile
        with self._append_lock:
            with self._lock:
                self._check_open()
                dup = next((rid for rid, _, _ in framed if rid in self._pending), None)
                if dup is not None:
                    raise ValueError(
                        f"trajectory {dup!r} is already in the spool; ids must be unique"
                    )
            i = 0
            while i < len(framed):
                with self._lock:
                    self._check_open()
                    seg = self._active
                    if seg is None or seg.size >= limit:
                        seg = self._open_segment()
                    assert self._fd is not None
                    j, end = i, seg.size
                    while j < len(framed) and j - i < _WRITEV_RECORDS and (j == i or end < limit):
                        end += _RECORD.size + len(framed[j][1]) + len(framed[j][2])
                        j += 1
                    fd = os.dup(self._fd)  # an ack may delete the segment and close _fd
                    self._writing = seg  # ... but not this one: _collect skips it
                if end > seg.reserved:  # only appenders touch .reserved, and they take turns
                    reach = _reserve_to(seg.reserved, end, limit)
                    _preallocate(fd, seg.reserved, reach - seg.reserved)
                    seg.reserved = reach
                # frames are tagged with the segment's number (known only now)
                parts: list[bytes] = []
                for _, rid_bytes, payload in framed[i:j]:
                    parts += (_frame_head(rid_bytes, payload, seg.number), rid_bytes, payload)
                try:
                    # at the segment's end, not the file's: a recycled file is longer
                    written = os.pwritev(fd, parts, seg.size)
                    if written < end - seg.size:  # a short write (signal, full disk)
                        rest = b"".join(parts)[written:]
                        at = seg.size + written
                        while rest:
                            n = os.pwrite(fd, rest, at)
                            rest, at = rest[n:], at + n
                except BaseException:
                    with self._lock:  # a partial record may end the segment: start a new one
                        self._writing = None
                        seg.size = max(seg.size, limit)
                    raise
                finally:
                    os.close(fd)
                with self._lock:
                    self._writing = None
                    offset = seg.size
                    for rid, rid_bytes, payload in framed[i:j]:
                        self._pending[rid] = (
                            seg.number,
                            offset + _RECORD.size + len(rid_bytes),
                            len(payload),
                        )
                        offset += _RECORD.size + len(rid_bytes) + len(payload)
                        self._unflushed.add(rid)
                    seg.live += j - i
                    self._stats.appended += j - i
                    self._stats.bytes += offset - seg.size
                    seg.size = offset
                    self._stats.records = len(self._pending)
                    auto = 0 < self.config.sync_every <= len(self._unflushed)
                i = j
        if auto:
            self.flush()

    def _open_segment(self) -> _Segment:
        if self._fd is not None:
            # records of the closing segment are made durable before it stops being active;
            # every unflushed record lives in the active segment
            os.fdatasync(self._fd)
            self._stats.fsyncs += 1
            self._trim(self._fd, self._active)
            os.close(self._fd)
            self._fd = None
            self._unflushed.clear()
        number = self._next_segment
        self._next_segment += 1
        path = self._segment_path(number)
        if self._free:  # overwrite a file whose blocks are allocated (see SpoolConfig)
            os.rename(self._free.pop(), path)
            self._fd = os.open(path, os.O_WRONLY)
        else:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fsync_path(self.path)  # the new file's name is durable before any record in it
        seg = self._active = self._segments[number] = _Segment(number, path, 0)
        self._stats.segments = len(self._segments)
        return seg

    @staticmethod
    def _trim(fd: int, seg: _Segment | None) -> None:
        """Cut a recycled file's old records past ``seg``'s own (they would fail their checks
        at the next open anyway, but be reported as a torn tail), and give back the disk
        blocks reserved past them (a same-size truncate releases them)."""
        if seg is not None:
            os.ftruncate(fd, seg.size)

    def _free_path(self, number: int) -> Path:
        return self.path / f"{number:012d}{_FREE_SUFFIX}"

    def _reusable(self, seg: _Segment) -> bool:
        """Under the lock: whether ``seg``'s file may join the pool (room there, only tagged
        records in it, and no descriptor lent by ``payload_ranges`` still reading it)."""
        room = len(self._free) + self._freeing < self.config.recycle_segments
        return room and seg.recyclable and seg.number not in self._lent.values()

    def flush(self, *, collect: bool = True) -> None:
        """Make every appended record and every ack durable (fsync), then (with ``collect``)
        delete segments whose records are all acknowledged.  One fsync per file that
        changed.  ``collect=False`` leaves the deletions (an unlink of a big segment takes
        tens of ms) to a later ``collect()``, e.g. after the callers were told "durable"."""
        self.sync_records()
        self.sync_acks(collect=collect)

    def sync_records(self) -> None:
        """Make every record appended before this call durable (fdatasync of the active
        segment, outside the lock: appends and acks go on meanwhile; concurrent with
        ``sync_acks`` in another thread, the two fsyncs overlap)."""
        with self._lock:
            self._check_open()
            if not self._unflushed or self._fd is None:
                self._unflushed.clear()  # nothing written since, or its segment is gone
                return
            batch, self._unflushed = self._unflushed, set()
            self._syncing |= batch
            fd = os.dup(self._fd)  # a rollover may close self._fd meanwhile
        try:
            os.fdatasync(fd)
        except BaseException:
            with self._lock:
                self._unflushed |= {rid for rid in batch if rid in self._pending}
            raise
        finally:
            os.close(fd)
            with self._lock:
                self._syncing -= batch
        with self._lock:
            self._stats.fsyncs += 1

    def sync_acks(self, *, collect: bool = True) -> None:
        """Make every recorded ack durable (fsync of the ack log, outside the lock), then
        with ``collect`` delete the segments whose records are all acknowledged."""
        with self._lock:
            self._check_open()
            fd = os.dup(self._ack_fd) if self._ack_dirty else None
            self._ack_dirty = False
        if fd is not None:
            try:
                os.fsync(fd)
            except BaseException:
                with self._lock:
                    self._ack_dirty = True
                raise
            finally:
                os.close(fd)
            with self._lock:
                self._stats.fsyncs += 1
        if collect:
            with self._lock:
                self._sync_acks(collect=False)  # acks recorded meanwhile, if any
                self._collect()

    def collectable(self) -> bool:
        """Whether ``collect`` has a fully acknowledged segment to delete."""
        with self._lock:
            return any(seg.live == 0 for seg in self._segments.values())

    def collect(self) -> None:
        """Make pending acks durable, delete every fully acknowledged segment and compact
        the ack log if it is due (what ``flush`` does after its fsyncs).  The files are
        unlinked outside the lock (tens of ms for a big one): reads, acks and appends go on
        meanwhile; the ack log keeps their acks until they are gone."""
        with self._lock:
            self._check_open()
            self._sync_acks(collect=False)
            doomed = [
                seg for seg in self._segments.values() if seg.live == 0 and seg is not self._writing
            ]
            plan: list[tuple[_Segment, Path | None]] = []
            for seg in doomed:
                self._delete_segment(seg, unlink=False)
                reuse = self._reusable(seg)
                self._freeing += reuse
                plan.append((seg, self._free_path(seg.number) if reuse else None))
            self._unlinking += len(doomed)
        try:
            for seg, free in plan:
                retired = False
                try:
                    _retire_file(seg, free)
                    retired = True
                finally:
                    if free is not None:  # its pool slot was reserved above
                        with self._lock:
                            self._freeing -= 1
                            if retired:  # renamed into the pool
                                self._free.append(free)
        finally:
            with self._lock:
                self._unlinking -= len(doomed)
                due = self._stats.ack_log_bytes > self.config.compact_ack_log_bytes
                if due and not self._closed:
                    self._compact_ack_log()

    # -- acknowledging ---------------------------------------------------------------------

    def drop(self, ids: Iterable[str], *, sync: bool = True) -> int:
        """Acknowledge records dropped as stale, after copying them to the dropped segment
        (durable before the ack is written; see ``read_dropped``); returns how many were
        pending (others are ignored).  ``sync`` as in ``ack``.  A crash between the copy and
        the ack leaves the record pending and copied: it is offered again, and a second drop
        copies it a second time."""
        with self._lock:
            self._check_open()
            copies: list[tuple[str, bytes]] = []
            for rid in dict.fromkeys(ids):
                loc = self._pending.get(rid)
                if loc is not None:
                    number, offset, length = loc
                    copies.append((rid, os.pread(self._read_fd(number), length, offset)))
        if not copies:
            return 0
        assert self._dropped is not None
        self._dropped.append(copies)  # durable before the acks that let the originals go
        return self.ack([rid for rid, _ in copies], sync=sync)

    def ack(self, ids: Iterable[str], *, sync: bool = True) -> int:
        """Acknowledge records by id; returns how many were pending (unknown or already
        acknowledged ids are ignored).  With ``sync`` the ack is durable on return and fully
        acknowledged segments are deleted; otherwise that happens at the next ``flush``."""
        with self._lock:
            self._check_open()
            known: list[str] = []
            for rid in ids:
                loc = self._pending.pop(rid, None)
                if loc is None:
                    continue
                known.append(rid)
                self._unflushed.discard(rid)
                self._syncing.discard(rid)
                seg = self._segments[loc[0]]
                seg.live -= 1
                seg.acked.add(rid)
            if known:
                frame = _encode_ack(known)
                os.write(self._ack_fd, frame)
                self._stats.ack_log_bytes += len(frame)
                self._stats.acked += len(known)
                self._stats.records = len(self._pending)
                self._ack_dirty = True
            if sync:
                self._sync_acks()
            return len(known)

    def _sync_acks(self, *, collect: bool = True) -> None:
        if not self._ack_dirty:
            return
        os.fsync(self._ack_fd)
        self._stats.fsyncs += 1
        self._ack_dirty = False
        if collect:
            self._collect()

    def _collect(self) -> None:
        """Under the lock, with every recorded ack durable."""
        for seg in list(self._segments.values()):
            if seg.live == 0 and seg is not self._writing:
                self._delete_segment(seg)
        if self._stats.ack_log_bytes > self.config.compact_ack_log_bytes:
            self._compact_ack_log()

    def _delete_segment(self, seg: _Segment, *, unlink: bool = True) -> None:
        """Under the lock: forget ``seg`` (and unlink its file unless the caller does)."""
        if seg is self._active:
            if self._fd is not None:
                os.close(self._fd)
            self._fd = None
            self._active = None
        fd = self._read_fds.pop(seg.number, None)
        if fd is not None:
            os.close(fd)
        if unlink:
            free = self._free_path(seg.number) if self._reusable(seg) else None
            _retire_file(seg, free)
            if free is not None:
                self._free.append(free)
        del self._segments[seg.number]
        self._stats.bytes -= seg.size
        self._stats.segments = len(self._segments)

    def _compact_ack_log(self) -> None:
        """Rewrite the ack log with only the acks of records still stored (atomic rename);
        not while forgotten segments are still being unlinked (their acks stay needed)."""
        if self._unlinking:
            return
        keep = [rid for seg in self._segments.values() for rid in sorted(seg.acked)]
        frame = _encode_ack(keep) if keep else b""
        if len(frame) * 2 > self._stats.ack_log_bytes:
            return  # rewriting would not shrink it much; wait for segments to go
        ack_path = self.path / ACK_LOG
        tmp = ack_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(frame)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, ack_path)
        fsync_path(self.path)
        os.close(self._ack_fd)
        self._ack_fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND)
        self._stats.fsyncs += 2
        self._stats.ack_log_bytes = len(frame)
        self._stats.ack_log_compactions += 1

    # -- reading ---------------------------------------------------------------------------

    def pending(self) -> Iterator[SpoolRecord]:
        """Every durable, unacknowledged record in append order (records appended since the
        last ``flush`` are skipped; records acknowledged while iterating may still appear)."""
        with self._lock:
            self._check_open()
            locs = [
                (rid, loc)
                for rid, loc in self._pending.items()
                if rid not in self._unflushed and rid not in self._syncing
            ]
        fds: dict[int, int] = {}
        try:
            for rid, (number, offset, length) in locs:
                fd = fds.get(number)
                if fd is None:
                    try:
                        fd = fds[number] = os.open(self._segment_path(number), os.O_RDONLY)
                    except FileNotFoundError:
                        continue  # every record in it was acknowledged meanwhile
                data = os.pread(fd, length, offset)
                if len(data) == length:
                    yield SpoolRecord(rid, data)
        finally:
            for fd in fds.values():
                os.close(fd)

    def payload_ranges(
        self, ids: Sequence[str], fallback: Callable[[str], bytes]
    ) -> tuple[list[bytes | tuple[int, int, int]], list[int]]:
        """Where the stored payload of each of ``ids`` is, in order, for ``sendfile``:
        ``(fd, offset, length)`` in a segment file, or ``fallback(id)`` for an id that is not
        pending (acknowledged meanwhile); and the descriptors used, ``dup``s the caller
        closes with ``release`` (a segment deleted meanwhile stays readable through them, and
        one they read from is not reused).  Meant for records a ``flush`` made durable."""
        with self._lock:
            self._check_open()
            dups: dict[int, int] = {}
            parts: list[bytes | tuple[int, int, int]] = []
            try:
                for rid in ids:
                    loc = self._pending.get(rid)
                    if loc is None:
                        parts.append(fallback(rid))
                        continue
                    number, offset, length = loc
                    fd = dups.get(number)
                    if fd is None:
                        fd = dups[number] = os.dup(self._read_fd(number))
                        self._lent[fd] = number  # its file is not reused until released
                    parts.append((fd, offset, length))
            except BaseException:
                for fd in dups.values():
                    self._lent.pop(fd, None)
                    os.close(fd)
                raise
            return parts, list(dups.values())

    def release(self, fds: Iterable[int]) -> None:
        """Close descriptors that ``payload_ranges`` handed out, once what they were read for
        is sent: until then their segments' files are deleted rather than reused."""
        fds = list(fds)
        with self._lock:
            for fd in fds:
                self._lent.pop(fd, None)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _read_fd(self, number: int) -> int:
        """Under the lock: the segment's read descriptor (closed when it is deleted)."""
        fd = self._read_fds.get(number)
        if fd is None:
            fd = self._read_fds[number] = os.open(self._segment_path(number), os.O_RDONLY)
        return fd

    def __contains__(self, rid: object) -> bool:
        return rid in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def statistics(self) -> SpoolStats:
        """A snapshot of the counters."""
        with self._lock:
            self._refresh_stats()
            return msgspec.structs.replace(self._stats)

    def _refresh_stats(self) -> None:
        self._stats.records = len(self._pending)
        self._stats.segments = len(self._segments)
        self._stats.bytes = sum(s.size for s in self._segments.values())
        if self._dropped is not None:
            moved, held, size, evicted = self._dropped.statistics()
            self._stats.dropped, self._stats.dropped_records = moved, held
            self._stats.dropped_bytes, self._stats.dropped_evicted = size, evicted

    # -- lifecycle -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"spool {self.path} is closed")

    def close(self) -> None:
        """Flush and release the directory (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                for fd in self._read_fds.values():
                    os.close(fd)
                self._read_fds.clear()
                if self._fd is not None:
                    if self._unflushed:
                        os.fdatasync(self._fd)
                    self._trim(self._fd, self._active)
                    os.close(self._fd)
                    self._fd = None
                if hasattr(self, "_ack_fd"):
                    if self._ack_dirty:
                        os.fsync(self._ack_fd)
                    os.close(self._ack_fd)
                if self._dropped is not None:
                    self._dropped.close()
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
