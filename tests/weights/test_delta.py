"""Delta codec: bit-exact round trips, size choices, chunk and block boundaries, undo, and
malformed payloads refused before anything is written."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from agentroll.errors import WeightSyncError
from agentroll.weights import delta
from agentroll.weights.delta import changed_fraction, decode_into, encode_tensor
from agentroll.weights.update import TensorUpdate, as_uint, tensor_checksum

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: bit patterns a float compare would miss or mangle: -0.0 vs 0.0, NaNs with other payloads
SPECIAL = {
    torch.bfloat16: [(0x0000, 0x8000), (0x7FC0, 0x7FC1), (0xFFC0, 0x7FC0), (0x7F80, 0x7F81)],
    torch.float16: [(0x0000, 0x8000), (0x7E00, 0x7E01), (0xFE00, 0x7E00), (0x7C00, 0x7C01)],
    torch.float32: [(0x0, 0x80000000), (0x7FC00000, 0x7FC00001), (0xFFC00000, 0x7FC00000)],
}


def weights(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=gen) * 0.02).to(dtype)


def changed(base: torch.Tensor, positions: np.ndarray | list[int], seed: int = 1) -> torch.Tensor:
    """A copy of ``base`` whose bytes differ exactly at ``positions``."""
    new = base.clone()
    u = as_uint(new)
    rng = np.random.default_rng(seed)
    flips = rng.integers(1, 1 << (8 * u.itemsize), size=len(positions), dtype=np.uint64)
    u[np.asarray(positions, dtype=np.int64)] ^= flips.astype(u.dtype)
    return new


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return as_uint(a).tobytes() == as_uint(b).tobytes()


def roundtrip(new: torch.Tensor, base: torch.Tensor | None, **kw: object) -> TensorUpdate:
    update = encode_tensor("w", new, base, **kw)  # type: ignore[arg-type]
    target = base.clone() if base is not None else torch.zeros_like(new)
    before = target.clone()
    undo = decode_into(update, target)
    assert same_bytes(target, new)
    assert tensor_checksum(target) == update.checksum == tensor_checksum(new)
    undo.restore(target)
    assert same_bytes(target, before)
    return update


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case", ["random", "none", "all", "first", "last", "first_and_last", "special", "runs"]
)
def test_roundtrip_is_bit_exact(dtype: torch.dtype, case: str) -> None:
    numel = 10_007  # not a multiple of a 64-bit word: the tail path runs too
    base = weights(numel, dtype)
    rng = np.random.default_rng(3)
    positions: np.ndarray | list[int]
    if case == "random":
        positions = np.sort(rng.choice(numel, 100, replace=False))
    elif case == "none":
        positions = []
    elif case == "all":
        positions = np.arange(numel)
    elif case == "first":
        positions = [0]
    elif case == "last":
        positions = [numel - 1]
    elif case == "first_and_last":
        positions = [0, numel - 1]
    elif case == "runs":
        positions = np.r_[5:40, 4000:4100, numel - 30 : numel]
    else:
        pairs = SPECIAL[dtype]
        positions = list(range(0, 4 * len(pairs), 4))
    new = changed(base, positions)
    if case == "special":
        b_u, n_u = as_uint(base), as_uint(new)
        for pos, (old, now) in zip(positions, SPECIAL[dtype], strict=True):
            b_u[pos], n_u[pos] = old, now
        b_u[1] = n_u[1] = SPECIAL[dtype][1][0]  # the same NaN on both sides: unchanged
    update = roundtrip(new, base)
    if case == "all":
        assert update.encoding == "full" and update.num_changed == -1
    else:
        assert update.encoding == "delta" and update.num_changed == len(positions)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.int64])
def test_roundtrip_for_every_word_width(dtype: torch.dtype) -> None:
    base = torch.arange(1001, dtype=torch.int64).to(dtype)
    new = changed(base, [0, 7, 8, 9, 500, 1000])
    assert roundtrip(new, base).num_changed == 6


def test_full_update_without_base() -> None:
    new = weights(1000, torch.bfloat16)
    update = roundtrip(new, None, compress="none")
    assert update.encoding == "full" and update.payload == as_uint(new).tobytes()
    assert changed_fraction(update) == 1.0


def test_unaligned_tensor_views_are_encoded() -> None:
    storage = weights(4099, torch.bfloat16)
    base = storage[3:]  # contiguous, but 6 bytes into its storage
    new = changed(base.clone(), [0, 1, 2000, 4095])
    roundtrip(new, base)


def test_unchanged_tensor_is_an_empty_delta_even_when_tiny() -> None:
    base = weights(4, torch.bfloat16)
    update = roundtrip(base.clone(), base)
    assert update.encoding == "delta" and update.num_changed == 0
    assert changed_fraction(update) == 0.0


# --- size choices -------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.1, 0.3, 0.6, 0.9, 1.0])
def test_full_fallback_exactly_when_smaller(fraction: float) -> None:
    numel = 20_000
    base = weights(numel, torch.bfloat16)
    positions = np.sort(
        np.random.default_rng(0).choice(numel, int(numel * fraction), replace=False)
    )
    new = changed(base, positions)
    update = roundtrip(new, base, compress="none")
    # the encoder stops (None) as soon as the delta is no smaller than the full payload
    encoded = delta._encode_delta(as_uint(new), as_uint(base), delta.default_chunk_elems(2))
    assert (update.encoding == "full") == (encoded is None)
    if encoded is not None:
        assert update.payload == encoded[0]
        assert len(update.payload) < 2 * numel or update.num_changed == 0


def test_delta_beats_verl_by_half_at_one_percent() -> None:
    numel = 200_000
    base = weights(numel, torch.bfloat16)
    positions = np.sort(np.random.default_rng(0).choice(numel, numel // 100, replace=False))
    new = base.clone()
    idx = torch.from_numpy(positions)
    new[idx] = (base[idx].float() * 1.01).to(torch.bfloat16)  # a few ulps, as a real step
    as_uint(new)[positions[as_uint(new)[positions] == as_uint(base)[positions]]] ^= 1
    update = roundtrip(new, base)
    assert update.compression == "zstd"
    assert len(update.payload) <= 0.5 * 6 * len(positions)


@pytest.mark.parametrize("kind", ["weights", "random_bits"])
def test_zstd_kept_only_where_it_pays(kind: str) -> None:
    numel = 50_000
    if kind == "weights":
        base = weights(numel, torch.bfloat16)
    else:
        base = torch.from_numpy(
            np.random.default_rng(0).integers(0, 1 << 16, numel, dtype=np.uint16).view(np.int16)
        ).view(torch.bfloat16)
    for fraction in (0.01, 0.2, 1.0):
        positions = np.sort(
            np.random.default_rng(1).choice(numel, int(numel * fraction), replace=False)
        )
        new = changed(base, positions)
        raw = encode_tensor("w", new, base, compress="none").payload
        auto = roundtrip(new, base)
        pays = len(
            zstandard.ZstdCompressor(compression_params=delta._ZSTD_PARAMS).compress(raw)
        ) <= 0.9 * len(raw)
        assert (auto.compression == "zstd") == pays
        if auto.compression == "zstd":
            assert len(auto.payload) <= 0.9 * len(raw)
        forced = roundtrip(new, base, compress="zstd")
        assert forced.compression == "zstd"
    if kind == "random_bits":
        assert encode_tensor("w", new, None).compression == "none"


def test_zstd_decision_on_big_payloads_uses_a_sample() -> None:
    noise = np.random.default_rng(0).integers(0, 1 << 16, 1 << 20, dtype=np.uint16)
    new = torch.from_numpy(noise.view(np.int16)).view(torch.bfloat16)
    assert encode_tensor("w", new, None).compression == "none"
    zeros = torch.zeros(1 << 20, dtype=torch.bfloat16)
    assert roundtrip(zeros, None).compression == "zstd"


# --- chunks and blocks --------------------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 7, 63, 64, 65, 128, 1000])
def test_chunk_boundaries(numel: int) -> None:
    chunk = 64
    base = weights(numel, torch.float16)
    edges = {0, numel - 1} | {p for c in range(0, numel, chunk) for p in (c - 1, c, c + 1)}
    positions = sorted(p for p in edges if 0 <= p < numel)
    new = changed(base, positions)
    update = roundtrip(new, base, compress="none", chunk_elems=chunk)
    if update.encoding == "delta":
        header = delta._HEADER.unpack_from(update.payload)
        assert header[6] == chunk and header[7] == -(-numel // chunk)


def test_changes_straddling_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delta, "_BLOCK_WORDS", 16)  # 64 bf16 elements per block
    numel = 64 * 20 + 3
    base = weights(numel, torch.bfloat16)
    positions = sorted({p for b in range(0, numel, 64) for p in (b - 1, b) if 0 <= p < numel})
    for chunk in (64 * 3, 64 * 3 + 8, 1 << 20):
        update = roundtrip(changed(base, positions), base, chunk_elems=chunk)
        assert update.num_changed == len(positions)


def test_tensor_larger_than_a_chunk_and_a_block() -> None:
    numel = delta._BLOCK_WORDS * 4 * 2 + 5  # two blocks of bf16 words and a tail
    base = weights(numel, torch.bfloat16)
    positions = np.sort(np.random.default_rng(0).choice(numel, 3000, replace=False))
    update = roundtrip(changed(base, positions), base, chunk_elems=numel // 3 // 8 * 8)
    assert update.num_changed == 3000


def test_bad_chunk_size_is_refused() -> None:
    base = weights(16, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8"):
        encode_tensor("w", base, base, chunk_elems=12)


# --- apply-side refusals ------------------------------------------------------------------


def small_update(**kw: object) -> tuple[torch.Tensor, torch.Tensor, TensorUpdate]:
    base = weights(300, torch.bfloat16)
    new = changed(base, [0, 5, 6, 63, 64, 65, 150, 299])
    update = encode_tensor("layer.w", new, base, compress="none", chunk_elems=64, **kw)  # type: ignore[arg-type]
    assert update.encoding == "delta"
    return base, new, update


def refused(update: TensorUpdate, target: torch.Tensor, match: str | None = None) -> None:
    before = target.clone()
    with pytest.raises(WeightSyncError, match=match):
        decode_into(update, target)
    assert torch.equal(target.view(torch.uint8), before.view(torch.uint8))  # nothing written


def sections(payload: bytes) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """([start, end) of header + every chunk's header and gap sections, [start, end) of
    every chunk's values)."""
    head = delta._HEADER.unpack_from(payload)
    itemsize, num_chunks = head[2], head[7]
    structural, values = [(0, delta._HEADER.size)], []
    at = delta._HEADER.size
    for _ in range(num_chunks):
        n, k, unary_len = delta._CHUNK.unpack_from(payload, at)
        gaps_end = at + delta._CHUNK.size + unary_len + delta._rem_len(n, k)
        structural.append((at, gaps_end))
        values.append((gaps_end, gaps_end + n * itemsize))
        at = gaps_end + n * itemsize
    return structural, values


def flipped(update: TensorUpdate, bit: int) -> TensorUpdate:
    payload = bytearray(update.payload)
    payload[bit // 8] ^= 1 << (bit % 8)
    return TensorUpdate(**{**_fields(update), "payload": bytes(payload)})


def _fields(update: TensorUpdate) -> dict[str, object]:
    return {f: getattr(update, f) for f in update.__struct_fields__}


def test_every_flipped_bit_in_header_or_gaps_is_refused() -> None:
    base, _, update = small_update()
    structural, _ = sections(update.payload)
    assert len(structural) == 1 + 5
    for start, end in structural:
        for bit in range(8 * start, 8 * end):
            refused(flipped(update, bit), base.clone())


def test_truncated_or_extended_payloads_are_refused() -> None:
    base, _, update = small_update()
    for size in range(len(update.payload)):
        cut = TensorUpdate(**{**_fields(update), "payload": update.payload[:size]})
        refused(cut, base.clone())
    for extra in (b"\0", b"garbage", update.payload):
        longer = TensorUpdate(**{**_fields(update), "payload": update.payload + extra})
        refused(longer, base.clone(), "after the last chunk")


def test_corrupt_zstd_frames_are_refused() -> None:
    base = weights(4000, torch.bfloat16)
    update = encode_tensor("w", changed(base, list(range(0, 4000, 50))), base, compress="zstd")
    assert update.compression == "zstd"
    for bit in range(0, 8 * len(update.payload), 7):
        refused(flipped(update, bit), base.clone())
    refused(TensorUpdate(**{**_fields(update), "payload": update.payload + b"x"}), base.clone())
    refused(TensorUpdate(**{**_fields(update), "payload": update.payload[:-1]}), base.clone())


def craft(
    numel: int,
    chunk: int,
    chunks: list[tuple[int, int, bytes, bytes, bytes]],
    *,
    num_changed: int | None = None,
) -> bytes:
    """A bf16 delta payload with a valid hash: chunks of (n, k, unary, remainder, values)."""
    body = b"".join(delta._CHUNK.pack(n, k, len(u)) + u + r + v for n, k, u, r, v in chunks)
    total = sum(c[0] for c in chunks) if num_changed is None else num_changed
    header = bytearray(
        delta._HEADER.pack(delta.MAGIC, 1, 2, 0, numel, total, chunk, len(chunks), 0)
    )
    digest = xxhash.xxh3_64(bytes(header))
    sec = xxhash.xxh3_64()
    for n, k, u, r, _ in chunks:
        sec.update(delta._CHUNK.pack(n, k, len(u)) + u + r)
    digest.update(sec.digest())
    struct.pack_into("<Q", header, delta._HASH_AT, digest.intdigest())
    return bytes(header) + body


def crafted(payload: bytes, numel: int, num_changed: int) -> TensorUpdate:
    return TensorUpdate(
        name="w",
        dtype="bfloat16",
        shape=(numel,),
        encoding="delta",
        payload=payload,
        checksum="0" * 32,
        num_changed=num_changed,
    )


def test_crafted_payload_roundtrip_is_valid() -> None:
    # one change at position 3: gap 3 with k=0 is three zeros then a one
    payload = craft(16, 16, [(1, 0, bytes([0b1000]), b"", b"\x34\x12")])
    target = torch.zeros(16, dtype=torch.bfloat16)
    decode_into(crafted(payload, 16, 1), target)
    assert as_uint(target)[3] == 0x1234 and int(as_uint(target).astype(np.int64).sum()) == 0x1234


@pytest.mark.parametrize(
    ("chunks", "num_changed", "match"),
    [
        # a gap of 17 in a chunk of 16 elements
        ([(1, 0, bytes([0, 0, 0b10]), b"", b"\0\0")], None, "past the end"),
        # gaps 15 and 0: positions 15 and 16 in a chunk of 16
        ([(2, 0, bytes([0, 0b1000_0000, 0b1]), b"", b"\0" * 4)], None, "outside its chunk"),
        # two changes announced, one gap coded
        ([(2, 0, bytes([0b1]), b"", b"\0" * 4)], None, "announced number"),
        # a unary section with a trailing byte
        ([(1, 0, bytes([0b1, 0]), b"", b"\0\0")], None, "announced number"),
        # header count differs from the chunks' sum
        ([(1, 0, bytes([0b1]), b"", b"\0\0")], 2, "do not add up"),
        # more changes than elements
        ([(17, 0, bytes([0xFF] * 2 + [1]), b"", b"\0" * 34)], None, "change count"),
        # a change without a unary section
        ([(1, 0, b"", b"", b"\0\0")], None, "do not fit"),
    ],
)
def test_positions_out_of_range_and_bad_counts_are_refused(
    chunks: list[tuple[int, int, bytes, bytes, bytes]], num_changed: int | None, match: str
) -> None:
    payload = craft(16, 16, chunks, num_changed=num_changed)
    total = num_changed if num_changed is not None else chunks[0][0]
    refused(crafted(payload, 16, total), torch.zeros(16, dtype=torch.bfloat16), match)


def test_update_num_changed_must_match_payload() -> None:
    base, _, update = small_update()
    wrong = TensorUpdate(**{**_fields(update), "num_changed": update.num_changed + 1})
    refused(wrong, base.clone(), "num_changed")


def test_dtype_and_numel_mismatches_are_refused() -> None:
    base, _, update = small_update()
    refused(update, base.to(torch.float16), "layer.w")
    refused(update, torch.zeros(299, dtype=torch.bfloat16), "layer.w")
    with pytest.raises(WeightSyncError, match="contiguous"):
        decode_into(update, base.clone().reshape(3, 100).t())
    full = encode_tensor("layer.w", base, None, compress="none")
    refused(TensorUpdate(**{**_fields(full), "payload": full.payload[:-2]}), base.clone(), "bytes")
    with pytest.raises(ValueError, match="base is"):
        encode_tensor("w", base, base[:-1])
    with pytest.raises(ValueError, match="contiguous"):
        encode_tensor("w", base.reshape(3, 100).t(), base.reshape(3, 100).t())


def test_flipped_value_bit_is_caught_by_the_checksum_and_undone() -> None:
    base, new, update = small_update()
    _, values = sections(update.payload)
    for start, end in values:
        for bit in range(8 * start, 8 * end, 5):
            target = base.clone()
            undo = decode_into(flipped(update, bit), target)
            assert not same_bytes(target, new)  # the decoder cannot see it ...
            assert tensor_checksum(target) != update.checksum  # ... the checksum does
            undo.restore(target)
            assert same_bytes(target, base)


def test_undo_of_a_full_update_restores_every_byte() -> None:
    base = weights(1000, torch.float32)
    new = changed(base, np.arange(1000))
    update = encode_tensor("w", new, base)
    assert update.encoding == "full"
    target = base.clone()
    undo = decode_into(update, target)
    assert same_bytes(target, new) and undo.nbytes == 4000
    undo.restore(target)
    assert same_bytes(target, base)


# --- property -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from([*DTYPES, torch.uint8]),
    numel=st.integers(0, 300),
    density=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]),
    chunk=st.sampled_from([8, 16, 64, None]),
    compress=st.sampled_from(["auto", "none", "zstd"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_decode_of_encode_is_new(
    dtype: torch.dtype, numel: int, density: float, chunk: int | None, compress: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = rng.integers(0, 256, max(numel, 1) * itemsize, dtype=np.uint8)
    base = torch.from_numpy(raw).view(dtype)[:numel].clone()
    mask = rng.random(numel) < density
    new = changed(base, np.flatnonzero(mask), seed=seed)
    update = roundtrip(new, base, chunk_elems=chunk, compress=compress)
    if update.encoding == "delta":
        assert update.num_changed == int(mask.sum())
