"""``bench engine``: the matmul floor (every linear layer and the LM head, once per step,
each product the fastest way measured, q/k/v and gate/up fused when that is faster), and the
engine and its baselines measured alternately, the ratio a median over the pairs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from agentroll.bench import engine as bench_engine
from agentroll.bench.engine import REPEATS, _matmul_floor
from agentroll.engine import kernels


@pytest.mark.parametrize("case", ["plain-apart", "kernels-fused"])
def test_matmul_floor_times_every_product_the_fastest_way(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    calls: list[tuple[str, int, int]] = []  # (way, rows, output width)
    real = {"linear": torch.nn.functional.linear, "mm": torch.mm, "addmm": torch.addmm}

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(("linear", x.shape[0], w.shape[0]))
        return real["linear"](x, w, b)

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(("mm", x.shape[0], w.shape[1]))
        return real["mm"](x, w)

    def addmm(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(("mm", x.shape[0], w.shape[1]))
        return real["addmm"](b, x, w)

    def ext_linear(x: torch.Tensor, wt: torch.Tensor, b: Any, tile: int) -> torch.Tensor:
        calls.append(("kernels", x.shape[0], wt.shape[1]))
        return real["mm"](x, wt)

    # A product's measured cost, by the way it multiplies: proportional to its output width
    # for torch (fusing gains nothing, so products stay apart), one unit per call for the
    # kernels (fusing three products into one is then cheaper).
    def best_of(fn: Any, calls_: int = 200) -> float:
        before = len(calls)
        fn()
        way, _, width = calls[before]
        del calls[before:]
        if case == "plain-apart":
            return {"linear": 1.0, "mm": 2.0, "kernels": 3.0}[way] * width
        return {"linear": 5.0, "mm": 5.0, "kernels": 1.0}[way]

    monkeypatch.setattr(bench_engine, "_best_of", best_of)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(kernels, "get", lambda: SimpleNamespace(linear=ext_linear))
    rate = _matmul_floor(tiny_model, rows=3, steps=2)
    assert math.isfinite(rate) and rate > 0
    steps = 20 + 2 * REPEATS  # warm-up, then REPEATS runs of 2 steps
    assert len(calls) % steps == 0 and all(rows == 3 for _, rows, _ in calls)
    step = calls[: len(calls) // steps]
    widths = sorted(width for _, _, width in step)
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * 64
    if case == "plain-apart":  # q, k, v, o, gate, up, down per layer; the head
        assert {way for way, _, _ in step} == {"linear"} and len(step) == 7 * layers + 1
        assert widths.count(inter) == 2 * layers and widths.count(vocab) == 1
    else:  # qkv, o, gate_up, down per layer; the head
        assert {way for way, _, _ in step} == {"kernels"} and len(step) == 4 * layers + 1
        assert widths == sorted([qkv, hidden, 2 * inter, hidden] * layers + [vocab])


async def test_engine_and_baselines_alternate_and_the_ratio_is_per_pair(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The engine (A) and transformers batched (B) alternate, A B A B, after both are loaded;
    without vLLM its figures are nan; the ratio is the median of the per-pair ratios."""
    calls: list[str] = []
    # the machine slows down pair by pair; the engine stays 4x transformers in every pair
    ours_rates = [800.0, 400.0, 200.0, 100.0, 50.0]

    class Ours:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            calls.append("load ours")

        async def __aenter__(self) -> Ours:
            return self

        async def __aexit__(self, *exc: Any) -> None:
            calls.append("close ours")

        async def rate(self, rep: int) -> float:
            calls.append(f"ours {rep}")
            return ours_rates[rep]

        async def prefix_hit_rate(self) -> float:
            return 0.5

    class HF:
        def __init__(self, *args: Any) -> None:
            calls.append("load hf")
            self.rep = 0

        def rate(self, batched: bool) -> float:
            assert batched
            calls.append(f"hf {self.rep}")
            self.rep += 1
            return ours_rates[self.rep - 1] / 4

    monkeypatch.setattr(bench_engine, "_Ours", Ours)
    monkeypatch.setattr(bench_engine, "_HF", HF)
    monkeypatch.setattr(bench_engine._VLLM, "start", staticmethod(lambda *a, **k: None))
    p = await bench_engine._paired(tmp_path, [[1, 2]], 4, 5)
    pairs = [f"{side} {i}" for i in range(5) for side in ("ours", "hf")]
    assert calls == ["load ours", "load hf", *pairs, "close ours"]
    assert p.ours == 200.0 and p.hf_batch == 50.0 and p.prefix_hit_rate == 0.5
    assert p.vs_hf_batch.ratio == 4.0 and p.vs_hf_batch.pairs == 5
    assert p.vs_hf_batch.ratio_min == 4.0 == p.vs_hf_batch.ratio_max
    assert math.isnan(p.vllm) and math.isnan(p.vs_vllm.ratio)
