"""``agentroll bench stream`` with tiny numbers: the result line has exactly the promised keys,
every published trajectory was delivered once (the bench raises otherwise), the figures are
positive, the limits are measured once per pair, alternating with the runs, and the limit is
the smaller of the two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentroll.bench import stream as bench_stream
from agentroll.bench.stream import run_stream_bench, synthetic_trajectory
from agentroll.errors import ConfigError
from agentroll.types import Trajectory, decode_msgpack, encode_msgpack

KEYS = [
    "traj_per_s",
    "mb_per_s",
    "json_mb_per_s",
    "raw_tcp_mb_per_s",
    "disk_mb_per_s",
    "limit_mb_per_s",
    "full_decode_mb_per_s",
    "seconds",
    "worker_cpu_s",
    "consumer_cpu_s",
    "runs",
    "pairs",
    "ratio_min",
    "ratio_max",
]


@pytest.mark.slow  # starts a worker process (imports torch through the weights server)
def test_tiny_bench_delivers_everything_and_prints_the_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []  # the limits are measured once per pair, before its two runs
    for name in ("_tcp_copy_mb_per_s", "_disk_mb_per_s"):
        real = getattr(bench_stream, name)
        monkeypatch.setattr(
            bench_stream, name, lambda *a, real=real, name=name: events.append(name) or real(*a)
        )
    consume = bench_stream._consume

    async def counted(*args: Any) -> int:
        events.append("run")
        return await consume(*args)

    monkeypatch.setattr(bench_stream, "_consume", counted)
    result = run_stream_bench(
        48,
        64,
        group_size=4,
        lease_max=8,
        publishers=3,
        pairs=5,
        directory=tmp_path,
        progress=False,
    )
    assert result.delivered == result.published == 48 and result.runs == 5
    limits = ["_tcp_copy_mb_per_s", "_disk_mb_per_s"]
    assert events == (limits + ["run", "run"]) * 5 + ["run"]  # the last: the JSON stream
    pairs = [field.split("=") for field in result.line().split()]
    assert [k for k, _ in pairs] == KEYS
    values = {k: float(v) for k, v in pairs}
    assert values.pop("runs") == 5 and values.pop("pairs") == 5
    assert 0 < result.ratio_min <= result.ratio_max
    # the figures themselves, not the line's: 48 KB over a slow moment (an fsync stalled by
    # the rest of the suite) prints as 0.0 MB/s
    rates = [getattr(result, k) for k in KEYS[:7]]
    assert all(v > 0 for v in rates), rates
    # CPU in clock ticks and the wall time to 10 ms: a tiny run may round to 0
    small = [values[k] for k in ("seconds", "worker_cpu_s", "consumer_cpu_s")]
    assert all(0 <= v < 60 for v in small)
    assert result.limit_mb_per_s == min(result.raw_tcp_mb_per_s, result.disk_mb_per_s)
    assert list(tmp_path.iterdir()) == []  # the spool and the disk probe were removed


def test_synthetic_trajectories_are_realistic_and_round_trip() -> None:
    t = synthetic_trajectory(3, 2048, turns=4, group_size=8)
    assert t.num_tokens == 2048 and len(t.turns) == 4
    assert 0 < t.num_generated < 2048 and t.group_id.endswith("00000000")
    back = decode_msgpack(encode_msgpack(t), Trajectory)
    assert encode_msgpack(back) == encode_msgpack(t)
    with pytest.raises(ConfigError, match="too few"):
        synthetic_trajectory(0, 4, turns=4)
    with pytest.raises(ConfigError, match="json_fraction"):
        run_stream_bench(8, 64, json_fraction=0)
    with pytest.raises(ConfigError, match="repeats"):
        run_stream_bench(8, 64, repeats=0)
    with pytest.raises(ConfigError, match="pairs must be >= 5"):
        run_stream_bench(8, 64, pairs=4)
