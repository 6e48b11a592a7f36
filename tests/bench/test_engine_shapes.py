"""``bench engine --shape``: the shape table matches the named models, checkpoints are cached
and written atomically, the roofline floor's arithmetic, and the result line's new keys."""

from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from agentroll.bench import engine as bench_engine
from agentroll.bench.roofline import decode_floor, step_costs
from agentroll.engine.models.decoder import DecoderConfig, load_model
from agentroll.errors import ConfigError
from agentroll.model import shapes
from agentroll.model.shapes import SHAPES, Shape, ensure_shape_model, num_params, shape_config

# a Llama shape small enough to write in milliseconds: 2 layers, 64-wide heads, tied head
_SMALL = Shape("small", "LlamaForCausalLM", 128, 2, 2, 1, 256, 4096, True, 1e5, 1e-5, 2048)


@pytest.mark.parametrize("name", [n for n, s in SHAPES.items() if s.reference_params])
def test_shape_configs_load_and_match_the_named_models(name: str) -> None:
    shape = SHAPES[name]
    cfg = DecoderConfig.from_dict(shape_config(shape))
    assert cfg.architecture == "llama" and cfg.tie_word_embeddings and cfg.head_dim == 64
    assert shape.reference_params is not None
    assert abs(num_params(cfg) / shape.reference_params - 1) < 0.02
    with torch.device("meta"):  # the engine's model builds from it (no memory)
        from agentroll.engine.models.decoder import DecoderModel

        model = DecoderModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)


def test_unknown_shape_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="smollm2-360m"):
        shapes.get_shape("gpt-5")
    with pytest.raises(ConfigError, match="shape"):
        bench_engine.EngineBenchConfig(4, 4, None, None, shape="gpt-5")


def test_checkpoint_is_cached_reused_and_loads(tmp_path: Path) -> None:
    lines: list[str] = []
    first = ensure_shape_model("small", cache=tmp_path, shape=_SMALL, progress=lines.append)
    assert first.parent == tmp_path and first.name.startswith("small-")
    assert any("random weights" in line for line in lines) and "created" in lines[-1]
    model = load_model(first)  # tied head, vocab above the tokenizer's 2048
    assert model.config.vocab_size == 4096 and model.lm_head is None
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again: list[str] = []
    assert ensure_shape_model("small", cache=tmp_path, shape=_SMALL, progress=again.append) == first
    assert again == [] and (first / "model.safetensors").stat().st_mtime_ns == stamp
    # a different seed or shape is a different directory
    other = ensure_shape_model("small", cache=tmp_path, shape=_SMALL, seed=1)
    assert other != first and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [first.name, other.name]
    )


def test_a_killed_write_leaves_no_checkpoint_and_is_cleaned_up(tmp_path: Path) -> None:
    """SIGKILL while the weights are written: nothing under the final name; the next call
    removes the partial directory and writes a whole checkpoint."""
    code = f"""
import os, signal
from agentroll.model import tiny
from agentroll.model.shapes import Shape, ensure_shape_model
real = tiny.write_checkpoint
def dying(out, *a, **k):
    real(out, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
tiny.write_checkpoint = dying
ensure_shape_model("small", cache={str(tmp_path)!r}, shape=Shape(*{dataclasses.astuple(_SMALL)!r}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2])
    assert proc.returncode == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".small-") and ".tmp" in left[0]
    final = ensure_shape_model("small", cache=tmp_path, shape=_SMALL)
    assert [p.name for p in tmp_path.iterdir()] == [final.name]
    assert load_model(final).config.num_layers == 2


def test_step_costs_count_every_weight_once_and_the_tied_head() -> None:
    cfg = DecoderConfig.from_dict(shape_config(SHAPES["smollm2-360m"]))
    costs = step_costs(cfg, batch=4)
    # tied: the embedding table is read once, as the head; norms are read, not multiplied
    assert costs.weight_bytes == 4 * num_params(cfg)
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    assert costs.matmul_params == num_params(cfg) - norms
    assert costs.matmul_flops == 2 * costs.matmul_params * 4
    untied = DecoderConfig.from_dict({**shape_config(SHAPES["tiny"]), "vocab_size": 2048})
    c = step_costs(untied, batch=1, dtype="bfloat16")
    embed = 2048 * 128
    assert c.weight_bytes == 2 * (num_params(untied) - embed)  # the gather is not a read
    with pytest.raises(ValueError, match="batch"):
        step_costs(cfg, batch=0)


def test_decode_floor_takes_the_slower_side() -> None:
    costs = bench_engine.StepCosts(weight_bytes=1_000, matmul_params=250, matmul_flops=500 * 8)
    # 1000 B at 100 B/s = 10 s; 4000 FLOP at 1000 FLOP/s = 4 s: memory-bound, 8 / 10 tokens/s
    mem = decode_floor(costs, batch=8, bandwidth=100.0, peak_flops=1000.0)
    assert mem.bound == "memory" and mem.step_s == 10.0 and mem.tokens_per_s == 0.8
    comp = decode_floor(costs, batch=8, bandwidth=1000.0, peak_flops=100.0)
    assert comp.bound == "compute" and comp.step_s == 40.0 and comp.tokens_per_s == 0.2
    assert (comp.memory_s, comp.compute_s) == (1.0, 40.0)
    with pytest.raises(ValueError):
        decode_floor(costs, batch=8, bandwidth=0.0, peak_flops=1.0)


def test_phases_split_prefill_and_decode() -> None:
    ph = bench_engine.Phases(requests=4, prompt_tokens=400, prefill_s=2.0, generated=40, full_s=5.0)
    assert ph.prefill_tokens_per_s == 200.0 and ph.tokens_per_s == 8.0
    assert ph.decode_tokens_per_s == 36 / 3.0  # tokens after each first, time after prefill
    assert math.isnan(bench_engine.Phases(4, 400, 2.0, 4, 5.0).decode_tokens_per_s)
    assert math.isnan(bench_engine.Phases(4, 400, 6.0, 40, 5.0).decode_tokens_per_s)


def test_steady_window_counts_tokens_while_every_request_decodes() -> None:
    # request a: first token at 1.0, then one per second to 6.0; b starts at 3.0, ends at 9.0
    a = [(1.0, 1)] + [(float(t), 1) for t in range(2, 7)]
    b = [(3.0, 1)] + [(float(t), 2) for t in range(4, 10)]
    tokens, seconds = bench_engine.steady_window([a, b])
    # window (3.0, 6.0]: a's tokens at 4, 5, 6 and b's at 4, 5, 6 (two each)
    assert (tokens, seconds) == (3 + 6, 3.0)
    ph = bench_engine.Phases(2, 20, 1.0, 18, 10.0, tokens, seconds)
    assert ph.decode_tokens_per_s == 3.0
    assert ph.whole_decode_tokens_per_s == 16 / 9.0  # the ramp and the tail included
    # a request done before another starts, or one that got nothing: no steady state
    assert bench_engine.steady_window([[(1.0, 1), (2.0, 1)], [(3.0, 1), (4.0, 1)]]) == (0, 0.0)
    assert bench_engine.steady_window([a, []]) == (0, 0.0)
    assert bench_engine.steady_window([]) == (0, 0.0)
    # without one, decode falls back to the whole decode
    assert bench_engine.Phases(2, 20, 1.0, 18, 10.0).decode_tokens_per_s == 16 / 9.0


def test_phase_prompts_are_seeded_valid_and_unshared() -> None:
    ids = list(range(10, 2000))
    a = bench_engine.phase_prompts(ids, 3, 50, "0-pre")
    assert a == bench_engine.phase_prompts(ids, 3, 50, "0-pre")
    assert a != bench_engine.phase_prompts(ids, 3, 50, "0-full")
    assert all(len(p) == 50 and set(p) <= set(ids) for p in a)
    assert len({tuple(p[:4]) for p in a}) == 3


def test_row_names_keep_shapes_apart() -> None:
    assert bench_engine.row_name(argparse.Namespace(shape="tiny")) == "engine"
    assert bench_engine.row_name(argparse.Namespace(shape="llama-1b")) == "engine:llama-1b"
    four = argparse.Namespace(shape="smollm2-360m", concurrency=4)
    assert bench_engine.row_name(four) == "engine:smollm2-360m:c4"


def test_engine_dtype_pairs_bf16_against_fp32(capsys: pytest.CaptureFixture[str]) -> None:
    from agentroll.bench import engine_dtype

    args = argparse.Namespace(
        shape="tiny", concurrency=2, max_tokens=48, prompt_len=16, pairs=5, threads=None
    )
    assert engine_dtype.main(args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in line.split())
    assert fields["pairs"] == "5" and fields["shape"] == "tiny"
    lo, mid, hi = (
        float(fields[k]) for k in ("decode_speedup_min", "decode_speedup", "decode_speedup_max")
    )
    assert 0 < lo <= mid <= hi
    assert float(fields["decode_tokens_per_s_bf16"]) > 0 < float(fields["bf16_floor_tokens_per_s"])
    assert fields["bound"] in ("memory", "compute")
    assert engine_dtype.row_name(args) == "engine-dtype:tiny:c2"


def test_result_line_carries_the_shape_and_floor_keys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real-shape run (systems faked, the floor's rates fixed) prints one key=value line with
    prefill/decode, the ratio to vLLM with its range, the floor, its bound and fraction."""
    model = ensure_shape_model("small", cache=tmp_path, shape=_SMALL)
    seen: dict[str, Any] = {}

    async def phased(
        m: Path, ids: list[int], n: int, plen: int, mt: int, pairs: int, t: int, hf: bool = True
    ):
        seen.update(ids=ids, threads=t, plen=plen, hf=hf)
        ours = [bench_engine.Phases(n, n * plen, 1.0, n * mt, 1.0 + n * (mt - 1) / 80.0)] * pairs
        other = [bench_engine.Phases(n, n * plen, 2.0, n * mt, 2.0 + n * (mt - 1) / 40.0)] * pairs
        roofs = [bench_engine._roofline(m, n)] * pairs
        hf_side = other if hf else [None] * pairs
        return bench_engine._Phased(ours=ours, hf=hf_side, vllm=other, roofs=roofs)

    monkeypatch.setattr(bench_engine, "_phased", phased)
    monkeypatch.setattr(bench_engine, "read_bandwidth", lambda: 1e10)
    monkeypatch.setattr(bench_engine, "peak_flops", lambda dtype: 1e11)
    monkeypatch.setattr(bench_engine, "ensure_shape_model", lambda *a, **k: model)
    bench_engine.main_engine(4, 8, None, None, 5, shape="smollm2-360m", prompt_len=32)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in line.split())
    assert fields["shape"] == "smollm2-360m" and fields["prompt_len"] == "32"
    assert fields["threads"] == "1" == str(seen["threads"])  # 128 wide: the engine's choice
    special = {
        t.token_to_id(x)
        for t in [Tokenizer.from_file(str(model / "tokenizer.json"))]
        for x in ("<|im_end|>", "<|endoftext|>", "<tool_call>")
    }
    assert max(seen["ids"]) < shapes.TOKENIZER_VOCAB and not special & set(seen["ids"])
    assert float(fields["decode_tokens_per_s"]) == 80.0
    assert float(fields["vllm_decode_tokens_per_s"]) == 40.0
    assert fields["decode_ratio_vs_vllm"] == "2.00" == fields["decode_ratio_vs_vllm_min"]
    costs = step_costs(DecoderConfig.from_dict(shape_config(_SMALL)), 4)
    floor = decode_floor(costs, 4, 1e10, 1e11)
    assert fields["bound"] == floor.bound
    assert float(fields["floor_tokens_per_s"]) == pytest.approx(floor.tokens_per_s, rel=1e-3)
    assert float(fields["floor_fraction"]) == pytest.approx(80.0 / floor.tokens_per_s, abs=1e-3)
    for key in ("prefill_tokens_per_s", "ratio_vs_vllm", "ratio_vs_vllm_min", "pairs"):
        assert key in fields


def test_floor_fraction_is_the_median_of_each_pairs_own_fraction() -> None:
    """Each pair's decode is set against the floor measured beside it: the fraction is the
    median of those per-pair fractions (0.625 here), not median decode over median floor
    (80 / 160 = 0.5); the rates are medians with the bandwidth's range, the bound the most
    pairs' bound."""
    costs = step_costs(DecoderConfig.from_dict(shape_config(_SMALL)), 4)
    decodes = [80.0, 40.0, 100.0, 100.0, 50.0]
    floors = [100.0, 200.0, 160.0, 400.0, 80.0]
    roofs = [
        bench_engine._Roofline(
            costs,
            decode_floor(costs, 4, f * costs.weight_bytes / 4, 1e18),  # memory-bound at f
            f * costs.weight_bytes / 4,
            1e18,
            2e18,
        )
        for f in floors
    ]
    ours = [bench_engine.Phases(4, 128, 1.0, 32, 2.0, int(d), 1.0) for d in decodes]
    ph = bench_engine._Phased(ours=ours, hf=[None] * 5, vllm=[None] * 5, roofs=roofs)
    fields = bench_engine.phase_fields(ph)
    assert fields["floor_fraction"] == "0.625"
    assert (fields["floor_fraction_min"], fields["floor_fraction_max"]) == ("0.200", "0.800")
    assert fields["floor_tokens_per_s"] == "160.0" and fields["bound"] == "memory"
    gbps = sorted(f * costs.weight_bytes / 4 / 1e9 for f in floors)
    assert fields["read_gbps"] == f"{gbps[2]:.2f}"
    assert (fields["read_gbps_min"], fields["read_gbps_max"]) == (
        f"{gbps[0]:.2f}",
        f"{gbps[-1]:.2f}",
    )
    # bench engine-dtype's bf16 floor: the same summary under its own names
    bf16 = bench_engine.roofline_fields(decodes, roofs, "bf16_")
    assert bf16["bf16_floor_fraction"] == "0.625" and "floor_fraction" not in bf16
    assert bf16["bf16_floor_tokens_per_s"] == "160.0" and bf16["read_gbps"] == fields["read_gbps"]


def test_no_hf_leaves_transformers_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--no-hf: transformers is not loaded, its keys are nan and vLLM's ratios stay."""
    model = ensure_shape_model("small", cache=tmp_path, shape=_SMALL)
    seen: dict[str, Any] = {}

    async def phased(
        m: Path, ids: list[int], n: int, plen: int, mt: int, pairs: int, t: int, hf: bool = True
    ):
        seen["hf"] = hf
        ours = [bench_engine.Phases(n, n * plen, 1.0, n * mt, 1.0, n * (mt - 1), 0.5)] * pairs
        vllm = [bench_engine.Phases(n, n * plen, 2.0, n * mt, 2.0, n * (mt - 1), 1.0)] * pairs
        roofs = [bench_engine._roofline(m, n)] * pairs
        return bench_engine._Phased(ours=ours, hf=[None] * pairs, vllm=vllm, roofs=roofs)

    monkeypatch.setattr(bench_engine, "_phased", phased)
    monkeypatch.setattr(bench_engine, "read_bandwidth", lambda: 1e10)
    monkeypatch.setattr(bench_engine, "peak_flops", lambda dtype: 1e11)
    monkeypatch.setattr(bench_engine, "ensure_shape_model", lambda *a, **k: model)
    bench_engine.main_engine(4, 8, None, None, 5, shape="smollm2-360m", prompt_len=32, hf=False)
    fields = dict(
        kv.split("=", 1) for kv in capsys.readouterr().out.strip().split("\n")[-1].split()
    )
    assert seen["hf"] is False
    assert fields["hf_batch_decode_tokens_per_s"] == "nan" == fields["ratio_vs_hf_batch"]
    assert fields["decode_ratio_vs_vllm"] == "2.00" and fields["pairs"] == "5"
    assert float(fields["decode_tokens_per_s"]) == 56.0  # the steady state: 28 tokens / 0.5 s
    with pytest.raises(ConfigError, match="--no-hf"):
        bench_engine.EngineBenchConfig(4, 4, None, None, shape="tiny", hf=False)


def test_engine_profile_splits_a_decode_step(capsys: pytest.CaptureFixture[str]) -> None:
    from agentroll.bench import engine_profile

    args = argparse.Namespace(shape="tiny", concurrency=2, prompt_len=16, steps=4, threads=None)
    assert engine_profile.main(args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in line.split())
    parts = ("qkv", "o_proj", "gate_up", "down", "lm_head", "sample", "scheduler_python")
    assert all(float(fields[f"{p}_ms"]) >= 0 for p in parts)
    assert float(fields["forward_ms"]) <= float(fields["step_ms"])
    assert fields["shape"] == "tiny" and fields["threads"] == "1"
