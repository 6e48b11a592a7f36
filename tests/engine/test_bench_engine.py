"""The matmul floor of ``bench engine``: every linear layer and the LM head, once per step,
each in the weight layout that was measured faster."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from agentroll import bench_engine
from agentroll.bench_engine import REPEATS, _matmul_floor


@pytest.mark.parametrize("flipped_faster", [False, True])
def test_matmul_floor_times_every_linear_layer_and_the_head(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, flipped_faster: bool
) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    # _best_of is asked about the plain layout, then the transposed one, for each product
    costs = itertools.cycle((1.0, 0.5) if flipped_faster else (0.5, 1.0))
    monkeypatch.setattr(bench_engine, "_best_of", lambda fn, calls=200: next(costs))
    calls: list[tuple[str, int, int]] = []
    real = {"linear": torch.nn.functional.linear, "mm": torch.mm, "addmm": torch.addmm}

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(("linear", x.shape[0], w.shape[0]))
        return real["linear"](x, w, b)

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(("mm", x.shape[0], w.shape[1]))
        return real["mm"](x, w)

    def addmm(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(("addmm", x.shape[0], w.shape[1]))
        return real["addmm"](b, x, w)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    rate = _matmul_floor(tiny_model, rows=3, steps=2)
    assert math.isfinite(rate) and rate > 0
    per_step = 7 * layers + 1  # q, k, v, o, gate, up, down per layer; the head
    assert len(calls) == per_step * (20 + 2 * REPEATS)
    assert all(rows == 3 for _, rows, _ in calls)
    kinds = {kind for kind, _, _ in calls}
    assert kinds == ({"mm", "addmm"} if flipped_faster else {"linear"})  # Qwen2: q/k/v biases
    assert sum(out == vocab for _, _, out in calls) == len(calls) // per_step
