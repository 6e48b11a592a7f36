"""``agentroll bench engine-profile``: where one decode step of the built-in engine goes.

Times decode steps of ``LLMEngine`` at a shape (every request past its prefill): the whole
step, the model's forward inside it, and the sampler (medians), and with the C++ kernels the
regions of ``decoder_forward`` timed inside the steps (means: products, attention, norms,
RoPE, activation, LM head).  On torch ops each product is timed alone instead, in the step's
order over every layer's weights.  The step's rest beyond forward and sampler is the
scheduler and Python.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from agentroll.backends.base import SamplingParams
from agentroll.bench.engine import DEFAULT_PROMPT_LEN, _log, phase_prompts
from agentroll.bench.engine import _valid_ids as valid_ids
from agentroll.engine.engine import default_threads
from agentroll.engine.models.decoder import read_config
from agentroll.model.shapes import SHAPES, ensure_shape_model
from agentroll.model.tiny import ensure_tiny_model


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    return wrapper


def _products_ms(
    products: list[tuple[str, torch.Tensor]], rows: int, linear: Any, repeats: int = 3
) -> dict[str, float]:
    """Milliseconds per step of each kind of product, run in the step's order over every
    layer's weights (so each weight streams from memory as in a real step, not from a cache
    it was left in): per kind, the best of ``repeats`` sums over the step."""
    inputs = {wt.shape[0]: torch.randn(rows, wt.shape[0]) for _, wt in products}
    best: dict[str, float] = {}
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first is a warm-up
            total: dict[str, float] = {}
            for kind, wt in products:
                start = time.perf_counter()
                linear(inputs[wt.shape[0]], wt)
                total[kind] = total.get(kind, 0.0) + time.perf_counter() - start
            best = {k: min(v, best.get(k, float("inf"))) for k, v in total.items()}
    return {k: v * 1e3 for k, v in best.items()}


def main(args: argparse.Namespace) -> int:
    from agentroll.engine import engine as engine_mod
    from agentroll.engine.engine import EngineConfig, LLMEngine

    model = (
        ensure_tiny_model(None)
        if args.shape == "tiny"
        else ensure_shape_model(args.shape, progress=_log)
    )
    cfg = read_config(model)
    threads = args.threads or default_threads(cfg)
    torch.set_num_threads(threads)
    n, steps = args.concurrency, args.steps
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    kv_mb = max(256, 5 * n * (args.prompt_len + steps + 32) * per_token // 4 // 2**20)
    eng = LLMEngine(
        EngineConfig(
            model=str(model), num_threads=threads, max_num_seqs=max(64, n), kv_cache_mb=kv_mb
        )
    )
    params = SamplingParams(temperature=1.0, max_tokens=steps + 8, ignore_eos=True)
    for i, prompt in enumerate(phase_prompts(valid_ids(model), n, args.prompt_len, "profile")):
        eng.add_request(f"r{i}", prompt, params, seed=i)
    _log(f"shape={args.shape} requests={n} prompt_len={args.prompt_len} threads={threads}")
    while any(len(r.logprobs) == 0 for r in eng.requests.values()):
        eng.step()  # prefill (and each request's first token)
    step_s: list[float] = []
    forward_s: list[float] = []
    sample_s: list[float] = []
    ext = eng.runner.kernels
    regions: list[str] = list(ext.decoder_regions()) if ext is not None else []
    eng.runner.step_timings = torch.zeros(len(regions), dtype=torch.float64)
    runner_forward, sampler = eng.runner.forward, engine_mod.sample
    eng.runner.forward = _timed(runner_forward, forward_s)  # type: ignore[method-assign]
    engine_mod.sample = _timed(sampler, sample_s)
    try:
        for i in range(steps):
            start = time.perf_counter()
            eng.step()
            step_s.append(time.perf_counter() - start)
            if (i + 1) % max(1, steps // 4) == 0:
                _log(f"decode step {i + 1}/{steps}: {step_s[-1] * 1e3:.1f} ms")
    finally:
        eng.runner.forward = runner_forward  # type: ignore[method-assign]
        engine_mod.sample = sampler
        timings, eng.runner.step_timings = eng.runner.step_timings, torch.empty(0)
    ms = {k: statistics.median(v) * 1e3 for k, v in
          (("step", step_s), ("forward", forward_s), ("sample", sample_s))}  # fmt: skip
    if regions:  # timed inside decoder_forward: means over the steps
        parts = {name: float(t) * 1e3 / steps for name, t in zip(regions, timings, strict=True)}
        rest_name, rest = "forward_rest_ms", ms["forward"] - sum(parts.values())
    else:  # torch ops: each product alone, in the step's order, over every layer's weights
        weights = eng.runner._fused_weights()
        # decoder_forward's order: embed, norm, head^T, then 10 tensors per layer (1: qkv^T,
        # 5: o^T, 8: gate_up^T, 9: down^T)
        products = [
            (kind, weights[3 + 10 * i + j])
            for i in range(cfg.num_layers)
            for kind, j in (("qkv", 1), ("o_proj", 5), ("gate_up", 8), ("down", 9))
        ]
        parts = _products_ms([*products, ("lm_head", weights[2])], n, torch.mm)
        rest_name, rest = "attention_norms_rest_ms", ms["forward"] - sum(parts.values())
    overhead = ms["step"] - ms["forward"] - ms["sample"]
    fields = {
        "shape": args.shape,
        "concurrency": n,
        "threads": threads,
        "step_ms": f"{ms['step']:.2f}",
        "forward_ms": f"{ms['forward']:.2f}",
        **{f"{k}_ms": f"{v:.2f}" for k, v in parts.items()},
        rest_name: f"{rest:.2f}",
        "sample_ms": f"{ms['sample']:.2f}",
        "scheduler_python_ms": f"{overhead:.2f}",
        "decode_tokens_per_s": f"{n / (ms['step'] / 1e3):.1f}",
    }
    print(" ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="smollm2-360m", choices=sorted(SHAPES))
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN)
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--threads", type=int, default=None)
