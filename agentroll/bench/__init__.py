"""Benchmarks, run as ``agentroll bench NAME``; each prints one ``key=value`` result line.

One module per benchmark, each exposing ``add_arguments(parser)`` and ``main(args) -> int``;
``BENCHMARKS`` names them without importing them (some import torch).  Benchmarks import the
product; the product never imports them.
"""

from __future__ import annotations

# name -> (module, one-line help), in the order ``agentroll bench --help`` lists them
BENCHMARKS: dict[str, tuple[str, str]] = {
    "overhead": (
        "agentroll.bench.overhead",
        "engine overhead per tool turn (mock backend, real token path)",
    ),
    "engine": (
        "agentroll.bench.engine",
        "built-in engine tokens/s vs transformers (and vLLM)",
    ),
    "engine-profile": (
        "agentroll.bench.engine_profile",
        "where a decode step of the built-in engine goes: products, attention, sampling",
    ),
    "engine-dtype": (
        "agentroll.bench.engine_dtype",
        "the built-in engine serving bf16 weights vs fp32: decode speedup, bf16 floor",
    ),
    "sync": (
        "agentroll.bench.sync",
        "delta weight updates: bytes vs verl, encode/apply GB/s vs memcpy",
    ),
    "pause": (
        "agentroll.bench.pause",
        "weight syncs during fleet rollouts: pauses, restarts, busy fraction",
    ),
    "stream": (
        "agentroll.bench.stream",
        "trajectory streaming MB/s end to end vs loopback/disk",
    ),
    "chaos": (
        "agentroll.bench.chaos",
        "SIGKILL a served worker at random moments: lost / duplicated / split",
    ),
    "sandbox": (
        "agentroll.bench.sandbox",
        "sandbox acquire / cold start / exec latency vs `docker exec` (or sh)",
    ),
    "gateway": (
        "agentroll.bench.gateway",
        "gateway calls/s and server CPU per call, load from a separate process",
    ),
    "placement": (
        "agentroll.bench.placement",
        "separate vs colocated (waiting, or partial rollouts): steps/s, tail wait, sleep",
    ),
    "autoscale": (
        "agentroll.bench.autoscale",
        "an unbalanced separate-pools run with and without autoscale: idle imbalance",
    ),
    "appopt": (
        "agentroll.bench.appopt",
        "application-level optimisations (tool-result cache) with vs without: speedup",
    ),
    "vllm": (
        "agentroll.bench.vllm",
        "vllm backend tokens/s vs AsyncLLM.generate directly",
    ),
}

__all__ = ["BENCHMARKS"]
