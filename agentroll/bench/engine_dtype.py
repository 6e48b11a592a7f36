"""``agentroll bench engine-dtype``: the built-in engine serving bf16 weights against fp32.

The same engine in ``bfloat16`` (A) and ``float32`` (B) in alternating pairs of the
prefill/decode phases of ``bench engine`` (new random prompts each pair, the same for both);
``decode_speedup`` is the median (min, max) of the per-pair bf16/fp32 decode tokens/s.  The
bf16 floor, measured in every pair right after the bf16 side: bf16 weights read once at the
measured read bandwidth, or the products at the measured bf16 gemm peak, whichever is slower;
``bf16_floor_fraction`` is the median of each pair's bf16 decode over that pair's floor.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path
from typing import Any

import torch

from agentroll.bench.engine import (
    DEFAULT_PAIRS,
    DEFAULT_PROMPT_LEN,
    Phases,
    _log,
    _Ours,
    _Roofline,
    _roofline,
    _valid_ids,
    phase_prompts,
    roofline_fields,
)
from agentroll.bench.pairs import alternate_async, median_side, paired_ratio
from agentroll.engine.engine import default_threads
from agentroll.engine.models.decoder import read_config
from agentroll.model.shapes import SHAPES, ensure_shape_model
from agentroll.model.tiny import ensure_tiny_model


async def _pairs(
    model: Path, requests: int, prompt_len: int, max_tokens: int, pairs: int, threads: int
) -> tuple[list[tuple[Phases, Phases]], list[_Roofline]]:
    """The bf16 (A) and fp32 (B) engines' phases per pair, and each pair's bf16 floor."""
    cfg = read_config(model)
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    kv_mb = max(
        256, math.ceil(1.25 * requests * (prompt_len + max_tokens + 16) * kv_per_token / 2**20)
    )
    ids = _valid_ids(model)
    warm = phase_prompts(ids, requests, prompt_len, "warm-up")
    bf16 = _Ours(
        model, warm, max_tokens, False, threads=threads, kv_cache_mb=kv_mb, dtype="bfloat16"
    )
    fp32 = _Ours(model, warm, max_tokens, False, threads=threads, kv_cache_mb=kv_mb)
    async with bf16, fp32:
        kernels = bf16.backend.engine.runner.kernels is not None
        _log(f"bf16 engine on the kernels' bf16 products: {kernels}")

        def prompts(i: int, phase: str) -> list[list[int]]:
            return phase_prompts(ids, requests, prompt_len, f"{i}-{phase}")

        seen: list[Phases] = []
        floors: list[_Roofline] = []

        async def measure_bf16(i: int) -> Phases:
            seen.append(await bf16.phases(i, prompts(i, "pre"), prompts(i, "full")))
            floors.append(_roofline(model, requests, "bfloat16"))
            return seen[-1]

        async def measure_fp32(i: int) -> Phases:
            b = await fp32.phases(i, prompts(i, "pre"), prompts(i, "full"))
            _log(
                f"pair {i + 1}/{pairs}: decode tokens/s bf16 {seen[-1].decode_tokens_per_s:.1f} "
                f"(floor {floors[-1].floor.tokens_per_s:.1f}), fp32 {b.decode_tokens_per_s:.1f}"
            )
            return b

        return await alternate_async(measure_bf16, measure_fp32, pairs), floors


def main(args: argparse.Namespace) -> int:
    model = (
        ensure_tiny_model(None)
        if args.shape == "tiny"
        else ensure_shape_model(args.shape, progress=_log)
    )
    cfg = read_config(model)
    threads = args.threads or default_threads(cfg)
    torch.set_num_threads(threads)
    n = args.concurrency
    _log(
        f"shape={args.shape} requests={n} prompt_len={args.prompt_len} "
        f"max_tokens={args.max_tokens} threads={threads} pairs={args.pairs}"
    )
    measured, floors = asyncio.run(
        _pairs(model, n, args.prompt_len, args.max_tokens, args.pairs, threads)
    )
    speedup = paired_ratio([(a.decode_tokens_per_s, b.decode_tokens_per_s) for a, b in measured])
    prefill = paired_ratio([(a.prefill_tokens_per_s, b.prefill_tokens_per_s) for a, b in measured])
    decode_bf16 = median_side([a.decode_tokens_per_s for a, _ in measured])
    fields: dict[str, Any] = {
        "shape": args.shape,
        "concurrency": n,
        "threads": threads,
        "decode_tokens_per_s_bf16": f"{decode_bf16:.1f}",
        "decode_tokens_per_s_fp32": f"{median_side([b.decode_tokens_per_s for _, b in measured]):.1f}",
        "decode_speedup": f"{speedup.ratio:.2f}",
        "decode_speedup_min": f"{speedup.ratio_min:.2f}",
        "decode_speedup_max": f"{speedup.ratio_max:.2f}",
        "prefill_speedup": f"{prefill.ratio:.2f}",
        **roofline_fields([a.decode_tokens_per_s for a, _ in measured], floors, "bf16_"),
        "peak_bf16_gflops": f"{median_side([f.bf16_flops / 1e9 for f in floors]):.1f}",
        "pairs": speedup.pairs,
    }
    print(" ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


def row_name(args: argparse.Namespace) -> str:
    """``engine-dtype:SHAPE:cN``: a row per shape and batch size."""
    return f"engine-dtype:{args.shape}:c{args.concurrency}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="smollm2-360m", choices=sorted(SHAPES))
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN)
    parser.add_argument("--pairs", type=int, default=DEFAULT_PAIRS)
    parser.add_argument("--threads", type=int, default=None)
