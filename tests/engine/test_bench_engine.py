"""The matmul floor of ``bench engine``: every linear layer and the LM head, once per step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from agentroll.bench_engine import REPEATS, _matmul_floor


def test_matmul_floor_times_every_linear_layer_and_the_head(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    calls: list[tuple[int, ...]] = []
    linear = torch.nn.functional.linear

    def counting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((*x.shape, w.shape[0]))
        return linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    rate = _matmul_floor(tiny_model, rows=3, steps=2)
    assert math.isfinite(rate) and rate > 0
    per_step = 7 * layers + 1  # q, k, v, o, gate, up, down per layer; the head
    assert len(calls) == per_step * (20 + 2 * REPEATS)
    assert all(rows == 3 for rows, _, _ in calls)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    assert sum(out == vocab for _, _, out in calls) == len(calls) // per_step
