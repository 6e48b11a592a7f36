"""``agentroll bench stream``: end-to-end trajectory streaming MB/s against its limits.

A worker process publishes into a real spool served on 127.0.0.1 and this process consumes
as a trainer does (A), against the limits (B: a loopback socket copy and a write + fsync of
the same bytes), in ``--pairs`` alternating pairs.  The main ratio is ``mb_per_s /
limit_mb_per_s`` per pair: ``ratio_min``/``ratio_max`` (see ``run_stream_bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from agentroll.bench.pairs import DEFAULT_PAIRS, alternate, check_pairs, paired_ratio
from agentroll.errors import ConfigError
from agentroll.progress import Progress, ProgressMode
from agentroll.rollout.buffer import BufferConfig
from agentroll.stream.api import serve_stream
from agentroll.stream.auth import ensure_token, load_token
from agentroll.stream.client import StreamClient
from agentroll.stream.server import StreamConfig, TrajectoryStream
from agentroll.stream.wire import WireFormat
from agentroll.types import Message, ToolCall, Trajectory, Turn, encode_msgpack

MAX_PAIRS = 99  # run prefixes ("m07", "f07") have a fixed width: a run's sizes are known
_PREFIX_LEN = 3
_JSON_PREFIX = "jsn"
POOL = 64  # distinct trajectories; runs publish copies under fresh ids
CAPACITY = 4096  # worker buffer capacity (trajectories)
_MB = 1e6


def synthetic_trajectory(
    index: int, tokens: int, *, turns: int = 4, prefix: str = "traj", group_size: int = 1
) -> Trajectory:
    """A realistic finished trajectory: ``tokens`` per-token entries (prompt, then ``turns``
    turns of sampled tokens and tool replies), messages and tool calls; deterministic in
    ``index``.  Its id is ``f"{prefix}-{index:08d}"``; ``group_size`` consecutive indices
    share a group."""
    if tokens < 2 * turns + 1:
        raise ConfigError(f"tokens={tokens} is too few for {turns} turns; use >= {2 * turns + 1}")
    rng = np.random.default_rng(index)
    prompt = tokens // 8
    bounds = np.linspace(prompt, tokens, turns + 1).astype(int)
    loss_mask = np.zeros(tokens, np.uint8)
    turn_list = []
    for k in range(turns):
        start, end = int(bounds[k]), int(bounds[k + 1])
        gen_end = start + max(1, (end - start) * 2 // 3)
        loss_mask[start:gen_end] = 1
        turn_list.append(
            Turn(
                index=k,
                gen_start=start,
                gen_end=gen_end,
                env_end=end,
                finish_reason="tool_calls" if k < turns - 1 else "stop",
                text=f"step {k}: let me run the tests",
                tool_calls=[ToolCall(id=f"call{k}", name="shell", arguments={"cmd": "pytest -q"})],
                gen_seconds=0.5,
                tool_seconds=0.2,
            )
        )
    sampled = loss_mask.astype(bool)
    logprobs = np.where(sampled, -rng.exponential(0.7, tokens), np.nan).astype(np.float32)
    version = np.where(sampled, 7, -1)
    group = index // group_size
    return Trajectory(
        id=f"{prefix}-{index:08d}",
        task_id=f"task-{group:06d}",
        group_id=f"{prefix}-group-{group:08d}",
        sample_index=index % group_size,
        seed=index,
        env_name="bench",
        reward=float(rng.random()),
        prompt_len=prompt,
        token_ids=rng.integers(0, 151_000, tokens, dtype=np.int32),
        logprobs=logprobs,
        loss_mask=loss_mask,
        policy_version=version,
        kv_version=np.where(sampled, 6, -1),
        turns=turn_list,
        messages=[Message(role="user", content="Fix the failing test in the repository.")]
        + [Message(role="assistant", content=t.text, tool_calls=t.tool_calls) for t in turn_list],
        started_at=1.0e9,
        finished_at=1.0e9 + 12.5,
    )


@dataclass
class StreamBenchResult:
    """Figures of one ``run_stream_bench``; ``line()`` is the result line."""

    published: int
    delivered: int
    traj_per_s: float
    mb_per_s: float
    json_mb_per_s: float
    raw_tcp_mb_per_s: float
    disk_mb_per_s: float
    full_decode_mb_per_s: float = math.nan  # a consumer that decodes turns and messages too
    seconds: float = math.nan  # wall time of the median msgpack run
    worker_cpu_s: float = math.nan  # CPU of the worker process during it (nan: not on Linux)
    consumer_cpu_s: float = math.nan  # CPU of this (consuming) process during it
    runs: int = 1  # msgpack runs the medians are taken over
    pairs: int = 1  # (limits, streams) pairs
    ratio_min: float = math.nan  # of mb_per_s / limit_mb_per_s over the pairs
    ratio_max: float = math.nan

    @property
    def limit_mb_per_s(self) -> float:
        return min(self.raw_tcp_mb_per_s, self.disk_mb_per_s)

    def line(self) -> str:
        return (
            f"traj_per_s={self.traj_per_s:.1f} mb_per_s={self.mb_per_s:.1f} "
            f"json_mb_per_s={self.json_mb_per_s:.1f} raw_tcp_mb_per_s={self.raw_tcp_mb_per_s:.1f} "
            f"disk_mb_per_s={self.disk_mb_per_s:.1f} limit_mb_per_s={self.limit_mb_per_s:.1f} "
            f"full_decode_mb_per_s={self.full_decode_mb_per_s:.1f} "
            f"seconds={self.seconds:.2f} worker_cpu_s={self.worker_cpu_s:.2f} "
            f"consumer_cpu_s={self.consumer_cpu_s:.2f} runs={self.runs} pairs={self.pairs} "
            f"ratio_min={self.ratio_min:.3f} ratio_max={self.ratio_max:.3f}"
        )


def _pool(size: int, tokens: int, turns: int) -> list[Trajectory]:
    return [synthetic_trajectory(i, tokens, turns=turns) for i in range(size)]


def _instance(pool: list[Trajectory], prefix: str, index: int, group_size: int) -> Trajectory:
    """Trajectory ``index`` of a run: a pool entry under a fresh id (arrays shared)."""
    return msgspec.structs.replace(
        pool[index % len(pool)],
        id=f"{prefix}-{index:08d}",
        group_id=f"{prefix}-group-{index // group_size:08d}",
        sample_index=index % group_size,
    )


# -- worker process ------------------------------------------------------------------------


def worker_main(spool_dir: str, tokens: int, turns: int, group_size: int, publishers: int) -> None:
    """The bench's worker process: prints ``url <URL>``, then for each stdin line
    ``prepare <prefix> <n>`` builds ``n`` trajectories (what episodes would have produced:
    not part of the stream, so not timed) and prints ``prepared <n>``; ``publish <prefix>
    <n>`` publishes them and prints ``published <n>``; ``stop`` (or end of input) exits."""
    asyncio.run(_worker(spool_dir, tokens, turns, group_size, publishers))


async def _worker(
    spool_dir: str, tokens: int, turns: int, group_size: int, publishers: int
) -> None:
    pool = _pool(POOL, tokens, turns)
    config = StreamConfig(
        buffer=BufferConfig(capacity=CAPACITY, max_staleness=None, group_size=group_size),
        max_lease=CAPACITY,
    )
    # the spool's parent is the bench's run directory: the consumer reads the token there
    token = ensure_token(Path(spool_dir).parent, None)
    async with (
        TrajectoryStream(spool_dir, config) as stream,
        serve_stream(stream, token=token) as url,
    ):
        print(f"url {url}", flush=True)
        groups: list[list[Trajectory]] = []
        while True:
            words = (await asyncio.to_thread(sys.stdin.readline)).split()
            if len(words) != 3 or words[0] not in ("prepare", "publish"):
                return
            prefix, n = words[1], int(words[2])
            if words[0] == "prepare":
                groups = [
                    [
                        _instance(pool, prefix, g * group_size + k, group_size)
                        for k in range(group_size)
                    ]
                    for g in range(n // group_size)
                ]
                # a real worker does not hold every future trajectory: keep the cyclic GC
                # from walking them again and again while they wait to be published
                gc.freeze()
                print(f"prepared {n}", flush=True)
                continue

            async def publish(worker: int, todo: list[list[Trajectory]] = groups) -> None:
                for g in range(worker, len(todo), publishers):
                    await stream.publish(todo[g])

            async with asyncio.TaskGroup() as tg:
                for w in range(publishers):
                    tg.create_task(publish(w))
            groups = []
            gc.unfreeze()
            print(f"published {n}", flush=True)


# -- consumer ------------------------------------------------------------------------------


async def _consume(
    url: str,
    token: str,
    fmt: WireFormat,
    n: int,
    sizes: list[int],
    lease_max: int,
    progress: Progress,
    conversation: bool = False,
) -> int:
    """Consume until ``n`` distinct trajectories came; returns their msgpack bytes."""
    seen: set[str] = set()
    nbytes = 0
    async with StreamClient(url, token=token, format=fmt, conversation=conversation) as client:
        # closing the generator completes the ack it has in flight
        async with contextlib.aclosing(
            client.batches(max=lease_max, wait=10.0, auto_ack=True)
        ) as batches:
            async for batch in batches:
                for t in batch:
                    if t.id in seen:
                        raise AssertionError(f"trajectory {t.id} delivered twice")
                    seen.add(t.id)
                    nbytes += sizes[int(t.id.rsplit("-", 1)[1]) % len(sizes)]
                progress.advance(len(batch))  # per batch: a rich bar update costs microseconds
                if len(seen) >= n:
                    break
        await client.ack(t.id for t in batch)  # the loop left before auto-acking the last one
        status = await client.status()
    if len(seen) != n:
        raise AssertionError(f"delivered {len(seen)} of {n} trajectories")
    if status["spool"]["records"]:
        raise AssertionError(f"{status['spool']['records']} records left in the spool")
    return nbytes


def _process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) that process ``pid`` used so far; nan where
    ``/proc`` is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tcp_copy_mb_per_s(block: bytes, total: int) -> float:
    """Plain socket copy of ``total`` bytes (``block`` repeated) over 127.0.0.1, MB/s."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = 0

    def receive() -> None:
        nonlocal received
        conn, _ = server.accept()
        with conn:
            buf = bytearray(1 << 20)
            while (n := conn.recv_into(buf)) > 0:
                received += n

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        start = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sent = 0
            while sent < total:
                piece = memoryview(block)[: total - sent]
                sock.sendall(piece)
                sent += len(piece)
    finally:
        thread.join()
        server.close()
    elapsed = time.perf_counter() - start
    if received != total:
        raise AssertionError(f"loopback copy received {received} of {total} bytes")
    return total / elapsed / _MB


def _disk_mb_per_s(records: list[bytes], total: int, directory: Path) -> float:
    """Sequential write of ``total`` bytes, one ``write`` per record as the spool does, then
    one fsync, MB/s."""
    path = directory / "bench-disk.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        start = time.perf_counter()
        written = 0
        while written < total:
            for record in records:
                written += os.write(fd, record[: total - written])
                if written >= total:
                    break
        os.fsync(fd)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    return total / elapsed / _MB


@dataclass
class _Run:
    """One timed run of ``run_stream_bench`` and the limits measured right before it."""

    fmt: WireFormat
    conversation: bool  # the consumer decoded turns and messages too
    count: int
    seconds: float
    nbytes: int
    worker_cpu_s: float
    consumer_cpu_s: float
    tcp_mb_per_s: float = math.nan
    disk_mb_per_s: float = math.nan

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / self.seconds / _MB

    @property
    def limit_mb_per_s(self) -> float:
        return min(self.tcp_mb_per_s, self.disk_mb_per_s)


def _lower_median(runs: list[_Run]) -> _Run:
    """The median run by MB/s; for an even count the lower one (never the better of two)."""
    return sorted(runs, key=lambda r: r.mb_per_s)[(len(runs) - 1) // 2]


@dataclass(frozen=True, slots=True)
class _Payload:
    """What every run streams and the limits copy: the msgpack records of the pool, their
    sizes, the records joined (the loopback copy sends it repeated) and a run's total bytes."""

    records: list[bytes]
    sizes: list[int]
    block: bytes
    total: int


def _payload(n: int, tokens: int, turns: int, group_size: int) -> _Payload:
    pool = _pool(POOL, tokens, turns)
    # every run's prefix has the same length (``_PREFIX_LEN``), so trajectory i of any run is
    # pool[i % POOL] with a msgpack size of sizes[i % POOL] exactly
    records = [encode_msgpack(_instance(pool, _JSON_PREFIX, i, group_size)) for i in range(POOL)]
    sizes = [len(r) for r in records]
    total = sum(sizes[i % POOL] for i in range(n))
    return _Payload(records, sizes, b"".join(records), total)


def _check_sizes(
    trajectories: int,
    tokens: int,
    group_size: int,
    lease_max: int,
    publishers: int,
    json_fraction: float,
    pairs: int,
    flag: str,
) -> None:
    if min(trajectories, tokens, group_size, lease_max, publishers) < 1:
        raise ConfigError(
            "trajectories, tokens, group_size, lease_max and publishers must all be >= 1"
        )
    check_pairs(pairs, flag)
    if pairs > MAX_PAIRS:
        raise ConfigError(f"{flag}={pairs}; use at most {MAX_PAIRS}")
    if not 0 < json_fraction <= 1:
        raise ConfigError(f"json_fraction={json_fraction}; use a value in (0, 1]")
    if lease_max > CAPACITY:
        raise ConfigError(f"lease_max={lease_max}; use at most {CAPACITY}")


class _WorkerProcess:
    """The bench's worker process (``worker_main``) and the consumer's side of its stdin /
    stdout protocol; ``run`` times one publish-and-consume.  Killed on exit if still up."""

    def __init__(
        self, root: Path, tokens: int, turns: int, group_size: int, publishers: int
    ) -> None:
        args = (str(root / "spool"), tokens, turns, group_size, publishers)
        code = f"from agentroll.bench.stream import worker_main; worker_main{args!r}"
        self.root = root
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.url = ""
        self.token = ""

    def __enter__(self) -> _WorkerProcess:
        try:
            line = self._read()
            if len(line) != 2 or line[0] != "url":
                raise RuntimeError(f"the bench worker did not start (exit {self.proc.wait()})")
        except BaseException:
            self.__exit__()
            raise
        self.url = line[1]
        self.token = load_token(self.root, env=None)  # the worker's own, whatever the env
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _read(self) -> list[str]:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().split()

    def run(
        self,
        prefix: str,
        fmt: WireFormat,
        count: int,
        conversation: bool,
        payload: _Payload,
        lease_max: int,
        bar: Progress,
    ) -> _Run:
        """Publish ``count`` trajectories under ``prefix`` and consume them; the clock runs
        from the publish command to the last ack (building them is not timed)."""
        self._send(f"prepare {prefix} {count}")
        if self._read() != ["prepared", str(count)]:
            raise RuntimeError("the bench worker did not prepare its trajectories")
        worker0, consumer0 = _process_cpu_s(self.proc.pid), time.process_time()
        start = time.perf_counter()
        self._send(f"publish {prefix} {count}")
        nbytes = asyncio.run(
            _consume(self.url, self.token, fmt, count, payload.sizes, lease_max, bar, conversation)
        )
        seconds = time.perf_counter() - start
        worker_cpu = _process_cpu_s(self.proc.pid) - worker0
        run = _Run(
            fmt, conversation, count, seconds, nbytes, worker_cpu, time.process_time() - consumer0
        )
        if self._read() != ["published", str(count)]:
            raise RuntimeError("the bench worker did not confirm its publishes")
        return run

    def stop(self) -> None:
        self._send("stop")
        if self.proc.wait(timeout=60) != 0:
            raise RuntimeError(f"the bench worker exited with {self.proc.returncode}")


def _timed(
    worker: _WorkerProcess,
    prefix: str,
    fmt: WireFormat,
    count: int,
    conversation: bool,
    payload: _Payload,
    lease_max: int,
    label: str,
    mode: ProgressMode,
) -> _Run:
    bar = Progress(label, count, mode=mode)
    try:
        return worker.run(prefix, fmt, count, conversation, payload, lease_max, bar)
    finally:
        bar.close()


def _result(
    pairs: list[tuple[tuple[float, float], list[_Run]]], json_run: _Run
) -> StreamBenchResult:
    """The figures over the pairs: each msgpack run gets its pair's limits; MB/s (and the
    run's time and CPU) of the lower-median run, the limits' medians, the ratio's range."""
    stream: list[_Run] = []
    full: list[_Run] = []
    for (tcp, disk), runs in pairs:
        for run in runs:
            run.tcp_mb_per_s, run.disk_mb_per_s = tcp, disk
            (full if run.conversation else stream).append(run)
    median, full_median = _lower_median(stream), _lower_median(full)
    of_limit = paired_ratio([(r.mb_per_s, r.limit_mb_per_s) for r in stream])
    return StreamBenchResult(
        published=median.count,
        delivered=median.count,
        traj_per_s=median.count / median.seconds,
        mb_per_s=median.mb_per_s,
        json_mb_per_s=json_run.mb_per_s,
        raw_tcp_mb_per_s=statistics.median(r.tcp_mb_per_s for r in stream),
        disk_mb_per_s=statistics.median(r.disk_mb_per_s for r in stream),
        full_decode_mb_per_s=full_median.mb_per_s,
        seconds=median.seconds,
        worker_cpu_s=median.worker_cpu_s,
        consumer_cpu_s=median.consumer_cpu_s,
        runs=len(stream),
        pairs=of_limit.pairs,
        ratio_min=of_limit.ratio_min,
        ratio_max=of_limit.ratio_max,
    )


def run_stream_bench(
    trajectories: int = 20_000,
    tokens: int = 2048,
    *,
    turns: int = 4,
    group_size: int = 8,
    lease_max: int = 256,
    publishers: int = 16,
    json_fraction: float = 0.25,
    pairs: int = DEFAULT_PAIRS,
    repeats: int | None = None,
    directory: str | Path | None = None,
    progress: bool = True,
) -> StreamBenchResult:
    """Stream ``trajectories`` of ``tokens`` tokens end to end with msgpack bodies in
    ``pairs`` alternating pairs (``repeats``: the same, by its older name): the loopback
    and disk limits on the same number of bytes, then the trainer's consumer and the full
    decoder (in alternating order); then ``json_fraction`` as many with JSON bodies once.
    Each figure is the median over the pairs (``seconds`` and the CPU figures: of the
    median run).  ``directory`` holds the spool (default: a temporary one).  Progress goes
    to stderr.  Raises ``ConfigError`` for bad sizes or fewer than 5 pairs,
    ``AssertionError`` if a trajectory is lost or delivered twice, ``RuntimeError`` if the
    worker process fails.

    The worker (``TrajectoryStream``) publishes groups from concurrent publishers (spool
    fsync, group commit); the consumer (``StreamClient``: lease, decode, ack) decodes what a
    trainer uses (``conversation=False``: token arrays, reward, ids and the rest, not the
    turns and messages, which still travel in every body and are stepped over).
    ``mb_per_s`` counts the msgpack bytes of the trajectories delivered per second from the
    first publish to the last ack (the trajectory objects are built before the clock
    starts: the episodes' work, not the stream's); ``json_mb_per_s`` the same (msgpack
    bytes) with JSON bodies; ``full_decode_mb_per_s`` the same with a consumer that decodes
    the whole trajectory (``conversation=True``, the client's default).  ``limit_mb_per_s``
    is the smaller of ``raw_tcp_mb_per_s`` and ``disk_mb_per_s``, each the median over the
    pairs; ``runs`` and ``pairs`` count the msgpack runs and pairs the medians are over.
    ``worker_cpu_s`` and ``consumer_cpu_s`` are the CPU seconds (user + system) each process
    used during the median run of ``mb_per_s``, next to its wall time ``seconds``: on a
    machine with few cores they show when the processes themselves, not the disk or the
    loopback, limit the stream.  Every run checks delivered == published, each id exactly
    once, and an empty spool at the end."""
    flag = "pairs" if repeats is None else "repeats"
    pairs = pairs if repeats is None else repeats
    _check_sizes(
        trajectories, tokens, group_size, lease_max, publishers, json_fraction, pairs, flag
    )
    n = max(group_size, trajectories - trajectories % group_size)
    n_json = max(group_size, int(n * json_fraction) // group_size * group_size)
    payload = _payload(n, tokens, turns, group_size)
    mode: ProgressMode = "auto" if progress else "off"
    with tempfile.TemporaryDirectory(dir=directory, prefix="agentroll-bench-stream-") as tmp:
        root = Path(tmp)
        with _WorkerProcess(root, tokens, turns, group_size, publishers) as worker:

            def limits(_: int) -> tuple[float, float]:
                return (
                    _tcp_copy_mb_per_s(payload.block, payload.total),
                    _disk_mb_per_s(payload.records, payload.total, root),
                )

            def streams(i: int) -> list[_Run]:
                # the two consumers in alternating order, so neither always runs first
                kinds = [("m", False), ("f", True)][:: 1 if i % 2 == 0 else -1]
                return [
                    _timed(
                        worker,
                        f"{kind}{i:0{_PREFIX_LEN - 1}d}",
                        "msgpack",
                        n,
                        conversation,
                        payload,
                        lease_max,
                        f"stream msgpack{' full decode' if conversation else ''} {i + 1}/{pairs}",
                        mode,
                    )
                    for kind, conversation in kinds
                ]

            measured = alternate(limits, streams, pairs)
            json_run = _timed(
                worker, _JSON_PREFIX, "json", n_json, False, payload, lease_max, "stream json", mode
            )
            worker.stop()
    return _result(measured, json_run)


# -- command line --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamBenchConfig:
    """The options of ``agentroll bench stream``: at least one trajectory, and enough tokens
    per trajectory for its turns."""

    trajectories: int
    tokens: int
    pairs: int = DEFAULT_PAIRS

    def __post_init__(self) -> None:
        if self.trajectories < 1 or self.tokens < 9:
            raise ConfigError(
                f"--trajectories must be >= 1 and --tokens >= 9 (got {self.trajectories} and "
                f"{self.tokens}); raise them"
            )
        check_pairs(self.pairs)
        if self.pairs > MAX_PAIRS:
            raise ConfigError(f"--pairs must be at most {MAX_PAIRS} (got {self.pairs})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trajectories", type=int, default=20_000)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per trajectory")
    parser.add_argument(
        "--pairs",
        type=int,
        default=DEFAULT_PAIRS,
        help=f"alternating (limits, streams) pairs, 5 to {MAX_PAIRS}; figures are their medians",
    )


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench (progress on stderr) and print its result line."""
    config = StreamBenchConfig(args.trajectories, args.tokens, args.pairs)
    result = run_stream_bench(config.trajectories, config.tokens, pairs=config.pairs)
    print(result.line(), flush=True)
    return 0
