"""Worker side of the trajectory stream: spool + buffer behind one API (``TrajectoryStream``).

Invariants: a group is fsync'd to the spool before the buffer can offer it (group commit);
an ack is durable before the reply says so; stale drops are copied to the dropped segment,
then acknowledged; at start-up every unacknowledged record is restored into the buffer;
``status()`` is one snapshot consistent with the spool beside it, also mid-commit.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import msgspec

from agentroll.errors import ConfigError, WeightSyncError
from agentroll.rollout.buffer import BufferConfig, Lease, TrajectoryBuffer
from agentroll.stream.http import (
    FileRange,
    HTTPConfig,
    Response,
)
from agentroll.stream.spool import Spool
from agentroll.stream.spool_config import SpoolConfig
from agentroll.stream.wire import (
    MSGPACK,
)
from agentroll.types import Trajectory, decode_msgpack, encode_msgpack

if TYPE_CHECKING:
    from agentroll.weights.transport import UpdateHeader
    from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.stream.server")
_NO_WEIGHTS = (
    "this worker takes no weight updates (no on_weights callback); start it with "
    "TrajectoryStream(..., on_weights=backend_apply)"
)
OnWeights = Callable[["WeightUpdate"], Awaitable[None]]
CheckWeights = Callable[["UpdateHeader"], None]


class StreamConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Static settings of a ``TrajectoryStream`` and its HTTP API.

    ``max_body_bytes``: limit of lease/ack request bodies (413 beyond);
    ``max_weights_bytes``: limit of a weight upload's payloads, judged from its header before
    any payload is read (413 beyond); where the worker knows its model (``check_weights``),
    each tensor's payload is also bounded by its shape, so an update is at most the model's
    bytes (full) or about twice that (delta); ``max_lease``: most trajectories per lease;
    ``max_wait``: longest long-poll a lease may ask for (seconds); ``http``: the HTTP
    server's time limits and connection caps."""

    buffer: BufferConfig = BufferConfig()
    spool: SpoolConfig = SpoolConfig()
    max_body_bytes: int = 1 << 20
    max_weights_bytes: int = 64 << 30
    max_lease: int = 4096
    max_wait: float = 60.0
    http: HTTPConfig = HTTPConfig()

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ConfigError(f"StreamConfig.max_body_bytes={self.max_body_bytes}; use >= 1024")
        if self.max_weights_bytes < 1024:
            raise ConfigError(
                f"StreamConfig.max_weights_bytes={self.max_weights_bytes}; use >= 1024"
            )
        if self.max_lease < 1:
            raise ConfigError(f"StreamConfig.max_lease={self.max_lease}; use >= 1")
        if not (0 <= self.max_wait < math.inf):
            raise ConfigError(f"StreamConfig.max_wait={self.max_wait}; use a finite value >= 0")


@dataclass(eq=False)
class _Job:
    """One unit of group commit: records to append or ids to acknowledge."""

    records: list[tuple[str, bytes]] = field(default_factory=list)
    ack_ids: list[str] = field(default_factory=list)
    future: asyncio.Future[int] | None = None
    result: int = 0
    error: BaseException | None = None


@dataclass(eq=False)
class _Lane:
    """A queue of group-commit jobs and the task committing them."""

    jobs: list[_Job] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


#: a records round is cut after this many payload bytes: the rest waits for the next round
#: (one unbounded round would make its first publishers wait for all of it; on 2026-12-02
#: rounds of 8 and 64 MB streamed no faster than 2 MB, 1 MB about as fast)
_ROUND_BYTES = 2 << 20


def _round(jobs: list[_Job], limit: int) -> tuple[list[_Job], list[_Job]]:
    """``jobs`` split after the first job that brings the payload bytes to ``limit``."""
    size = 0
    for i, job in enumerate(jobs):
        size += sum(len(r[1]) for r in job.records)
        if size >= limit:
            return jobs[: i + 1], jobs[i + 1 :]
    return jobs, []


class _RecordsCommitter:
    """One thread that makes published records durable with no event-loop step in between:
    it appends the queued round (cut at ``_ROUND_BYTES``; one writev), fdatasyncs it, and
    answers the round's callers with one ``call_soon_threadsafe``; what was queued meanwhile
    is the next round, so publishers that arrive during an fdatasync share the next one.

    One thread, not a writer and a syncer overlapping the next round's writev with the last
    one's fdatasync (as until 2026-12-02): with the two, `bench stream` streamed 0.42-0.43 of
    its limit against 0.48-0.49 with one (medians of three alternating series on a 2-core VM;
    11 of 12 pairs better, worker CPU -0.2 s): a hand-off between two threads costs a futex
    wake-up, and the syncer its own trips for the GIL, on every round."""

    def __init__(self, stream: TrajectoryStream, loop: asyncio.AbstractEventLoop) -> None:
        self._stream = stream
        self._loop = loop
        self._cond = threading.Condition(threading.Lock())  # the thread waits: jobs queued
        self._queued: list[_Job] = []
        self._closing = False
        self._done = False
        self._thread = threading.Thread(
            target=self._commit_loop, name="agentroll-spool-commit", daemon=True
        )
        self._thread.start()

    def submit(self, job: _Job) -> None:
        """Queue ``job``; raises RuntimeError once the commit thread has stopped."""
        with self._cond:
            if self._done:
                raise RuntimeError(
                    "the spool's writer thread has stopped (see the log); restart the worker"
                )
            self._queued.append(job)
            self._cond.notify()

    def _commit_loop(self) -> None:
        jobs: list[_Job] = []  # the round in hand: answered, else stranded
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._queued or self._closing)
                    if not self._queued:
                        return
                    jobs, self._queued = _round(self._queued, _ROUND_BYTES)
                try:
                    self._stream._write_records(jobs)
                except Exception as exc:  # disk error: every caller of the round learns it
                    logger.exception("spool write failed")
                    for job in jobs:
                        job.error = job.error or exc
                failed = [job for job in jobs if job.error is not None]
                written = [job for job in jobs if job.error is None]
                if written:
                    try:
                        self._stream.spool.sync_records()
                    except Exception as exc:
                        logger.exception("spool fdatasync failed")
                        for job in written:
                            job.error = exc
                if failed:
                    self._loop.call_soon_threadsafe(self._stream._answer, failed, False)
                if written:
                    self._loop.call_soon_threadsafe(self._stream._answer, written, True)
                jobs = []
        finally:
            with self._cond:
                self._done = True
                stranded, self._queued = jobs + self._queued, []
            if stranded:  # only when the thread died of an unexpected error
                for job in stranded:
                    job.error = RuntimeError(
                        "the spool's writer thread stopped; restart the worker"
                    )
                self._loop.call_soon_threadsafe(self._stream._answer, stranded, False)

    def close(self) -> None:
        """Blocking: commit what is queued, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()


def _takes_policy(fn: Callable[..., Any]) -> bool:
    """Whether ``on_weights`` accepts a ``policy`` keyword (the per-push resume policy)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "policy" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class TrajectoryStream:
    """A spool directory and a ``TrajectoryBuffer`` behind one producer/consumer API.

    ``on_weights`` applies a ``WeightUpdate`` to the worker's backend (raise
    ``WeightSyncError`` to refuse it; a ``policy`` keyword, when it takes one, is the resume
    policy a pusher asked for); ``check_weights`` judges an upload's header frame
    before any payload is read (raise ``WeightSyncError`` to refuse it: wrong base version,
    tensors that do not match the model).  ``clock`` is the buffer's clock (lease ttl).
    At start-up, unacknowledged records are restored grouped by ``group_id`` in spool order;
    a group only partly in the spool (the rest was acknowledged) is restored as what it has.
    Use as ``async with TrajectoryStream(dir) as stream``; the exit drains pending commits
    and closes the spool.

    Publishers share fsyncs (group commit); acks commit in their own lane, so the two fsyncs
    overlap.  A lease's ``trainer_version`` above the newest weights the worker received is
    refused, so no request can make the buffer drop what it holds.  In ``status()``,
    ``published``, ``acked`` and ``dropped_stale`` are what the spool holds, also while a
    commit is half done (``counters`` count callers answered and drops decided, which run a
    commit behind or ahead of the spool)."""

    def __init__(
        self,
        spool_dir: str | Path,
        config: StreamConfig | None = None,
        *,
        on_weights: OnWeights | None = None,
        check_weights: CheckWeights | None = None,
        policy_version: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spool_dir = Path(spool_dir)
        self.config = config or StreamConfig()
        self.on_weights = on_weights
        self.check_weights = check_weights
        self.policy_version = policy_version
        self._clock = clock
        self.buffer = TrajectoryBuffer(self.config.buffer, clock=clock, on_drop=self._on_drop)
        self._spool: Spool | None = None
        self._acks = _Lane()
        self._records: _RecordsCommitter | None = None
        self._drop_ids: list[str] = []
        # what the spool holds, changed by the commit threads with the spool under this lock
        self._tally = threading.Lock()
        self._in_spool = {"published": 0, "acked": 0, "dropped_stale": 0}
        self._closing = False
        self._started = time.monotonic()
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "published",
                "restored",
                "delivered",
                "acked",
                "dropped_stale",
                "group_commits",
                "weight_updates",
                "undecodable",
            ),
            0,
        )

    @property
    def spool(self) -> Spool:
        if self._spool is None:
            raise RuntimeError("TrajectoryStream is not open; use `async with` first")
        return self._spool

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        from agentroll.weights.transport import run_blocking

        self._spool, groups = await run_blocking(self._open)
        self._records = _RecordsCommitter(self, asyncio.get_running_loop())
        self._acks.task = asyncio.create_task(self._commit_acks_loop(), name="agentroll-spool-acks")
        restored = self.buffer.restore(groups)
        self.counters["restored"] = restored
        if restored:
            logger.info("restored %d unacknowledged trajectories from %s", restored, self.spool_dir)
        return self

    def _open(self) -> tuple[Spool, list[list[Trajectory]]]:
        spool = Spool(self.spool_dir, self.config.spool)
        by_group: dict[str, list[Trajectory]] = {}
        chunks: list[list[Trajectory]] = []
        size = self.config.buffer.group_size
        for rec in spool.pending():
            try:
                traj = decode_msgpack(rec.data, Trajectory)
            except (msgspec.MsgspecError, ValueError) as exc:
                # intact but unreadable (written by another version): left in the spool
                logger.error("spool record %s cannot be decoded (%s); skipped", rec.id, exc)
                self.counters["undecodable"] += 1
                continue
            entry = by_group.get(traj.group_id)
            if entry is None or len(entry) >= size:  # a reused group id: next chunk
                entry = by_group[traj.group_id] = []
                chunks.append(entry)
            entry.append(traj)
        return spool, chunks

    async def __aexit__(self, *exc_info: object) -> None:
        from agentroll.weights.transport import run_blocking

        self._closing = True
        self._acks.wake.set()
        task = self._acks.task
        try:
            if task is not None:
                await asyncio.shield(task)
        finally:
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait({task})
            if self._records is not None:
                await run_blocking(self._records.close)
            if self._spool is not None:
                await run_blocking(self._spool.close)

    # -- group commit ----------------------------------------------------------------------

    async def _submit(self, job: _Job) -> int:
        lane = self._acks
        if self._closing or lane.task is None or self._records is None:
            raise RuntimeError("TrajectoryStream is closed or not open; use `async with`")
        job.future = asyncio.get_running_loop().create_future()
        if job.records:
            self._records.submit(job)
        else:
            lane.jobs.append(job)
            lane.wake.set()
        return await job.future

    def _answer(self, jobs: list[_Job], committed: bool) -> None:
        """On the event loop: tell each job's caller its result (or error)."""
        if committed:
            self.counters["group_commits"] += 1
        for job in jobs:
            assert job.future is not None
            if job.future.done():
                continue
            if job.error is not None:
                job.future.set_exception(job.error)
            else:
                job.future.set_result(job.result)

    async def _commit_acks_loop(self) -> None:
        """Commit queued acks (and stale drops) together, one fsync of the ack log per
        round (another file than the records': the two fsyncs overlap)."""
        from agentroll.weights.transport import run_blocking

        lane = self._acks
        while True:
            await lane.wake.wait()
            lane.wake.clear()
            while lane.jobs or self._drop_ids:
                jobs, lane.jobs = lane.jobs, []
                drops, self._drop_ids = self._drop_ids, []
                try:
                    await run_blocking(self._commit_acks, jobs, drops)
                except Exception as exc:  # disk error: every waiting caller learns it
                    logger.exception("spool ack commit failed")
                    for job in jobs:
                        job.error = job.error or exc
                self._answer(jobs, True)
                if self.spool.collectable():
                    # deleting acknowledged segments (tens of ms each) happens after the
                    # callers were answered, between ack commits
                    try:
                        await run_blocking(self.spool.collect)
                    except Exception:
                        logger.exception("deleting acknowledged spool segments failed")
            if self._closing:
                return

    def _write_records(self, jobs: list[_Job]) -> None:
        """In the commit thread: append every job's records with one writev (not yet
        durable: the fdatasync after it makes them so); a job whose id was published before
        fails."""
        spool = self.spool
        with self._tally:
            try:  # one writev for the whole round
                spool.append_many([record for job in jobs for record in job.records])
            except ValueError:  # an id published before: only its job fails
                for job in jobs:
                    try:
                        spool.append_many(job.records)
                    except ValueError as exc:
                        job.error = ValueError(f"{exc} (published before)")
            self._in_spool["published"] += sum(len(j.records) for j in jobs if j.error is None)

    def _commit_acks(self, jobs: list[_Job], drops: list[str]) -> None:
        """In a thread: record every ack (and stale drop), then one fsync of the ack log."""
        spool = self.spool
        with self._tally:
            for job in jobs:
                job.result = spool.ack(job.ack_ids, sync=False)
                self._in_spool["acked"] += job.result
            if drops:  # one the trainer acknowledged meanwhile stays counted as acked
                # copied to the dropped segment (durable) before the ack lets it go
                self._in_spool["dropped_stale"] += spool.drop(drops, sync=False)
        spool.sync_acks(collect=False)

    def _on_drop(self, trajectories: list[Trajectory]) -> None:
        for t in trajectories:
            self._drop_ids.append(t.id)
        self.counters["dropped_stale"] += len(trajectories)
        self._acks.wake.set()

    # -- producer / consumer ---------------------------------------------------------------

    async def publish(self, group: Sequence[Trajectory]) -> None:
        """Make ``group`` durable in the spool (sharing fsyncs with concurrent publishers),
        then queue it, waiting while the buffer is full (back-pressure).  Raises ValueError
        for a malformed group or an id published before.  If cancelled while waiting for
        buffer space, the (already durable) group is queued anyway so it is not stranded."""
        group = list(group)
        if len(group) != self.config.buffer.group_size:
            raise ValueError(
                f"a group must hold exactly {self.config.buffer.group_size} trajectories "
                f"(BufferConfig.group_size), got {len(group)}"
            )
        # the records are not kept: a lease reads them back from the spool (page cache)
        await self._submit(_Job(records=[(t.id, encode_msgpack(t)) for t in group]))
        # counted once durable: a publish cancelled while waiting for buffer space (worker
        # shutdown) still left its group in the spool, which lost_count counts as pending
        self.counters["published"] += len(group)
        try:
            await self.buffer.put(group)
        except asyncio.CancelledError:
            self.buffer.restore([group])
            raise

    def check_trainer_version(self, version: int | None) -> None:
        """Raise ValueError when ``version`` is above the newest weights this worker received
        (``policy_version``): staleness is measured against it, and a version no weights
        had would make the buffer drop everything it holds and every group after it."""
        if version is not None and version > self.policy_version:
            raise ValueError(
                f"trainer_version={version} is above the newest weights this worker received "
                f"(version {self.policy_version}); send the version of the last weights you "
                "pushed (GET /v1/status: policy_version), not a step count, and push newer "
                "weights (POST /v1/weights) before you report them"
            )

    async def lease(
        self, max_trajectories: int, *, wait: float = 0.0, trainer_version: int | None = None
    ) -> Lease | None:
        """Lease whole groups (up to ``max_trajectories``), waiting up to ``wait`` seconds;
        None if none came.  See ``TrajectoryBuffer.lease``.  Raises ValueError for a
        ``trainer_version`` above ``policy_version`` (``check_trainer_version``)."""
        self.check_trainer_version(trainer_version)
        lease = await self.buffer.lease(
            max_trajectories, timeout=wait, trainer_version=trainer_version
        )
        if lease is not None:
            self.counters["delivered"] += len(lease.trajectories)
        return lease

    def lease_response(self, lease: Lease, head: bytes) -> Response:
        """A 200 whose body is ``head``, then the stored msgpack of each leased trajectory,
        sent from the spool's segment files with sendfile (not read into memory; one
        acknowledged meanwhile is encoded again)."""
        by_id = {t.id: t for t in lease.trajectories}
        found, fds = self.spool.payload_ranges(list(by_id), lambda rid: encode_msgpack(by_id[rid]))
        parts: list[bytes | memoryview | FileRange] = [head]
        parts += [p if isinstance(p, bytes) else FileRange(*p) for p in found]
        # the descriptors go back to the spool once sent: until then their files are not reused
        return Response(200, parts, MSGPACK, on_close=functools.partial(self.spool.release, fds))

    async def ack(self, ids: Iterable[str]) -> int:
        """Acknowledge trajectories: they leave the buffer and, durably before this returns,
        the spool.  Returns how many left the spool; unknown ids are ignored."""
        ids = list(dict.fromkeys(ids))
        self.buffer.ack(ids)
        acked = await self._submit(_Job(ack_ids=ids))
        self.counters["acked"] += acked
        return acked

    def check_upload(self, header: UpdateHeader) -> None:
        """Judge an upload from its header frame, before any payload byte is read: raises
        ``WeightSyncError`` when there is no ``on_weights`` or ``check_weights`` refused it."""
        if self.on_weights is None:
            raise WeightSyncError(_NO_WEIGHTS)
        if self.check_weights is not None:
            self.check_weights(header)

    async def apply_weights(self, update: WeightUpdate, *, policy: str | None = None) -> None:
        """Apply ``update`` through ``on_weights``, then make its version the policy and the
        buffer's trainer version (re-checking staleness).  ``policy``: the resume policy the
        pusher asks for (``keep``/``recompute``/``restart``), passed to an ``on_weights``
        that takes a ``policy`` keyword; None leaves the worker's own.  Raises
        ``WeightSyncError`` when there is no ``on_weights``, it refused the update, or a
        policy was asked of an ``on_weights`` that cannot take one."""
        if self.on_weights is None:
            raise WeightSyncError(_NO_WEIGHTS)
        if policy is None:
            await self.on_weights(update)
        elif _takes_policy(self.on_weights):
            await self.on_weights(update, policy=policy)  # type: ignore[call-arg]
        else:
            raise WeightSyncError(
                f"this worker applies weights with its own resume policy; push without "
                f"policy={policy!r}"
            )
        self.policy_version = update.version
        self.counters["weight_updates"] += 1
        if update.version > self.buffer.statistics().trainer_version:
            self.buffer.set_trainer_version(update.version)

    # -- observability ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Buffer and spool statistics, versions, counters and uptime (JSON-ready).  In
        ``stream``, ``published``, ``acked`` and ``dropped_stale`` are read with the spool's
        figures under one lock: records appended (durable or being fsync'd), acks and stale
        drops applied to the spool, so ``published + restored + undecodable - acked -
        dropped_stale == spool records`` holds in every snapshot."""
        self.buffer.expire()
        buffer = msgspec.to_builtins(self.buffer.statistics())
        with self._tally:
            stream = {**self.counters, **self._in_spool}
            spool = msgspec.to_builtins(self.spool.statistics())
        return {
            "uptime_s": time.monotonic() - self._started,
            "policy_version": self.policy_version,
            "trainer_version": buffer["trainer_version"],
            "stream": stream,
            "buffer": buffer,
            "spool": spool,
        }

    def metrics(self) -> str:
        """Prometheus text exposition (``agentroll_`` prefix)."""
        status = self.status()
        lines: list[str] = []
        declared: set[str] = set()

        def emit(name: str, kind: str, value: float, labels: str = "") -> None:
            if name not in declared:
                declared.add(name)
                lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{labels} {float(value):g}")

        emit("agentroll_uptime_seconds", "gauge", status["uptime_s"])
        emit("agentroll_policy_version", "gauge", status["policy_version"])
        emit("agentroll_trainer_version", "gauge", status["trainer_version"])
        for key, value in status["stream"].items():
            emit(f"agentroll_stream_{key}_total", "counter", value)
        gauges = {"queued", "leased", "capacity", "waiting_producers", "open_leases"}
        spool_gauges = {"records", "bytes", "segments", "ack_log_bytes"}
        spool_gauges |= {"dropped_records", "dropped_bytes"}
        for key, value in status["buffer"].items():
            if key == "staleness":
                for k, n in value.items():
                    emit("agentroll_buffer_staleness_total", "counter", n, f'{{staleness="{k}"}}')
            elif isinstance(value, int | float) and key != "trainer_version":
                kind = "gauge" if key in gauges else "counter"
                emit(f"agentroll_buffer_{key}{'_total' if kind == 'counter' else ''}", kind, value)
        for key, value in status["spool"].items():
            kind = "gauge" if key in spool_gauges else "counter"
            emit(f"agentroll_spool_{key}{'_total' if kind == 'counter' else ''}", kind, value)
        return "\n".join(lines) + "\n"
