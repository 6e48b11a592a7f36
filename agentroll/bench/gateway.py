"""``agentroll bench gateway``: the gateway's calls/s and CPU per chat call in agent episodes.

This process serves a ``Gateway`` on a scripted ``MockBackend`` (no latency) and counts its
own CPU over the window in which a separate process (``gateway_load``) runs the episodes
over HTTP (session create, chat calls, reward, end; per chat call = divided by chat calls);
in-process rounds (``Gateway.chat``) alternate with them, figures are medians.  Each round
checks one sample per session (a fork: an echoed reply did not extend the history) and
that every trajectory was published.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import math
import pstats
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from agentroll._gc import settle_heap
from agentroll.backends.base import GenerationRequest
from agentroll.backends.mock import MockBackend
from agentroll.bench.gateway_load import (
    FINAL_TEXT,
    SYSTEM_MESSAGE,
    TOOL_ARGUMENTS,
    TOOL_CALL_TEXT,
    TOOL_RESULT,
    TOOLS_JSON,
    USER_MESSAGE,
    LoadResult,
    percentile,
)
from agentroll.bench.pairs import (
    DEFAULT_PAIRS,
    MIN_PAIRS,
    alternate_async,
    check_pairs,
    paired_ratio,
)
from agentroll.errors import ConfigError
from agentroll.gateway import Gateway, RequestError, serve_gateway
from agentroll.gateway.wire import ChatRequest, ToolDef
from agentroll.model.tokenizer import tiny_chat_tokenizer
from agentroll.progress import Progress, ProgressMode
from agentroll.types import Trajectory

_LOAD_TIMEOUT = 600.0  # seconds a load run may take before the bench gives up on it
_WARMUP_SESSIONS = 32  # untimed in-process episodes first (template and encode caches)


def scripted_backend(turns: int) -> MockBackend:
    """A mock backend that answers call ``k`` of a session with the ``add`` tool call while
    ``k < turns - 1`` and with ``FINAL_TEXT`` on the last call."""

    def script(request: GenerationRequest) -> str:
        return TOOL_CALL_TEXT if request.turn_index < turns - 1 else FINAL_TEXT

    return MockBackend(script, tokenizer=tiny_chat_tokenizer())


class TrajectorySink:
    """``Gateway(publish=...)`` that only counts: the trajectories, and those with forks."""

    def __init__(self) -> None:
        self.trajectories = 0
        self.forked = 0

    async def __call__(self, trajectories: list[Trajectory]) -> None:
        self.trajectories += len(trajectories)
        self.forked += sum(1 for t in trajectories if t.forks)


@dataclass(frozen=True, slots=True)
class Round:
    """One measured set of episodes (over HTTP, or in process)."""

    kind: Literal["http", "inproc"]
    calls: int  # chat calls answered as expected
    failed: int
    forks: int
    seconds: float
    p50_ms: float
    p99_ms: float
    server_cpu_s: float  # this process's CPU (the gateway, and in process the episodes too)
    client_cpu_s: float  # the load generator's (nan in process)

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds if self.seconds > 0 else 0.0

    def per_call_ms(self, cpu_s: float) -> float:
        return cpu_s * 1000.0 / self.calls if self.calls else math.nan


@dataclass(frozen=True, slots=True)
class GatewayBenchResult:
    """The medians over the rounds; ``failed`` and ``forks`` summed over all of them;
    ``calls``: the fewest chat calls an HTTP round got answered."""

    calls_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_ms_per_call: float
    client_cpu_ms_per_call: float
    inproc_calls_per_s: float
    inproc_cpu_ms_per_call: float
    ratio_vs_inproc: float  # calls_per_s over the same pair's in-process rate: median
    ratio_min: float
    ratio_max: float
    server_cpu_ms_min: float
    server_cpu_ms_max: float
    failed: int
    forks: int
    calls: int
    sessions: int
    turns: int
    pairs: int
    errors: tuple[str, ...] = ()

    def line(self) -> str:
        return (
            f"calls_per_s={self.calls_per_s:.1f} p50_ms={self.p50_ms:.2f} "
            f"p99_ms={self.p99_ms:.2f} server_cpu_ms_per_call={self.server_cpu_ms_per_call:.3f} "
            f"client_cpu_ms_per_call={self.client_cpu_ms_per_call:.3f} "
            f"inproc_calls_per_s={self.inproc_calls_per_s:.1f} "
            f"inproc_cpu_ms_per_call={self.inproc_cpu_ms_per_call:.3f} "
            f"ratio_vs_inproc={self.ratio_vs_inproc:.3f} ratio_min={self.ratio_min:.3f} "
            f"ratio_max={self.ratio_max:.3f} server_cpu_ms_min={self.server_cpu_ms_min:.3f} "
            f"server_cpu_ms_max={self.server_cpu_ms_max:.3f} failed={self.failed} "
            f"forks={self.forks} calls={self.calls} sessions={self.sessions} "
            f"turns={self.turns} pairs={self.pairs}"
        )


@contextlib.asynccontextmanager
async def _progress(gw: Gateway, label: str, total: int, mode: ProgressMode) -> AsyncIterator[None]:
    """Show the gateway's answered calls while the block runs (polled: nothing is added to
    the calls' path)."""
    bar = Progress(label, total, mode=mode)
    start = gw.stats["calls"]

    async def poll() -> None:
        shown = 0
        while True:
            await asyncio.sleep(0.25)
            done = gw.stats["calls"] - start
            bar.advance(done - shown)
            shown = done

    task = asyncio.get_running_loop().create_task(poll())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        bar.advance(gw.stats["calls"] - start - bar.done)
        bar.close()


def _unpublished(sink: TrajectorySink, before: int, samples: int, kind: str) -> list[str]:
    """Why the trajectories published since ``before`` are not the ``samples`` that the
    sessions' ends reported (nothing when they are)."""
    got = sink.trajectories - before
    return [] if got == samples else [f"{kind}: {got} trajectories published, {samples} ended"]


async def http_round(
    gw: Gateway,
    url: str,
    sink: TrajectorySink,
    *,
    sessions: int,
    turns: int,
    group_size: int,
    prefix: str,
    label: str,
    mode: ProgressMode,
    profiler: cProfile.Profile | None = None,
) -> tuple[Round, list[str]]:
    """Start the load generator, let it connect, then measure this process's CPU from its
    ``go`` to its result.  Raises ``RuntimeError`` if the load generator fails."""
    published, forks = sink.trajectories, gw.stats["forks"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agentroll.bench.gateway_load",
        *("--url", url, "--sessions", str(sessions), "--turns", str(turns)),
        *("--group-size", str(group_size), "--prefix", prefix),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        async with asyncio.timeout(_LOAD_TIMEOUT):
            if (await proc.stdout.readline()).strip() != b"ready":
                raise RuntimeError(f"the load generator did not start (exit {await proc.wait()})")
            async with _progress(gw, label, sessions * turns, mode):
                cpu0 = time.process_time()  # user + system, every thread of this process
                if profiler is not None:
                    profiler.enable()
                try:
                    proc.stdin.write(b"go\n")
                    await proc.stdin.drain()
                    out = await proc.stdout.readline()
                finally:
                    if profiler is not None:
                        profiler.disable()
                server_cpu = time.process_time() - cpu0
            if await proc.wait() != 0 or not out:
                raise RuntimeError(f"the load generator failed (exit {proc.returncode})")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    load = msgspec.json.decode(out, type=LoadResult)
    lost = _unpublished(sink, published, load.samples, "http")
    fields = (load.seconds, load.p50_ms, load.p99_ms, server_cpu, load.cpu_s)
    result = Round("http", load.calls, load.failed + len(lost), gw.stats["forks"] - forks, *fields)
    return result, [*load.errors, *lost]


def _tools() -> list[ToolDef]:
    return msgspec.json.decode(TOOLS_JSON, type=list[ToolDef])


def _check(reply: dict[str, Any], last: bool) -> tuple[dict[str, Any], str]:
    """``check_reply`` of the load generator, on a reply dict (in process)."""
    choice = reply["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    if last:
        if choice["finish_reason"] != "stop" or message["content"] != FINAL_TEXT or calls:
            raise ValueError(f"last turn: finish {choice['finish_reason']!r}, not the final text")
        return message, ""
    if choice["finish_reason"] != "tool_calls" or len(calls) != 1:
        raise ValueError(f"finish {choice['finish_reason']!r} with {len(calls)} calls")
    fn = calls[0]["function"]
    if fn["name"] != "add" or msgspec.json.decode(fn["arguments"]) != TOOL_ARGUMENTS:
        raise ValueError(f"tool call {fn!r}, not add{TOOL_ARGUMENTS}")
    return message, str(calls[0]["id"])


async def inproc_round(
    gw: Gateway,
    sink: TrajectorySink,
    *,
    sessions: int,
    turns: int,
    group_size: int,
    prefix: str,
    label: str,
    mode: ProgressMode,
) -> tuple[Round, list[str]]:
    """The same episodes as ``http_round``, as concurrent tasks calling ``Gateway.chat``."""
    published, forks = sink.trajectories, gw.stats["forks"]
    tools = _tools()
    system, user = msgspec.json.decode(SYSTEM_MESSAGE), msgspec.json.decode(USER_MESSAGE)
    latencies: list[float] = []
    errors: list[str] = []
    counts = {"calls": 0, "failed": 0, "samples": 0}
    clock = time.perf_counter

    async def episode(i: int) -> None:
        group = i // group_size
        session = gw.open_session(
            task_id=f"{prefix}-task-{group}",
            group_id=f"{prefix}-group-{group}",
            group_size=group_size,
            metadata={"bench": "gateway"},
        )
        messages: list[dict[str, Any]] = [system, user]
        for turn in range(turns):
            t0 = clock()
            try:
                reply = await gw.chat(session, ChatRequest(messages=messages, tools=tools))
                message, call_id = _check(reply, turn == turns - 1)
            except (RequestError, ValueError, KeyError) as exc:
                counts["failed"] += 1
                errors.append(f"in process, turn {turn}: {exc}")
                break
            finally:
                latencies.append(clock() - t0)
            counts["calls"] += 1
            messages.append(message)
            if call_id:
                messages.append({"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT})
            # the tool "runs": yield, so that every session is live at once as over HTTP
            # (without it each episode would run to its end alone, on a far smaller heap)
            await asyncio.sleep(0)
        session.set_reward(1.0, None)
        samples = len(await gw.end(session))
        counts["samples"] += samples
        if samples != 1:
            counts["failed"] += 1
            errors.append(f"in process: a session ended with {samples} samples, not 1")

    async with _progress(gw, label, sessions * turns, mode):
        cpu0, t0 = time.process_time(), clock()
        async with asyncio.TaskGroup() as tg:
            for i in range(sessions):
                tg.create_task(episode(i))
        seconds, cpu = clock() - t0, time.process_time() - cpu0
    lost = _unpublished(sink, published, counts["samples"], "in process")
    p50, p99 = percentile(latencies, 0.5) * 1000.0, percentile(latencies, 0.99) * 1000.0
    failed, fields = counts["failed"] + len(lost), (seconds, p50, p99, cpu, math.nan)
    result = Round("inproc", counts["calls"], failed, gw.stats["forks"] - forks, *fields)
    return result, [*errors[:5], *lost]


def summarize(
    rounds: list[tuple[Round, Round]], errors: list[str], sessions: int, turns: int
) -> GatewayBenchResult:
    """The result over (HTTP, in-process) pairs of rounds."""
    http = [h for h, _ in rounds]
    inproc = [p for _, p in rounds]
    med = statistics.median
    ratio = paired_ratio([(h.calls_per_s, p.calls_per_s) for h, p in rounds])
    server_cpu = [r.per_call_ms(r.server_cpu_s) for r in http]
    return GatewayBenchResult(
        calls_per_s=med(r.calls_per_s for r in http),
        p50_ms=med(r.p50_ms for r in http),
        p99_ms=med(r.p99_ms for r in http),
        server_cpu_ms_per_call=med(server_cpu),
        client_cpu_ms_per_call=med(r.per_call_ms(r.client_cpu_s) for r in http),
        inproc_calls_per_s=med(r.calls_per_s for r in inproc),
        inproc_cpu_ms_per_call=med(r.per_call_ms(r.server_cpu_s) for r in inproc),
        ratio_vs_inproc=ratio.ratio,
        ratio_min=ratio.ratio_min,
        ratio_max=ratio.ratio_max,
        server_cpu_ms_min=min(server_cpu),
        server_cpu_ms_max=max(server_cpu),
        failed=sum(r.failed for pair in rounds for r in pair),
        forks=sum(r.forks for pair in rounds for r in pair),
        calls=min(r.calls for r in http),
        sessions=sessions,
        turns=turns,
        pairs=len(rounds),
        errors=tuple(errors[:10]),
    )


@dataclass(frozen=True, slots=True)
class GatewayBenchConfig:
    """The options of ``agentroll bench gateway``, checked (``ConfigError`` says what to
    change)."""

    sessions: int = 512
    turns: int = 4
    group_size: int = 8
    pairs: int = DEFAULT_PAIRS

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.group_size < 1:
            raise ConfigError("--sessions, --turns and --group-size must be >= 1; raise them")
        if self.sessions % self.group_size:
            raise ConfigError(
                f"--sessions={self.sessions} is not a multiple of --group-size="
                f"{self.group_size} (a partial group is never released); change either"
            )
        check_pairs(self.pairs)


async def run_gateway_bench(
    config: GatewayBenchConfig,
    *,
    progress: bool = True,
    profile: str | None = None,
) -> GatewayBenchResult:
    """Serve a gateway on 127.0.0.1 and measure ``config.pairs`` (HTTP, in-process) pairs of
    rounds after an untimed in-process warm-up; ``profile``: write the server's cProfile
    stats over the HTTP rounds to that file (the figures of a profiled run are slower).
    Raises ``RuntimeError`` if the load generator fails."""
    mode: ProgressMode = "auto" if progress else "off"
    sink = TrajectorySink()
    profiler = cProfile.Profile() if profile else None
    errors: list[str] = []
    n, turns, g, pairs = config.sessions, config.turns, config.group_size, config.pairs
    async with (
        scripted_backend(turns) as backend,
        Gateway(backend, publish=sink) as gw,
        serve_gateway(gw) as url,
    ):
        warm = min(n, max(g, _WARMUP_SESSIONS // g * g))
        _, warm_errors = await inproc_round(
            gw, sink, sessions=warm, turns=turns, group_size=g, prefix="w", label="", mode="off"
        )
        errors += warm_errors
        settle_heap()  # as `agentroll gateway` does before it serves

        def measure(
            fn: Callable[..., Awaitable[tuple[Round, list[str]]]], kind: str, **kw: Any
        ) -> Callable[[int], Awaitable[Round]]:
            async def one(i: int) -> Round:
                label = f"gateway {kind} {i + 1}/{pairs}"
                result, errs = await fn(
                    gw, sink=sink, sessions=n, turns=turns, group_size=g, label=label,
                    prefix=f"{kind[0]}{i}", mode=mode, **kw
                )  # fmt: skip
                errors.extend(errs)
                return result

            return one

        rounds = await alternate_async(
            measure(http_round, "http", url=url, profiler=profiler),
            measure(inproc_round, "in-process"),
            pairs,
        )
    if profiler is not None and profile is not None:
        profiler.dump_stats(profile)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue(), file=sys.stderr)
    return summarize(rounds, errors, n, turns)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=512, help="concurrent sessions")
    parser.add_argument("--turns", type=int, default=4, help="chat calls per session")
    parser.add_argument(
        "--group-size", type=int, default=8, help="sessions per group (divides --sessions)"
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=DEFAULT_PAIRS,
        help=f"alternating (HTTP, in-process) rounds, >= {MIN_PAIRS}; figures are medians",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        default=None,
        help="write cProfile stats of the server over the HTTP rounds to FILE (and the top "
        "functions to stderr); a profiled run is slower",
    )


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench (progress on stderr), print its line; exit 1 when a call
    failed or a session forked (the reasons go to stderr)."""
    config = GatewayBenchConfig(args.sessions, args.turns, args.group_size, args.pairs)
    result = asyncio.run(run_gateway_bench(config, profile=args.profile))
    print(result.line(), flush=True)
    for error in result.errors:
        print(f"gateway bench: {error}", file=sys.stderr)
    return 1 if result.failed or result.forks else 0
