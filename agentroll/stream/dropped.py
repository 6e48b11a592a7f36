"""The spool's dropped segment: stale-dropped records kept for inspection, within limits.

Invariants: ``append`` returns once the copies are fdatasync'd (before the spool writes the
acks that let the originals go); the newest ``dropped_max_records`` / ``dropped_max_bytes``
are kept, the oldest removed a whole file at a time, and both are counted; ``read_dropped``
only reads, so it is safe while a worker holds the spool.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentroll._fs import fsync_path
from agentroll.stream.segment import _SEGMENT_SUFFIX, _frame_head, _record_id, _scan_records
from agentroll.stream.spool_config import SpoolConfig, SpoolRecord

logger = logging.getLogger("agentroll.stream.spool")


DROPPED_DIR = "dropped"  # stale-dropped records, kept for inspection up to a retention limit


def _dropped_files(path: Path) -> list[tuple[int, int | None, Path]]:
    """The dropped segment's files in order: ``(number, records or None, path)``; a closed
    file's name carries its record count (``<number>-<records>.seg``), the open one's not."""
    out: list[tuple[int, int | None, Path]] = []
    for p in path.glob(f"*{_SEGMENT_SUFFIX}"):
        stem = p.name[: -len(_SEGMENT_SUFFIX)]
        number, _, count = stem.partition("-")
        if number.isdigit() and (not count or count.isdigit()):
            out.append((int(number), int(count) if count else None, p))
    return sorted(out, key=lambda f: f[0])


def read_dropped(spool_dir: str | Path) -> Iterator[SpoolRecord]:
    """The records a spool dropped as stale and still keeps, oldest first (a torn tail, or a
    file retention removes meanwhile, ends that file's part).  Safe while a worker holds the
    spool: it only reads."""
    for number, _, path in _dropped_files(Path(spool_dir) / DROPPED_DIR):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        records, _, _, _ = _scan_records(data, number)
        view = memoryview(data)
        for rid, offset, length in records:
            yield SpoolRecord(rid, bytes(view[offset : offset + length]))


class _DroppedLog:
    """The dropped segment: append-only files of stale-dropped records under ``path``, the
    oldest removed, a file at a time, beyond the retention limits.  Thread-safe."""

    def __init__(self, path: Path, config: SpoolConfig) -> None:
        self.path = path
        self.config = config
        self._lock = threading.Lock()  # held across a write and its fdatasync
        self._counts = threading.Lock()  # only while the counters change: statistics never
        # waits for an fdatasync (the spool's lock is held while it reads them)
        self.moved = 0  # records appended by this process
        self.evicted = 0  # records retention removed (or, with a limit of 0, never kept)
        self.records = 0  # records held now
        self.bytes = 0  # size of the files
        self._files: list[list[Any]] = []  # [number, records, bytes, path], oldest first
        self._fd: int | None = None  # the open (last) file
        self._next = 1
        # a file is closed at an eighth of a limit: retention removes no more than that
        self._roll_records = max(1, config.dropped_max_records // 8)
        self._roll_bytes = max(4096, config.dropped_max_bytes // 8)
        if path.is_dir():
            self._recover()

    def _recover(self) -> None:
        for number, count, path in _dropped_files(self.path):
            self._next = max(self._next, number + 1)
            if count is None:  # the file that was open: count it, cut a torn tail, close it
                data = path.read_bytes()
                records, good, _, _ = _scan_records(data, number)
                if good < len(data):
                    with open(path, "r+b") as f:
                        f.truncate(good)
                count = len(records)
                closed = path.with_name(f"{number:012d}-{count}{_SEGMENT_SUFFIX}")
                os.rename(path, closed)
                path = closed
            self._files.append([number, count, path.stat().st_size, path])
        self._count()
        self._retain()

    def _count(self, moved: int = 0, evicted: int = 0) -> None:
        with self._counts:
            self.moved += moved
            self.evicted += evicted
            self.records = sum(f[1] for f in self._files)
            self.bytes = sum(f[2] for f in self._files)

    def statistics(self) -> tuple[int, int, int, int]:
        """``(moved, records, bytes, evicted)``, one snapshot."""
        with self._counts:
            return self.moved, self.records, self.bytes, self.evicted

    def append(self, records: list[tuple[str, bytes]]) -> None:
        """Write ``records`` (``(id, payload)``) and fdatasync them; then apply retention."""
        with self._lock:
            if self.config.dropped_max_records == 0 or self.config.dropped_max_bytes == 0:
                self._count(moved=len(records), evicted=len(records))  # kept none: counted
                return
            i = 0
            while i < len(records):
                entry = self._open()
                number = entry[0]
                parts: list[bytes] = []
                j = i
                while j < len(records) and (j == i or entry[1] + j - i < self._roll_records):
                    rid, payload = records[j]
                    rid_bytes = _record_id(rid, payload)
                    parts += (_frame_head(rid_bytes, payload, number), rid_bytes, payload)
                    j += 1
                assert self._fd is not None
                data = b"".join(parts)
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view) :]
                os.fdatasync(self._fd)
                entry[1] += j - i
                entry[2] += len(data)
                if entry[1] >= self._roll_records or entry[2] >= self._roll_bytes:
                    self._close()
                i = j
            self._count(moved=len(records))
            self._retain()

    def _open(self) -> list[Any]:
        if self._fd is not None:
            return self._files[-1]
        self.path.mkdir(exist_ok=True)
        number = self._next
        self._next += 1
        path = self.path / f"{number:012d}{_SEGMENT_SUFFIX}"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        fsync_path(self.path)  # the file's name is durable before the acks its records allow
        entry: list[Any] = [number, 0, 0, path]
        self._files.append(entry)
        return entry

    def _close(self) -> None:
        """Close the open file and name it with its record count."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        entry = self._files[-1]
        closed = entry[3].with_name(f"{entry[0]:012d}-{entry[1]}{_SEGMENT_SUFFIX}")
        os.rename(entry[3], closed)
        entry[3] = closed

    def _retain(self) -> None:
        """Remove the oldest files while the segment holds more than a limit allows."""
        cfg = self.config
        while self._files and (
            self.records > cfg.dropped_max_records or self.bytes > cfg.dropped_max_bytes
        ):
            if len(self._files) == 1:
                self._close()
            _, count, _, path = self._files.pop(0)
            path.unlink(missing_ok=True)
            self._count(evicted=count)
            logger.info(
                "spool %s: retention removed %d dropped records (%s)", self.path, count, path.name
            )

    def close(self) -> None:
        with self._lock:
            self._close()
