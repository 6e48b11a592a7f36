"""``agentroll bench sandbox`` with small counts: the result line has exactly the five promised
keys with float values and then the pair count and the ratio's range, the figures are
positive, docker beats ``docker exec`` and leaves no container behind, and the CLI prints the
line on stdout."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from agentroll.bench.sandbox import format_line, run_sandbox_bench
from agentroll.errors import ConfigError, SandboxError

_FLOAT = r"(\d+(?:\.\d+)?)"
LINE = re.compile(
    rf"^acquire_p50_ms={_FLOAT} cold_start_p50_ms={_FLOAT} exec_p50_ms={_FLOAT} "
    rf"cli_exec_p50_ms={_FLOAT} speedup_vs_cli={_FLOAT} "
    rf"pairs=(\d+) ratio_min={_FLOAT} ratio_max={_FLOAT}$"
)
KEYS = [
    "acquire_p50_ms",
    "cold_start_p50_ms",
    "exec_p50_ms",
    "cli_exec_p50_ms",
    "speedup_vs_cli",
    "pairs",
    "ratio_min",
    "ratio_max",
]


def parse(line: str) -> dict[str, float]:
    match = LINE.match(line)
    assert match, f"not the bench's result line: {line!r}"
    return dict(zip(KEYS, map(float, match.groups()), strict=True))


async def test_local_bench_line_has_the_five_positive_figures() -> None:
    result = await run_sandbox_bench("local", 10, acquires=3, cold_starts=3, progress=False)
    assert sorted(result) == sorted(KEYS)
    values = parse(format_line(result))
    assert all(v > 0 for v in values.values()), values
    assert result["pairs"] == 5
    # the speedup is the median of the per-pair ratios: within their range, and so is the
    # ratio of the two sides' medians (each side's pair figure is within [min, max] times
    # the other's)
    low, high = result["ratio_min"] * (1 - 1e-9), result["ratio_max"] * (1 + 1e-9)
    assert low <= result["speedup_vs_cli"] <= high
    assert low <= result["cli_exec_p50_ms"] / result["exec_p50_ms"] <= high


async def test_bad_counts_and_backends_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="execs must be >= 1"):
        await run_sandbox_bench("local", 0, progress=False)
    with pytest.raises(ConfigError, match="backend 'k8s' is unknown"):
        await run_sandbox_bench("k8s", 5, progress=False)
    with pytest.raises(ConfigError, match="--pairs must be >= 5"):
        await run_sandbox_bench("local", 5, pairs=4, progress=False)


def test_cli_prints_the_line_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    from agentroll.cli import main

    argv = ["bench", "sandbox", "--backend", "local", "--execs", "5", "--acquires", "2"]
    assert main([*argv, "--cold-starts", "2"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1, captured.out
    parse(lines[0])
    assert "bench sandbox: exec" in captured.err  # progress goes to stderr


def test_cli_reports_a_missing_daemon_without_a_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from agentroll.cli import main

    host = f"unix://{tmp_path}/no-daemon.sock"
    argv = ["bench", "sandbox", "--backend", "docker", "--execs", "2", "--docker-host", host]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "agentroll: error: no docker daemon answers at" in captured.err
    assert "Traceback" not in captured.err


def _docker_host() -> str:
    host = os.environ.get("AGENTROLL_DOCKER_HOST")
    if not host:
        pytest.skip("AGENTROLL_DOCKER_HOST is unset (scripts/dockerd.sh host prints one)")
    from agentroll.sandbox.docker_daemon import list_containers

    try:
        list_containers(host)
    except SandboxError as exc:
        pytest.skip(f"no docker daemon answers at AGENTROLL_DOCKER_HOST: {exc}")
    return host


@pytest.mark.docker
async def test_docker_bench_beats_docker_exec_and_leaves_nothing() -> None:
    host = _docker_host()
    from agentroll.sandbox._ratelimit import LABEL, LABEL_OWNER
    from agentroll.sandbox.docker_daemon import _daemon, _owner, list_containers
    from agentroll.sandbox.docker_options import DockerOptions

    result = await run_sandbox_bench(
        "docker", 20, docker_host=host, acquires=3, cold_starts=2, progress=False
    )
    values = parse(format_line(result))
    assert all(v > 0 for v in values.values()), values
    assert values["speedup_vs_cli"] > 1, values
    assert await asyncio.to_thread(list_containers, host, owner="self") == []
    # the same, straight from the daemon: both labels, every state
    client = _daemon(DockerOptions(docker_host=host)).client
    mine = client.containers(all=True, filters={"label": [LABEL, f"{LABEL_OWNER}={_owner()}"]})
    assert mine == []
