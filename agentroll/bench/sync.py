"""``agentroll bench sync``: delta weight-update size and speed on a synthetic model.

A model of ``params`` elements (eight transformer-like matrices and a 1-D remainder) drawn
from N(0, 0.02) and a copy; a fraction ``changed`` of the elements, at seeded random
positions, moves by about one ulp (what an optimizer step does to bf16 weights), so the
replacement values keep the weights' own distribution.  Every tensor is encoded against the
base (compare, gap code, zstd where it pays, xxh3 of the new bytes) and applied into a warm
copy of the base (validate, decode, undo log, scatter).  Throughputs count model bytes per
second and are medians of ``REPEATS`` timed runs after a warm-up; the xxh3 verification
after apply is timed apart (``verify_gbps``, progress line).  ``memcpy_gbps`` is the best of
``MEMCPY_REPEATS`` plain copies of the same bytes into already-written buffers, with torch
``copy_`` and with ``np.copyto``, whichever is faster.  Prints ``[bench sync]`` progress
lines and one final ``key=value`` result line.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from agentroll.errors import ConfigError
from agentroll.weights.delta import Undo, decode_into, encode_tensor
from agentroll.weights.update import DTYPES, TensorUpdate, as_uint, tensor_checksum

REPEATS = 9
MEMCPY_REPEATS = 9
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


def main_sync(params: int, changed: float, dtype: str) -> None:
    """Run the benchmark and print its result line.  ``dtype``: bf16, fp16 or fp32 (or a
    torch dtype name such as ``bfloat16``)."""
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES or not DTYPES[name][0].is_floating_point:
        raise ConfigError(f"--dtype {dtype!r}: use one of {', '.join(_DTYPE_ALIASES)}")
    if params <= 0 or not 0.0 <= changed <= 1.0:
        raise ConfigError("--params must be positive and --changed in [0, 1]")
    torch_dtype = DTYPES[name][0]
    base, new, num_changed = _model(params, changed, torch_dtype)
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    _log(
        f"{params} params in {len(base)} tensors ({dtype}, {full_bytes / 1e6:.1f} MB), "
        f"{num_changed} changed ({changed:g})"
    )

    updates: list[TensorUpdate] = []

    def encode() -> None:
        updates[:] = [encode_tensor(name, new[name], base[name]) for name in base]

    encode()  # warm-up
    enc_s, enc_all = _median_time(encode, REPEATS)
    delta_bytes = sum(len(u.payload) for u in updates)
    kinds = ", ".join(f"{u.name}:{u.encoding}/{u.compression}/{len(u.payload)}B" for u in updates)
    _log(f"payloads: {kinds}")
    _log(
        f"encode: median {enc_s * 1e3:.1f} ms, best {min(enc_all) * 1e3:.1f} ms "
        f"(compare, gap code, zstd, checksum of the new bytes)"
    )

    live = {name: t.clone() for name, t in base.items()}
    undos: list[Undo] = []

    def apply() -> None:
        undos[:] = [decode_into(u, live[u.name]) for u in updates]

    def restore() -> None:
        for u, undo in zip(updates, undos, strict=True):
            undo.restore(live[u.name])

    apply_times = []
    for rep in range(REPEATS + 1):
        start = time.perf_counter()
        apply()
        elapsed = time.perf_counter() - start
        if rep:  # the first run is the warm-up
            apply_times.append(elapsed)
        if rep < REPEATS:
            restore()
    apply_s = statistics.median(apply_times)
    bitexact = all(torch.equal(as_uint_t(live[n]), as_uint_t(new[n])) for n in new)

    checks: list[bool] = []

    def verify() -> None:
        checks[:] = [tensor_checksum(live[u.name]) == u.checksum for u in updates]

    verify_s, _ = _median_time(verify, REPEATS)
    restore()
    undo_exact = all(torch.equal(as_uint_t(live[n]), as_uint_t(base[n])) for n in base)
    _log(
        f"apply: median {apply_s * 1e3:.1f} ms, best {min(apply_times) * 1e3:.1f} ms "
        f"(decode, undo log, scatter; no checksum); verify: median {verify_s * 1e3:.1f} ms "
        f"verify_gbps={full_bytes / verify_s / 1e9:.2f} "
        f"apply_verified_gbps={full_bytes / (apply_s + verify_s) / 1e9:.2f} "
        f"checksums_ok={int(all(checks))} undo_exact={int(undo_exact)}"
    )

    memcpy_gbps = _memcpy_gbps(new)
    verl_bytes = 6 * num_changed
    ratio = delta_bytes / verl_bytes if verl_bytes else float("nan")
    print(
        f"full_bytes={full_bytes} delta_bytes={delta_bytes} verl_bytes={verl_bytes} "
        f"ratio_vs_verl={ratio:.4f} encode_gbps={full_bytes / enc_s / 1e9:.3f} "
        f"apply_gbps={full_bytes / apply_s / 1e9:.3f} memcpy_gbps={memcpy_gbps:.3f} "
        f"bitexact={int(bitexact and all(checks))}",
        flush=True,
    )


def _memcpy_gbps(model: dict[str, torch.Tensor]) -> float:
    """Model bytes per second of the fastest plain copy into already-written buffers: the
    best of ``MEMCPY_REPEATS`` runs each of torch ``copy_`` (multi-threaded) and
    ``np.copyto`` (one thread, immune to a busy second core)."""
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    dst = {name: torch.empty_like(t) for name, t in model.items()}
    for name, t in dst.items():
        t.copy_(model[name])  # the destination is written once, so the timed copies are warm
    pairs = [(as_uint(dst[name]), as_uint(t)) for name, t in model.items()]

    def torch_copy() -> None:
        for name, t in dst.items():
            t.copy_(model[name])

    def numpy_copy() -> None:
        for d, s in pairs:
            np.copyto(d, s)

    best = min(min(_median_time(f, MEMCPY_REPEATS)[1]) for f in (torch_copy, numpy_copy))
    return nbytes / best / 1e9


def as_uint_t(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (for bytewise equality)."""
    return torch.from_numpy(as_uint(t).view(np.uint8))
