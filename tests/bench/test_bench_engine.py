"""The matmul floor of ``bench engine``: every linear layer and the LM head, once per step,
each product the fastest way measured, and q/k/v and gate/up fused when that is faster."""

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
