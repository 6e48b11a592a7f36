"""``agentroll bench vllm``'s pairing on fake measures (no vLLM needed): ours and raw rounds
alternate after one warm-up of each, the line keeps its three keys and appends the pair count
and the overhead ratio's range, and fewer than five pairs (or rounds) is a config error."""

from __future__ import annotations

import re
from typing import Any

import pytest

from agentroll.bench import vllm as bench_vllm
from agentroll.errors import ConfigError

LINE = re.compile(
    r"tokens_per_s=[\d.]+ raw_tokens_per_s=[\d.]+ overhead_ratio=[\d.]+ "
    r"pairs=\d+ ratio_min=[\d.]+ ratio_max=[\d.]+"
)


class _Started:
    llm = object()


async def test_rounds_alternate_and_the_ratio_is_the_median_per_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    # ours drifts down 10% per pair, raw with it: every pair's raw / ours is 1.25
    rates = {"ours": [100.0, 90.0, 80.0, 70.0, 60.0], "raw": [125.0, 112.5, 100.0, 87.5, 75.0]}

    async def fake(side: str, tag: str) -> float:
        calls.append(tag)
        return 1.0 if tag.startswith("warm") else rates[side][int(tag.rsplit("-", 1)[1])]

    async def ours(backend: Any, concurrency: int, max_tokens: int, tag: str) -> float:
        return await fake("ours", tag)

    async def raw(llm: Any, concurrency: int, max_tokens: int, tag: str) -> float:
        return await fake("raw", tag)

    monkeypatch.setattr(bench_vllm, "_ours", ours)
    monkeypatch.setattr(bench_vllm, "_raw", raw)
    result = await bench_vllm.run_vllm_bench(4, 8, backend=_Started(), progress=False)
    assert calls == ["warm-ours", "warm-raw"] + [
        f"{side}-{i}" for i in range(5) for side in ("ours", "raw")
    ]
    assert result["tokens_per_s"] == 80.0 and result["raw_tokens_per_s"] == 100.0
    assert result["overhead_ratio"] == pytest.approx(1.25)
    assert result["ratio_min"] == pytest.approx(1.25) == result["ratio_max"]
    assert result["pairs"] == 5
    assert LINE.fullmatch(bench_vllm.format_line(result))


async def test_fewer_than_five_pairs_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="pairs must be >= 5"):
        await bench_vllm.run_vllm_bench(4, 8, pairs=4, backend=_Started(), progress=False)
    with pytest.raises(ConfigError, match="rounds must be >= 5"):
        await bench_vllm.run_vllm_bench(4, 8, rounds=1, backend=_Started(), progress=False)
