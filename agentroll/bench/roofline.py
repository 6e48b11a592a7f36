"""The roofline floor of a decode step: weight bytes over read bandwidth, or matmul FLOPs over
peak FLOP/s, whichever takes longer.

``step_costs`` and ``decode_floor`` are pure arithmetic on a ``DecoderConfig`` and measured
rates.  ``read_bandwidth`` and ``peak_flops`` measure those rates on the current torch
threads: a streaming read of a buffer far larger than the caches, a large square gemm.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from agentroll.engine import kernels
from agentroll.engine.models.decoder import DecoderConfig, weight_shapes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What one decode step of ``batch`` rows must do at least (attention excluded)."""

    weight_bytes: int  # every weight read once: layers, final norm, the LM head
    matmul_params: int  # weights in matrix products: projections, MLP, the LM head
    matmul_flops: int  # 2 * matmul_params * batch


@dataclass(frozen=True, slots=True)
class Floor:
    """The floor of a decode step and which side sets it."""

    step_s: float
    tokens_per_s: float
    bound: str  # "memory" | "compute"
    memory_s: float
    compute_s: float


def step_costs(cfg: DecoderConfig, batch: int, dtype: str = "float32") -> StepCosts:
    """The weight bytes and matmul FLOPs of one decode step of ``batch`` sequences.

    The embedding is a gather of ``batch`` rows, not a read of the table, so it counts only
    as the LM head when the head is tied to it.  Attention over the context (KV reads and its
    FLOPs) is excluded: the floor is the weights' alone.  Raises ValueError for batch < 1.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    per = DTYPE_BYTES[dtype]
    params = matmul = 0
    for name, shape in weight_shapes(cfg).items():
        size = math.prod(shape)
        if name == "model.embed_tokens.weight":
            size = size if cfg.tie_word_embeddings else 0
        params += size
        if len(shape) == 2:
            matmul += size
    return StepCosts(
        weight_bytes=params * per, matmul_params=matmul, matmul_flops=2 * matmul * batch
    )


def decode_floor(costs: StepCosts, batch: int, bandwidth: float, peak_flops: float) -> Floor:
    """``batch / max(weight_bytes / bandwidth, matmul_flops / peak_flops)`` tokens/s.

    ``bandwidth`` in bytes/s and ``peak_flops`` in FLOP/s, both > 0 (ValueError otherwise).
    A tie counts as memory-bound.
    """
    if not (bandwidth > 0 and peak_flops > 0):
        raise ValueError(f"bandwidth and peak_flops must be > 0, got {bandwidth}, {peak_flops}")
    memory_s = costs.weight_bytes / bandwidth
    compute_s = costs.matmul_flops / peak_flops
    step = max(memory_s, compute_s)
    return Floor(
        step_s=step,
        tokens_per_s=batch / step,
        bound="memory" if memory_s >= compute_s else "compute",
        memory_s=memory_s,
        compute_s=compute_s,
    )


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of the best of ``repeats`` streaming reads (a sum) of an ``nbytes`` fp32
    buffer, on torch's current intra-op threads; the buffer is freed on return."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = math.inf
    with torch.inference_mode():
        buf.sum()  # pages touched, threads started
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
    del buf
    return nbytes / best


def peak_flops(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of the best of ``repeats`` products of two ``n`` x ``n`` matrices of ``dtype``
    (a large gemm: the rate matmuls reach here) on torch's current intra-op threads, by
    torch's own product and, for fp32, by the engine's kernels (packed brgemm) where they are
    built: the faster of the two sets the peak."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    ways = [lambda: torch.mm(a, b)]
    ext = kernels.get() if dtype == torch.float32 else None
    if ext is not None:
        packed = ext.pack_weight(b)
        ways.append(lambda: ext.linear_packed(a, packed, n, None, 0))
    best = math.inf
    with torch.inference_mode():
        for way in ways:
            way()  # warm-up: packing buffers, threads
            for _ in range(repeats):
                start = time.perf_counter()
                way()
                best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


__all__ = [
    "DTYPE_BYTES",
    "Floor",
    "StepCosts",
    "decode_floor",
    "peak_flops",
    "read_bandwidth",
    "step_costs",
]
