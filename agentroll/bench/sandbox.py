"""``agentroll bench sandbox``: what a sandbox costs an episode, against the usual baseline.

Exec latency of ``echo hi`` in a started sandbox (A) against the baseline (B: ``docker exec``
into the same container, or a bare ``/bin/sh`` for local) in ``--pairs`` alternating blocks;
``speedup_vs_cli``, the main ratio, is the median of the per-pair B/A ratios
(``ratio_min``/``ratio_max``: its range).  Start latencies are unpaired (``run_sandbox_bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agentroll.bench.pairs import DEFAULT_PAIRS, alternate_async, check_pairs, paired_ratio
from agentroll.errors import ConfigError, SandboxError
from agentroll.sandbox.base import SandboxConfig

__all__ = [
    "KEYS",
    "SandboxBenchConfig",
    "add_arguments",
    "format_line",
    "main",
    "run_sandbox_bench",
]

KEYS = (
    "acquire_p50_ms",
    "cold_start_p50_ms",
    "exec_p50_ms",
    "cli_exec_p50_ms",
    "speedup_vs_cli",
    "pairs",
    "ratio_min",
    "ratio_max",
)
COMMAND = "echo hi"
EXPECTED = "hi\n"
WARMUP = 2  # untimed runs of each exec kind before the timed ones


def default_docker_host(docker_host: str | None = None) -> str | None:
    """``docker_host``, else ``$AGENTROLL_DOCKER_HOST``, else ``$DOCKER_HOST``, else None
    (the sandbox's own default)."""
    return (
        docker_host
        or os.environ.get("AGENTROLL_DOCKER_HOST")
        or os.environ.get("DOCKER_HOST")
        or None
    )


class _Say:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str) -> None:
        if self.enabled:
            print(f"bench sandbox: {text}", file=sys.stderr, flush=True)

    def figures(self, what: str, samples: list[float]) -> None:
        self(
            f"{what}: p50={_p50(samples):.2f} ms p90={_quantile(samples, 0.9):.2f} ms "
            f"n={len(samples)}"
        )


def _p50(samples: list[float]) -> float:
    return statistics.median(samples)


def _quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _timed_ms(call: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = await call()
    return (time.perf_counter() - t0) * 1e3, value


async def _subprocess_stdout(argv: list[str], what: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxError(
            f"bench sandbox: the baseline {what} exited with {proc.returncode}: "
            f"{err.decode(errors='replace').strip()[-500:]}"
        )
    return out.decode(errors="replace")


def _check(what: str, stdout: str, exit_code: int | None = 0, stderr: str = "") -> None:
    if exit_code != 0 or stdout != EXPECTED:
        raise SandboxError(
            f"bench sandbox: {what} of {COMMAND!r} gave exit code {exit_code}, stdout "
            f"{stdout!r} (expected {EXPECTED!r}), stderr {stderr.strip()[-500:]!r}; the "
            "bench measures a working command only"
        )


async def _exec_pairs(
    ours: Callable[[], Awaitable[str]],
    cli: Callable[[], Awaitable[str]],
    execs: int,
    pairs: int,
    say: _Say,
) -> list[tuple[float, float]]:
    """``(ours p50, baseline p50)`` per pair: ``pairs`` alternating blocks of
    ``ceil(execs / pairs)`` timed runs of each, after ``WARMUP`` untimed runs of each."""
    for _ in range(WARMUP):
        await ours()
        await cli()
    per_block = max(1, math.ceil(execs / pairs))
    samples: dict[str, list[float]] = {"exec": [], "cli exec": []}

    async def block(call: Callable[[], Awaitable[str]], what: str) -> float:
        times = [(await _timed_ms(call))[0] for _ in range(per_block)]
        samples[what] += times
        return _p50(times)

    measured = await alternate_async(
        lambda _: block(ours, "exec"), lambda _: block(cli, "cli exec"), pairs
    )
    for what, times in samples.items():
        say.figures(what, times)
    return measured


def _result(
    acquire: list[float], cold: list[float], measured: list[tuple[float, float]]
) -> dict[str, float]:
    speedup = paired_ratio([(cli, ours) for ours, cli in measured])
    return {
        "acquire_p50_ms": _p50(acquire),
        "cold_start_p50_ms": _p50(cold),
        "exec_p50_ms": _p50([ours for ours, _ in measured]),
        "cli_exec_p50_ms": _p50([cli for _, cli in measured]),
        "speedup_vs_cli": speedup.ratio,
        **speedup.fields(),
    }


# ---------------------------------------------------------------------------------------
# docker


async def _docker_bench(
    host: str | None, execs: int, pairs: int, acquires: int, cold_starts: int, say: _Say
) -> dict[str, float]:
    from agentroll.sandbox.docker import DockerSandbox, prewarm
    from agentroll.sandbox.docker_daemon import _resolve_host, list_containers
    from agentroll.sandbox.docker_pool import close_pools

    docker_cli = shutil.which("docker")
    if docker_cli is None:
        raise ConfigError(
            "bench sandbox: the docker CLI is not on PATH; the baseline (`docker exec`) needs it"
        )
    url = _resolve_host(host)
    # Connects (and reaps) once, outside every clock; a SandboxError if no daemon answers.
    left = await asyncio.to_thread(list_containers, url, owner="self")
    if left:
        raise SandboxError(f"bench sandbox: this process already has containers at {url}")
    say(f"docker at {url}")

    def config(pool_size: int, run_id: str) -> SandboxConfig:
        # Distinct run ids: a pool is keyed by what its containers are made from (not by
        # pool_size), so the cold and the warm measurement must not share one.
        options = {"docker_host": url, "pool_size": pool_size, "run_id": run_id}
        return SandboxConfig(backend="docker", options=options)

    cold_cfg = config(0, "bench-sandbox-cold")
    warm_cfg = config(2, "bench-sandbox-warm")
    sandboxes: list[DockerSandbox] = []
    try:
        cold: list[float] = []
        for _ in range(cold_starts):
            sb = DockerSandbox(cold_cfg)
            sandboxes.append(sb)
            ms, _ = await _timed_ms(sb.start)
            cold.append(ms)
            await sb.close()
        say.figures("cold start (pool_size=0)", cold)

        acquire: list[float] = []
        for _ in range(acquires):
            await prewarm(warm_cfg)
            sb = DockerSandbox(warm_cfg)
            sandboxes.append(sb)
            ms, _ = await _timed_ms(sb.start)
            acquire.append(ms)
            await sb.close()
        say.figures("acquire (warm pool full)", acquire)

        sb = DockerSandbox(warm_cfg)
        sandboxes.append(sb)
        await sb.start()
        await prewarm(warm_cfg)  # no refill in flight while commands are timed
        cid = sb.container_id
        argv = [docker_cli, "-H", url, "exec", cid, "/bin/sh", "-c", COMMAND]

        async def ours() -> str:
            r = await sb.exec(COMMAND)
            _check("DockerSandbox.exec", r.stdout, r.exit_code, r.stderr)
            return r.stdout

        async def cli() -> str:
            out = await _subprocess_stdout(argv, "`docker exec`")
            _check("`docker exec`", out)
            return out

        say(f"{execs} execs of {COMMAND!r} each, in container {cid[:12]}")
        measured = await _exec_pairs(ours, cli, execs, pairs, say)
    finally:
        for made in sandboxes:
            await made.close()
        await close_pools()
    left = await asyncio.to_thread(list_containers, url, owner="self")
    if left:
        raise SandboxError(
            f"bench sandbox: {len(left)} container(s) of this process left at {url} after "
            f"close_pools(): {', '.join(c[:12] for c in left)}"
        )
    return _result(acquire, cold, measured)


# ---------------------------------------------------------------------------------------
# local


async def _local_bench(
    execs: int, pairs: int, acquires: int, cold_starts: int, say: _Say
) -> dict[str, float]:
    from agentroll.sandbox.local import LocalSandbox

    async def starts(n: int) -> list[float]:
        samples = []
        for _ in range(n):
            sb = LocalSandbox()
            try:
                ms, _ = await _timed_ms(sb.start)
            finally:
                await sb.close()
            samples.append(ms)
        return samples

    cold = await starts(cold_starts)
    say.figures("cold start (no pool: a fresh LocalSandbox)", cold)
    acquire = await starts(acquires)
    say.figures("acquire (same as cold start)", acquire)

    async with LocalSandbox() as sb:
        say(f"{execs} execs of {COMMAND!r} each, bubblewrap={'on' if sb.is_isolated else 'off'}")

        async def ours() -> str:
            r = await sb.exec(COMMAND)
            _check("LocalSandbox.exec", r.stdout, r.exit_code, r.stderr)
            return r.stdout

        async def bare() -> str:
            out = await _subprocess_stdout(["/bin/sh", "-c", COMMAND], "bare /bin/sh")
            _check("a bare /bin/sh", out)
            return out

        measured = await _exec_pairs(ours, bare, execs, pairs, say)
    return _result(acquire, cold, measured)


# ---------------------------------------------------------------------------------------


async def run_sandbox_bench(
    backend: str,
    execs: int,
    *,
    docker_host: str | None = None,
    pairs: int = DEFAULT_PAIRS,
    acquires: int = 20,
    cold_starts: int = 10,
    progress: bool = True,
) -> dict[str, float]:
    """Measure ``backend`` ("docker" or "local"); return the figures of ``KEYS``, medians in
    milliseconds of ``time.perf_counter`` around one awaited call:

    - ``cold_start_p50_ms``: ``start()`` of a sandbox that has nothing prepared.  Docker: a
      ``DockerSandbox`` with ``pool_size=0`` (create the container, attach, start it, wait
      for the in-container agent's hello); local: ``start()`` of a fresh ``LocalSandbox``
      (make its working directory; the first one also probes bubblewrap).  Each sandbox is
      closed after, outside the clock.
    - ``acquire_p50_ms``: ``start()`` as an episode sees it.  Docker: with the warm pool
      full (``prewarm`` before each timed call; ``pool_size=2``), so it is the hand-out of a
      warm container plus its health check (a ping); closing removes it and the pool refills
      in the background, which the next ``prewarm`` waits out.  Local: there is no pool, so
      this is the same measurement as ``cold_start_p50_ms`` (its own ``acquires`` runs).
    - ``exec_p50_ms``: ``await sb.exec("echo hi")`` on one started sandbox (docker: one
      round trip to the agent over the open attach connection, with the pool full and idle;
      local: a process, under bubblewrap when it works here).
    - ``cli_exec_p50_ms``: the baseline for the same command.  Docker: ``docker -H URL exec
      <container> /bin/sh -c 'echo hi'`` as an asyncio subprocess into the same container,
      what several peer agent frameworks do per tool call; local: ``/bin/sh -c 'echo hi'``
      as a bare asyncio subprocess (no sandboxing at all).
    - ``speedup_vs_cli``: the median over the pairs of ``cli p50 / exec p50`` (below 1 for
      local: sandboxing a process costs more than not sandboxing it); ``pairs``,
      ``ratio_min`` and ``ratio_max``: their number and range.

    After two untimed runs of each exec kind, the two run in ``pairs`` alternating blocks
    (ours, baseline, ours, ...) of ``ceil(execs / pairs)`` timed runs each, so machine drift
    hits both sides of a pair alike; ``exec_p50_ms`` and ``cli_exec_p50_ms`` are the medians
    over the pairs of each block's p50.  Every run's output must be ``hi\\n`` or the bench
    fails (a broken command measures nothing).  Docker runs end with ``close_pools()`` and
    fail if any container of this process is left at the daemon.  ``docker_host`` defaults
    as ``default_docker_host``.  Progress goes to stderr unless ``progress`` is False.

    Raises ``ConfigError`` for bad counts (fewer than 5 pairs included) or backend,
    ``SandboxError`` when no daemon answers, a command's output is wrong, or (docker) a
    container is left behind.
    """
    if backend not in ("docker", "local"):
        raise ConfigError(f"bench sandbox: backend {backend!r} is unknown; use docker or local")
    for name, value in (("execs", execs), ("acquires", acquires), ("cold_starts", cold_starts)):
        if value < 1:
            raise ConfigError(f"bench sandbox: {name} must be >= 1, got {value}")
    check_pairs(pairs)
    say = _Say(progress)
    if backend == "docker":
        return await _docker_bench(
            default_docker_host(docker_host), execs, pairs, acquires, cold_starts, say
        )
    return await _local_bench(execs, pairs, acquires, cold_starts, say)


def format_line(result: dict[str, float]) -> str:
    """The result line: ``acquire_p50_ms=... cold_start_p50_ms=... exec_p50_ms=...
    cli_exec_p50_ms=... speedup_vs_cli=... pairs=N ratio_min=... ratio_max=...``."""
    return " ".join(
        f"{key}={int(result[key])}" if key == "pairs" else f"{key}={result[key]:.2f}"
        for key in KEYS
    )


# -- command line --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SandboxBenchConfig:
    """The options of ``agentroll bench sandbox``; every count is at least 1."""

    backend: str
    execs: int
    docker_host: str | None
    acquires: int
    cold_starts: int
    pairs: int = DEFAULT_PAIRS

    def __post_init__(self) -> None:
        for name in ("execs", "acquires", "cold_starts"):
            if (value := getattr(self, name)) < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be >= 1 (got {value}); pass a positive count")
        check_pairs(self.pairs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["docker", "local"], default="docker")
    parser.add_argument(
        "--execs", type=int, default=200, help="timed execs of each kind, spread over the pairs"
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=DEFAULT_PAIRS,
        help="alternating blocks of execs (ours, baseline), at least 5; the ratio is their median",
    )
    parser.add_argument(
        "--docker-host",
        default=None,
        help="daemon URL (default: $AGENTROLL_DOCKER_HOST, else $DOCKER_HOST, else the "
        "sandbox's default)",
    )
    parser.add_argument("--acquires", type=int, default=20, help="timed starts from a full pool")
    parser.add_argument("--cold-starts", type=int, default=10, help="timed starts without a pool")


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench (progress on stderr) and print its result line."""
    config = SandboxBenchConfig(
        args.backend, args.execs, args.docker_host, args.acquires, args.cold_starts, args.pairs
    )
    result = asyncio.run(
        run_sandbox_bench(
            config.backend,
            config.execs,
            docker_host=config.docker_host,
            pairs=config.pairs,
            acquires=config.acquires,
            cold_starts=config.cold_starts,
        )
    )
    print(format_line(result), flush=True)
    return 0
