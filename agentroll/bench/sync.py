"""``agentroll bench sync``: delta weight-update size and speed on a synthetic model.

Bytes: the delta against verl's sparse index-and-value baseline (``ratio_vs_verl``, exact, so
not paired).  Speed: encode and apply (A) against a plain memcpy of the same bytes (B) in
``--pairs`` alternating pairs; the main timed ratio is ``encode_gbps / memcpy_gbps`` per
pair, whose range is ``ratio_min``/``ratio_max`` (see ``main_sync``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from agentroll.bench.pairs import DEFAULT_PAIRS, alternate, check_pairs, median_side, paired_ratio
from agentroll.errors import ConfigError
from agentroll.weights.delta import Undo, decode_into, encode_tensor
from agentroll.weights.update import DTYPES, TensorUpdate, as_uint, tensor_checksum

REPEATS = 9  # timed verifications (not paired: no ratio is taken of them)
MEMCPY_REPEATS = 2  # runs of each copy per pair; the pair's figure is the fastest
SEED = 0
#: (name, share of the parameters); the hidden size sets the row length of 2-D tensors
_LAYOUT = (
    ("embed_tokens.weight", 0.20),
    ("layers.0.self_attn.qkv_proj.weight", 0.09),
    ("layers.0.self_attn.o_proj.weight", 0.03),
    ("layers.0.mlp.gate_up_proj.weight", 0.16),
    ("layers.0.mlp.down_proj.weight", 0.08),
    ("layers.1.mlp.gate_up_proj.weight", 0.16),
    ("layers.1.mlp.down_proj.weight", 0.08),
    ("lm_head.weight", 0.20),
)
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _log(msg: str) -> None:
    print(f"[bench sync] {msg}", flush=True)


def synthetic_shapes(params: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes that sum to exactly ``params`` elements; the remainder of
    the row rounding goes to a 1-D norm weight."""
    hidden = 1024 if params >= 1024 * 64 else 8
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for name, share in _LAYOUT:
        rows = int(params * share) // hidden
        if rows:
            shapes.append((name, (rows, hidden)))
    rest = params - sum(r * c for _, (r, c) in shapes)
    if rest:
        shapes.append(("norm.weight", (rest,)))
    return shapes


def _model(
    params: int, changed: float, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """(base, new, number of changed elements)."""
    gen = torch.Generator().manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    base: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    num_changed = 0
    for name, shape in synthetic_shapes(params):
        b = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        numel = b.numel()
        count = round(numel * changed)
        positions = rng.choice(numel, size=count, replace=False) if count else np.empty(0, int)
        old = b.reshape(-1)[torch.from_numpy(positions)].float()
        # about one ulp, like an optimizer step; where rounding gives the old bits back, the
        # last mantissa bit is flipped so that exactly ``count`` elements differ
        step = torch.randn(old.shape, generator=gen) * old.abs() * 2.0**-7
        moved = (old + step).to(dtype)
        n = b.clone()
        n.reshape(-1)[torch.from_numpy(positions)] = moved
        n_u, b_u = as_uint(n), as_uint(b)
        same = positions[n_u[positions] == b_u[positions]]
        n_u[same] ^= 1
        base[name], new[name] = b, n
        num_changed += count
    return base, new, num_changed


def _median_time(fn: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
    """(median seconds, every run's seconds) of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Delta:
    """Encode ``new`` against ``base`` and apply the result into a warm copy of the base,
    each step callable on its own so a bench can time it; ``restore`` undoes an apply."""

    def __init__(self, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        self.base, self.new = base, new
        self.live = {name: t.clone() for name, t in base.items()}
        self.updates: list[TensorUpdate] = []
        self.undos: list[Undo] = []

    def encode(self) -> None:
        self.updates = [encode_tensor(n, self.new[n], self.base[n]) for n in self.base]

    def apply(self) -> None:
        self.undos = [decode_into(u, self.live[u.name]) for u in self.updates]

    def restore(self) -> None:
        for u, undo in zip(self.updates, self.undos, strict=True):
            undo.restore(self.live[u.name])
        self.undos = []

    def verify(self) -> bool:
        """The applied copy's checksums match the updates' (the xxh3 after apply)."""
        return all(tensor_checksum(self.live[u.name]) == u.checksum for u in self.updates)

    def live_equals(self, model: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(as_uint_t(self.live[n]), as_uint_t(model[n])) for n in model)


class _Memcpy:
    """Plain copies of a model's bytes into already-written buffers, with torch ``copy_``
    (multi-threaded) and ``np.copyto`` (one thread, immune to a busy second core)."""

    def __init__(self, model: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.dst = {name: torch.empty_like(t) for name, t in model.items()}
        for name, t in self.dst.items():
            t.copy_(model[name])  # the destination is written once, so the timed copies are warm
        self.arrays = [(as_uint(self.dst[name]), as_uint(t)) for name, t in model.items()]

    def torch_copy(self) -> None:
        for name, t in self.dst.items():
            t.copy_(self.model[name])

    def numpy_copy(self) -> None:
        for d, s in self.arrays:
            np.copyto(d, s)

    def best_seconds(self, repeats: int) -> float:
        """The fastest of ``repeats`` runs of each way."""
        return min(min(_median_time(f, repeats)[1]) for f in (self.torch_copy, self.numpy_copy))


def _check_args(params: int, changed: float, dtype: str) -> torch.dtype:
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES or not DTYPES[name][0].is_floating_point:
        raise ConfigError(f"--dtype {dtype!r}: use one of {', '.join(_DTYPE_ALIASES)}")
    if params <= 0 or not 0.0 <= changed <= 1.0:
        raise ConfigError("--params must be positive and --changed in [0, 1]")
    return DTYPES[name][0]


def _paired(delta: _Delta, memcpy: _Memcpy, pairs: int) -> tuple[list[tuple[float, ...]], bool]:
    """``(encode s, apply s, memcpy s)`` per pair: encode and apply (A), then the copies
    (B); and whether every pair's apply gave the new bytes exactly."""
    exact: list[bool] = []

    def ours(_: int) -> tuple[float, float]:
        encode_s = _seconds(delta.encode)
        apply_s = _seconds(delta.apply)
        exact.append(delta.live_equals(delta.new))
        delta.restore()
        return encode_s, apply_s

    measured = alternate(ours, lambda _: memcpy.best_seconds(MEMCPY_REPEATS), pairs)
    return [(e, a, m) for (e, a), m in measured], all(exact)


def main_sync(params: int, changed: float, dtype: str, pairs: int = DEFAULT_PAIRS) -> None:
    """Run the benchmark and print ``[bench sync]`` progress lines and its result line.
    ``dtype``: bf16, fp16 or fp32 (or a torch dtype name such as ``bfloat16``); ``pairs``:
    alternating (encode + apply, memcpy) pairs, at least 5.

    The model has ``params`` elements (eight transformer-like matrices and a 1-D remainder)
    drawn from N(0, 0.02); a fraction ``changed`` of them, at seeded random positions, moves
    by about one ulp (what an optimizer step does to bf16 weights), so the replacement
    values keep the weights' own distribution.  Every tensor is encoded against the base
    (compare, gap code, zstd where it pays, xxh3 of the new bytes) and applied into a warm
    copy of the base (validate, decode, undo log, scatter).  Throughputs count model bytes
    per second; each pair times one encode and one apply (after a warm-up) and, for
    ``memcpy_gbps``, the fastest of ``MEMCPY_REPEATS`` plain copies into already-written
    buffers each with torch ``copy_`` and ``np.copyto``; each figure is the median over the
    pairs.  The xxh3 verification after apply is timed apart (``verify_gbps``, a progress
    line).  ``bitexact=1``: every pair's applied copy equals the new bytes and the checksums
    match."""
    torch_dtype = _check_args(params, changed, dtype)
    check_pairs(pairs)
    base, new, num_changed = _model(params, changed, torch_dtype)
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    _log(
        f"{params} params in {len(base)} tensors ({dtype}, {full_bytes / 1e6:.1f} MB), "
        f"{num_changed} changed ({changed:g}), {pairs} pairs"
    )
    delta, memcpy = _Delta(base, new), _Memcpy(new)
    delta.encode()  # warm-ups
    delta.apply()
    delta.restore()
    delta_bytes = sum(len(u.payload) for u in delta.updates)
    kinds = ", ".join(
        f"{u.name}:{u.encoding}/{u.compression}/{len(u.payload)}B" for u in delta.updates
    )
    _log(f"payloads: {kinds}")
    measured, bitexact = _paired(delta, memcpy, pairs)
    enc_s = median_side([e for e, _, _ in measured])
    apply_s = median_side([a for _, a, _ in measured])
    memcpy_s = median_side([m for _, _, m in measured])
    encode_vs_memcpy = paired_ratio([(m, e) for e, _, m in measured])  # GB/s over GB/s
    _log(
        f"encode: median {enc_s * 1e3:.1f} ms (compare, gap code, zstd, checksum of the new "
        f"bytes); apply: median {apply_s * 1e3:.1f} ms (decode, undo log, scatter; no "
        f"checksum); encode/memcpy median {encode_vs_memcpy.ratio:.3f}"
    )
    delta.apply()
    verify_s, _ = _median_time(delta.verify, REPEATS)
    checksums_ok = delta.verify()
    delta.restore()
    undo_exact = delta.live_equals(base)
    _log(
        f"verify: median {verify_s * 1e3:.1f} ms "
        f"verify_gbps={full_bytes / verify_s / 1e9:.2f} "
        f"apply_verified_gbps={full_bytes / (apply_s + verify_s) / 1e9:.2f} "
        f"checksums_ok={int(checksums_ok)} undo_exact={int(undo_exact)}"
    )
    verl_bytes = 6 * num_changed
    ratio = delta_bytes / verl_bytes if verl_bytes else float("nan")
    r = encode_vs_memcpy
    print(
        f"full_bytes={full_bytes} delta_bytes={delta_bytes} verl_bytes={verl_bytes} "
        f"ratio_vs_verl={ratio:.4f} encode_gbps={full_bytes / enc_s / 1e9:.3f} "
        f"apply_gbps={full_bytes / apply_s / 1e9:.3f} "
        f"memcpy_gbps={full_bytes / memcpy_s / 1e9:.3f} "
        f"bitexact={int(bitexact and checksums_ok)} pairs={r.pairs} "
        f"ratio_min={r.ratio_min:.3f} ratio_max={r.ratio_max:.3f}",
        flush=True,
    )


def as_uint_t(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (for bytewise equality)."""
    return torch.from_numpy(as_uint(t).view(np.uint8))


# -- command line --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SyncBenchConfig:
    """The options of ``agentroll bench sync``: a positive size and a fraction in [0, 1]."""

    params: int
    changed: float
    dtype: str
    pairs: int = DEFAULT_PAIRS

    def __post_init__(self) -> None:
        if self.params < 1 or not 0 <= self.changed <= 1:
            raise ConfigError(
                f"--params must be >= 1 and --changed within [0, 1] (got {self.params} and "
                f"{self.changed:g}); pass an element count and a fraction such as 0.01"
            )
        check_pairs(self.pairs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--changed", type=float, default=0.01, help="fraction of elements changed")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument(
        "--pairs",
        type=int,
        default=DEFAULT_PAIRS,
        help="alternating timed runs (encode + apply, memcpy), at least 5; figures are medians",
    )


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench (progress lines first) and print its result line."""
    config = SyncBenchConfig(args.params, args.changed, args.dtype, args.pairs)
    main_sync(config.params, config.changed, config.dtype, config.pairs)
    return 0
