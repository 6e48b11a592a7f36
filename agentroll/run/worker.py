"""Rollout worker: an environment's tasks on one backend, stoppable at any moment.

Invariants: every task ends up in the output exactly once (tasks already written or
checkpointed are skipped); a trajectory is fsynced before its checkpoint is deleted; an
episode whose checkpoint is refused as corrupt restarts from its task under its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import struct
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from agentroll.backends.base import Backend
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment
from agentroll.errors import ConfigError
from agentroll.rollout.checkpoint import EpisodeCheckpoint, EpisodeJob, scan_checkpoints
from agentroll.rollout.engine import RolloutConfig, RolloutEngine, StopReport
from agentroll.types import (
    Task,
    Trajectory,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
)

logger = logging.getLogger("agentroll.run.worker")
_FRAME = struct.Struct("<I")  # msgpack output: each record is prefixed by its length
STOP_GRACE = 3.0  # seconds a blocked event loop has to take up a stop signal


def _ignore(signum: int, frame: object) -> None:
    """The Python-level handler: the signal is acted on by the watcher thread."""


@contextlib.contextmanager
def stop_on_signals(
    stop: asyncio.Event,
    signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    *,
    grace: float = STOP_GRACE,
) -> Iterator[None]:
    """While inside, each of ``signals`` sets ``stop`` on the running event loop (the
    graceful stop).  A watcher thread hears the signal through the wakeup fd even while the
    loop is blocked (a hook that never yields, start-up work); if the loop has not run the
    stop within ``grace`` seconds, the process exits at once with status 128 + the signal's
    number: a stop signal is never ignored.  Enter it with the loop running on the main
    thread (else ``ConfigError``); leaving restores the previous handlers and wakeup fd.
    """
    if not signals:
        yield
        return
    loop = asyncio.get_running_loop()
    wanted = {int(sig) for sig in signals}
    acted, leaving = threading.Event(), threading.Event()
    r, w = os.pipe()
    os.set_blocking(w, False)  # the C signal handler must never block on it
    previous: dict[int, Any] = {}
    old_fd: int | None = None

    def take_up() -> None:  # on the loop: the loop is alive, the graceful stop begins
        acted.set()
        stop.set()

    def watch() -> None:
        while not leaving.is_set():
            data = os.read(r, 512)
            heard = [b for b in data if b]  # 0 is the wake-up of leaving
            if old_fd is not None and old_fd >= 0 and heard:
                with contextlib.suppress(OSError):  # whoever listened before still hears
                    os.write(old_fd, bytes(heard))
            for signum in (b for b in heard if b in wanted):
                with contextlib.suppress(RuntimeError):  # the loop is closed: we are leaving
                    loop.call_soon_threadsafe(take_up)
                if not acted.wait(grace) and not leaving.is_set():
                    name = signal.Signals(signum).name
                    os.write(
                        2,
                        f"agentroll: {name}: the event loop did not take up the stop within "
                        f"{grace:g} s (it is blocked); exiting without a checkpoint\n".encode(),
                    )
                    os._exit(128 + signum)

    watcher = threading.Thread(target=watch, name="agentroll-stop-signals", daemon=True)
    try:
        try:
            old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            for sig in signals:
                previous[int(sig)] = signal.signal(sig, _ignore)
        except ValueError as exc:  # not the main thread
            raise ConfigError(
                f"cannot handle {', '.join(signal.Signals(s).name for s in signals)} here "
                f"({exc}); run the worker on the main thread's event loop or pass "
                "stop_signals=()"
            ) from exc
        watcher.start()
        try:
            yield
        finally:
            leaving.set()
            acted.set()  # a signal heard just now needs no exit: we are stopping anyway
            with contextlib.suppress(BlockingIOError):  # a full pipe wakes it anyway
                os.write(w, b"\0")
            watcher.join()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        if old_fd is not None:
            signal.set_wakeup_fd(old_fd)
        os.close(r)
        os.close(w)


@dataclass
class WorkerResult:
    """What one worker run did."""

    written: int  # trajectories appended to the output by this run
    checkpointed: int  # in-flight episodes written to the checkpoint directory
    resumed: int  # checkpoints this run continued
    skipped: int  # tasks skipped because they were already in the output
    stopped: bool  # a signal stopped the run before every task finished
    out: Path
    checkpoint_dir: Path
    checkpoints_corrupt: int = 0  # checkpoints refused; their episodes restarted from the task

    def line(self) -> str:
        status = "stopped" if self.stopped else "done"
        return (
            f"worker status={status} checkpointed={self.checkpointed} written={self.written} "
            f"resumed={self.resumed} skipped={self.skipped} "
            f"checkpoints_corrupt={self.checkpoints_corrupt} out={self.out} "
            f"checkpoint_dir={self.checkpoint_dir}"
        )


def _is_msgpack(path: Path) -> bool:
    return path.suffix in (".msgpack", ".mpk")


def _records(data: bytes, msgpack: bool) -> tuple[list[bytes], int]:
    """Complete records of an output file's bytes and the length they span (a record cut
    short by a crash is left out)."""
    out: list[bytes] = []
    pos = 0
    if msgpack:
        while pos + _FRAME.size <= len(data):
            (size,) = _FRAME.unpack_from(data, pos)
            if pos + _FRAME.size + size > len(data):
                break
            out.append(data[pos + _FRAME.size : pos + _FRAME.size + size])
            pos += _FRAME.size + size
        return out, pos
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            return out, pos
        if end > pos:
            out.append(data[pos:end])
        pos = end + 1


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """The trajectories of a worker output file (``.jsonl``, or ``.msgpack`` frames); a
    record cut short by a crash is ignored.  Raises ``ValueError`` for a damaged record."""
    p = Path(path)
    if not p.exists():
        return []
    msgpack = _is_msgpack(p)
    records, _ = _records(p.read_bytes(), msgpack)
    out = []
    for i, rec in enumerate(records):
        try:
            out.append(decode_msgpack(rec, Trajectory) if msgpack else decode_json(rec, Trajectory))
        except Exception as exc:  # msgspec errors, bad arrays
            raise ValueError(f"{p}: record {i + 1} is not a trajectory ({exc})") from exc
    return out


class TrajectoryWriter:
    """Appends trajectories to ``path`` (JSON lines, or length-prefixed msgpack for a
    ``.msgpack`` name), each one flushed and fsynced before ``write`` returns.  Opening
    drops a record a crash cut short."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.msgpack = _is_msgpack(self.path)
        self._file: Any = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            data = self.path.read_bytes()
            _, end = _records(data, self.msgpack)
            if end < len(data):
                logger.warning(
                    "dropping %d bytes of a record cut short in %s", len(data) - end, self.path
                )
                with open(self.path, "r+b") as f:
                    f.truncate(end)
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by close()

    def write(self, traj: Trajectory) -> None:
        if self.msgpack:
            body = encode_msgpack(traj)
            data = _FRAME.pack(len(body)) + body
        else:
            data = encode_json(traj) + b"\n"
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _plan(
    env: Environment, tasks: list[Task], out: Path, cp_dir: Path
) -> tuple[list[Task], list[EpisodeCheckpoint], list[EpisodeJob], int, int]:
    """Which tasks to start, which checkpoints to continue, which episodes to restart
    (their checkpoint was refused), how many tasks are done and how many checkpoints were
    refused (blocking I/O: run it in a thread); deletes checkpoints whose episode is already
    in the output, refused ones whose task is unknown (the task list runs it again) and the
    temp directories of checkpoints a crash left half-written."""
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ConfigError("the worker's tasks must have unique ids (they key the output)")
    try:
        checkpoints, corrupt = scan_checkpoints(cp_dir)
        done = read_trajectories(out)
    except ValueError as exc:
        raise ConfigError(f"cannot continue: {exc}") from exc
    done_ids = {t.id for t in done}
    done_tasks = {t.task_id for t in done}
    restarts = []
    for bad in corrupt:
        job = bad.job
        if job is not None and job.episode_id not in done_ids and job.task.id not in done_tasks:
            logger.warning("%s; restarting episode %s from its task", bad.error, job.episode_id)
            restarts.append(job)
            continue
        if job is None:  # a task of the list that is not done is in ``todo``: it runs afresh
            logger.warning("%s; its task is unknown too: the task list runs it again", bad.error)
        shutil.rmtree(bad.path, ignore_errors=True)
    fresh = []
    for cp in checkpoints:
        if cp.env_name != env.name:
            raise ConfigError(
                f"{cp_dir / cp.episode_id} is a checkpoint of environment {cp.env_name!r}, "
                f"not {env.name!r}; start the worker with the environment that wrote it"
            )
        if cp.episode_id in done_ids:  # finished and written, but not yet deleted
            shutil.rmtree(cp_dir / cp.episode_id, ignore_errors=True)
        else:
            fresh.append(cp)
    for leftover in cp_dir.glob(".*.tmp*") if cp_dir.is_dir() else ():
        shutil.rmtree(leftover, ignore_errors=True)
    busy = {cp.task.id for cp in fresh} | {job.task.id for job in restarts}
    todo = [t for t in tasks if t.id not in done_tasks and t.id not in busy]
    return todo, fresh, restarts, sum(t.id in done_tasks for t in tasks), len(corrupt)


class Sink(Protocol):
    """Where a rollout worker's finished groups go (a file, the trajectory stream)."""

    async def deliver(self, group: list[Trajectory]) -> None:
        """Make ``group`` (whole, by sample index) durable; it is delivered once done."""

    async def leave(self, consumer: asyncio.Task[None]) -> None:
        """At a stop, after the checkpoint: let ``consumer`` finish what it must deliver,
        then cancel it and wait for it."""

    async def save(self, saved: StopReport) -> None:
        """Keep what the stop handed back for the next start (or know how to recompute it)."""


async def drive(
    engine: RolloutEngine,
    sink: Sink,
    stop: asyncio.Event,
    tasks: Iterable[Task],
    *,
    checkpoint_dir: Path,
    checkpoints: Iterable[EpisodeCheckpoint] = (),
    finished: Iterable[Trajectory] = (),
    unstarted: Iterable[EpisodeJob] = (),
    admit: Callable[[int], Awaitable[None]] | None = None,
    with_kv: bool = True,
    timeout: float = 60.0,
) -> StopReport | None:
    """The rollout worker's loop, whatever its sink: whole groups from the engine to
    ``sink`` until the tasks run out (returns None) or ``stop`` is set; then the engine's
    stop protocol (checkpoint, ``sink.leave``, hand back) and ``sink.save``; returns the
    stop's report.  An engine error surfaces here."""
    groups = engine.run_groups(
        tasks, checkpoints=checkpoints, finished=finished, unstarted=unstarted, admit=admit
    )

    async def consume() -> None:
        async with contextlib.aclosing(cast(AsyncGenerator[list[Trajectory], None], groups)):
            async for group in groups:
                await sink.deliver(group)

    consumer = asyncio.create_task(consume())
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({consumer, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if consumer.done():
            consumer.result()
            return None
        logger.info("worker: stopping; checkpointing in-flight episodes")
        saved = await engine.stop(
            checkpoint_dir,
            leave=lambda: sink.leave(consumer),
            with_kv=with_kv,
            timeout=timeout,
        )
        await sink.save(saved)
        return saved
    finally:
        stopper.cancel()
        if not consumer.done():
            consumer.cancel()
        await asyncio.gather(consumer, stopper, return_exceptions=True)


class FileSink:
    """Appends trajectories to the worker's output file; a continued episode's checkpoint
    goes once its trajectory is on disk.  Nothing to save at a stop: the next start derives
    what is left from the output and the checkpoints (``_plan``)."""

    def __init__(
        self,
        writer: TrajectoryWriter,
        result: WorkerResult,
        resumed_paths: dict[str, Path],
        engine: RolloutEngine,
        timeout: float,
    ) -> None:
        self.writer, self.result, self.resumed_paths = writer, result, resumed_paths
        self.engine, self.timeout = engine, timeout
        self._written = asyncio.Event()

    async def deliver(self, group: list[Trajectory]) -> None:
        for traj in group:
            await asyncio.to_thread(self.writer.write, traj)
            self.result.written += 1
            self._written.set()
            path = self.resumed_paths.pop(traj.id, None)
            if path is not None:
                await asyncio.to_thread(shutil.rmtree, path, True)

    async def leave(self, consumer: asyncio.Task[None]) -> None:
        # episodes that finished while the engine quiesced are written too: a write is never
        # cancelled halfway (its thread would go on beside the next one)
        async with asyncio.timeout(self.timeout):
            while self.result.written < self.engine.stats["episodes"] and not consumer.done():
                self._written.clear()
                await self._written.wait()
        consumer.cancel()
        await asyncio.wait({consumer})

    async def save(self, saved: StopReport) -> None:
        self.result.checkpointed, self.result.stopped = len(saved.checkpoints), True


async def run_worker(
    env: Environment,
    backend: Backend,
    *,
    out: str | Path,
    checkpoint_dir: str | Path,
    tasks: Iterable[Task] | None = None,
    config: RolloutConfig | None = None,
    tokenizer: ChatTokenizer | None = None,
    with_kv: bool = True,
    stop_signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    checkpoint_timeout: float = 60.0,
    stop_grace: float = STOP_GRACE,
) -> WorkerResult:
    """Run ``tasks`` (default ``env.tasks()``) of ``env`` on ``backend`` (started and closed
    here), appending finished trajectories to ``out``; continue the checkpoints found in
    ``checkpoint_dir`` first.

    One of ``stop_signals`` (handlers installed by ``stop_on_signals`` for the duration; pass
    ``()`` for none) pauses the engine, checkpoints every in-flight episode (the KV cache of
    a paused generation too unless ``with_kv`` is false; the next worker then recomputes
    it), waits until every trajectory that finished is written and returns with
    ``stopped=True``.  A checkpoint refused as corrupt (``CheckpointError``, logged) restarts
    its episode from its task, counted in ``checkpoints_corrupt``.  Raises ``ConfigError``
    for an output file it cannot read, a checkpoint of another environment, duplicate task
    ids or ``samples_per_task != 1``;
    ``TimeoutError`` when in-flight tool calls do not finish within ``checkpoint_timeout``
    seconds.  A signal the event loop does not take up within ``stop_grace`` seconds (it is
    blocked) ends the process at once (see ``stop_on_signals``).  On cancellation the
    episodes are cancelled and nothing is checkpointed.
    """
    cfg = config or RolloutConfig()
    if cfg.samples_per_task != 1:
        raise ConfigError("the worker runs one sample per task; set samples_per_task=1")
    out_path, cp_dir = Path(out), Path(checkpoint_dir)
    task_list = list(env.tasks() if tasks is None else tasks)
    todo, fresh, restarts, skipped, corrupt = await asyncio.to_thread(
        _plan, env, task_list, out_path, cp_dir
    )
    logger.info(
        "worker: continuing %d checkpointed episodes, starting %d tasks (%d already done)",
        len(fresh),
        len(todo),
        skipped,
    )
    resumed_paths = {cp.episode_id: cp_dir / cp.episode_id for cp in fresh}
    resumed_paths.update({job.episode_id: cp_dir / job.episode_id for job in restarts})
    result = WorkerResult(0, 0, len(fresh), skipped, False, out_path, cp_dir, corrupt)
    writer = TrajectoryWriter(out_path)
    await asyncio.to_thread(writer.open)

    stop = asyncio.Event()
    signals = contextlib.ExitStack()
    try:
        signals.enter_context(stop_on_signals(stop, stop_signals, grace=stop_grace))
        async with backend, RolloutEngine(backend, env, cfg, tokenizer=tokenizer) as engine:
            sink = FileSink(writer, result, resumed_paths, engine, checkpoint_timeout)
            await drive(
                engine,
                sink,
                stop,
                todo,
                checkpoint_dir=cp_dir,
                checkpoints=fresh,
                unstarted=restarts,
                with_kv=with_kv,
                timeout=checkpoint_timeout,
            )
    finally:
        signals.close()
        await asyncio.to_thread(writer.close)
    return result


def run_worker_sync(env: Environment, backend: Backend, **kwargs: Any) -> WorkerResult:
    """``run_worker`` on a new event loop (for scripts and the CLI)."""
    return asyncio.run(run_worker(env, backend, **kwargs))


__all__ = [
    "TrajectoryWriter",
    "WorkerResult",
    "read_trajectories",
    "run_worker",
    "run_worker_sync",
    "stop_on_signals",
]


def main_worker(
    *,
    env: str,
    backend: str,
    model: str | None,
    device: str,
    num_tasks: int | None,
    seed: int,
    out: str,
    checkpoint_dir: str,
    with_kv: bool,
    concurrency: int,
    max_tokens: int,
    batch_invariant: bool,
    mock_latency: float,
) -> WorkerResult:
    """``agentroll worker``: build the environment and backend named on the command line
    and run ``run_worker`` until done or stopped by SIGTERM / SIGINT."""
    import itertools

    from agentroll.backends.base import SamplingParams
    from agentroll.env import load_environment
    from agentroll.run.recipe import EnvironmentSection, RolloutSection, SamplingSection

    try:  # the recipe's bounds of the same settings
        EnvironmentSection.bounds["num_tasks"].check("--tasks", num_tasks)
        RolloutSection.bounds["concurrency"].check("--concurrency", concurrency)
        SamplingSection.bounds["max_tokens"].check("--max-tokens", max_tokens)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if backend == "mock" and model is not None:
        raise ConfigError("--model is for the torch backend; drop it with --backend mock")
    environment = load_environment(env)
    tasks = list(itertools.islice(environment.tasks(), num_tasks))
    gen: Backend
    if backend == "mock":
        from agentroll.backends.mock import MockBackend
        from agentroll.model.tokenizer import tiny_chat_tokenizer

        gen = MockBackend(
            ["Answer: 0"], tokenizer=tiny_chat_tokenizer(), latency=mock_latency, chunk_size=1
        )
    else:
        from agentroll.backends.torch import TorchBackend
        from agentroll.model.tiny import ensure_tiny_model

        gen = TorchBackend(ensure_tiny_model(model), device=device, batch_invariant=batch_invariant)
    config = RolloutConfig(
        concurrency=concurrency, seed=seed, sampling=SamplingParams(max_tokens=max_tokens)
    )
    return run_worker_sync(
        environment,
        gen,
        out=out,
        checkpoint_dir=checkpoint_dir,
        tasks=tasks,
        config=config,
        with_kv=with_kv,
    )
