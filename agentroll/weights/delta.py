"""Delta codec for one tensor: changed positions as Rice-coded gaps plus replacement values.

Invariants: new and base are compared bytewise (no float tolerance, NaN payloads count); a
delta carries the *replacement* values, so decoding is bit-exact; a malformed payload is
refused with ``WeightSyncError`` before a byte of the target is written; extra memory is
O(changes) plus a small mask, never a full-size temporary.  Pure: no I/O, no threads.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import xxhash
import zstandard

from agentroll.errors import WeightSyncError
from agentroll.weights.update import DTYPES, TensorUpdate, as_uint, dtype_name, tensor_checksum

Compress = Literal["auto", "none", "zstd"]

MAGIC = b"ARDT"
FORMAT_VERSION = 1
#: default chunk size in bytes of tensor data; chunks hold a multiple of 8 elements
CHUNK_BYTES = 32 * 1024 * 1024
#: zstd is kept only when it makes a payload at most this fraction of its raw size
ZSTD_KEEP_RATIO = 0.9
# level-1-like, with a small match finder: the gain is in the entropy coding of the value
# bytes (sign and exponent), hardly in matches, so looking for them costs more than it saves
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17,
    chain_log=10,
    hash_log=10,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=zstandard.STRATEGY_FAST,
    write_checksum=1,
    write_content_size=1,
)
_ZSTD_SAMPLE = 1 << 20  # payloads above this size are judged on evenly spaced slices first
_ZSTD_SLICES = 4
_MAX_CHUNK = 1 << 31
_MAX_K = 32
_GOLDEN = (1 + math.sqrt(5)) / 2
_BLOCK_WORDS = 1 << 17  # 1 MiB of each tensor per step (fits in L2 with its mask)

_HEADER = struct.Struct("<4sBBBxQQQI4xQ")
_CHUNK = struct.Struct("<IB3xI")
_HASH_AT = _HEADER.size - 8
_LE_U64 = np.dtype("<u8")
_TORCH_NAMES = {t: name for name, (t, _) in DTYPES.items()}


def default_chunk_elems(itemsize: int) -> int:
    """Elements per chunk for this element size (``CHUNK_BYTES`` of data)."""
    return max(8, CHUNK_BYTES // itemsize // 8 * 8)


# --- Rice code of the gaps ----------------------------------------------------------------


def _rice_k(gaps: np.ndarray) -> int:
    """The Rice parameter for these gaps: the optimum for a geometric source of their mean
    (Gallager and van Voorhis), which is what the gaps of random changes are."""
    mean = float(gaps.sum()) / gaps.size
    if mean <= 0.0:
        return 0
    k = 1 + math.floor(math.log2(math.log(_GOLDEN - 1) / math.log(mean / (mean + 1))))
    return min(max(k, 0), _MAX_K)


def _gaps(positions: np.ndarray) -> np.ndarray:
    """``pos[i] - pos[i-1] - 1`` with ``pos[-1] = -1`` (non-empty, strictly increasing)."""
    gaps = np.empty_like(positions)
    gaps[0] = positions[0]
    np.subtract(positions[1:], positions[:-1], out=gaps[1:])
    gaps[1:] -= 1
    return gaps


def _rem_len(n: int, k: int) -> int:
    return n * (k // 8) + -(-n // 8) * (k % 8)


def _rice_encode(gaps: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """(unary section, remainder section) of non-negative int64 gaps."""
    ends = gaps >> k
    ends += 1
    np.cumsum(ends, out=ends)
    ends -= 1
    bits = np.zeros(int(ends[-1]) + 1, dtype=np.bool_)
    bits[ends] = True
    unary = np.packbits(bits, bitorder="little").tobytes()
    whole, b = divmod(k, 8)
    parts = []
    if whole:  # bits b..k-1 as whole bytes, gap after gap
        high = (gaps >> b).astype(_LE_U64)
        parts.append(high.view(np.uint8).reshape(-1, 8)[:, :whole].tobytes())
    if b:  # bits 0..b-1 as bit planes (packbits reads any non-zero as 1)
        low = gaps.astype(np.uint8)
        parts += [np.packbits(low & (1 << j), bitorder="little").tobytes() for j in range(b)]
    return unary, b"".join(parts)


def _rice_decode(unary: np.ndarray, rem: np.ndarray, n: int, k: int, limit: int) -> np.ndarray:
    """Chunk-relative positions (int64, strictly increasing, all < ``limit``); raises
    ``ValueError`` naming what is wrong."""
    ends = np.flatnonzero(np.unpackbits(unary, bitorder="little").view(np.bool_))
    if ends.size != n or -(-(int(ends[-1]) + 1) // 8) != unary.size:
        raise ValueError("the unary section does not hold the announced number of gaps")
    q = _gaps(ends)
    if int(q.max()) > (limit >> k):
        raise ValueError("a gap points past the end of its chunk")
    gaps = q << k
    whole, b = divmod(k, 8)
    if whole:
        wide = np.zeros((n, 8), dtype=np.uint8)
        wide[:, :whole] = rem[: n * whole].reshape(n, whole)
        gaps |= wide.view(_LE_U64).reshape(-1).astype(np.int64) << b
    if b:
        low = np.zeros(n, dtype=np.uint8)
        plane_len = -(-n // 8)
        for j in range(b):
            at = n * whole + j * plane_len
            low |= np.unpackbits(rem[at : at + plane_len], count=n, bitorder="little") << j
        gaps |= low
    if int(gaps.max()) >= limit:
        raise ValueError("a gap points past the end of its chunk")
    positions = np.cumsum(gaps + 1) - 1  # no overflow: n and every gap are below 2**31
    if int(positions[-1]) >= limit:
        raise ValueError("a changed position lies outside its chunk")
    return positions


def _to_planes(values: np.ndarray) -> bytes:
    """Values as byte planes: every value's byte 0, then every value's byte 1, ..."""
    if values.itemsize == 1:
        return values.tobytes()
    return b"".join((values >> (8 * j)).astype(np.uint8).tobytes() for j in range(values.itemsize))


def _from_planes(raw: np.ndarray, n: int, dtype: np.dtype) -> np.ndarray:
    if dtype.itemsize == 1:
        return raw.view(dtype)
    values = raw[:n].astype(dtype)
    for j in range(1, dtype.itemsize):
        values |= raw[j * n : (j + 1) * n].astype(dtype) << (8 * j)
    return values


# --- encoding -----------------------------------------------------------------------------


def _true_indices(mask: np.ndarray) -> np.ndarray:
    """``np.flatnonzero(mask)``, in two steps when the flags are sparse: groups of 8 flags
    first, then the flags inside the groups that hold any.  numpy's nonzero mispredicts a
    branch per 8 flags at the few percent density of real updates; on the groups the
    density is higher and the work 8x smaller."""
    whole = mask.size // 8 * 8
    groups = mask[:whole].view(np.uint64)
    any_set = groups != 0
    # ndarray.nonzero() on 1-D arrays: np.flatnonzero's wrappers cost more than the work
    if 2 * np.count_nonzero(any_set) > any_set.size:  # dense: one step is cheaper
        return mask.nonzero()[0]
    gidx = any_set.nonzero()[0]
    flags = groups[gidx].view(np.bool_).nonzero()[0]
    gidx <<= 3
    idx = gidx[flags >> 3]
    idx |= flags & 7
    if whole < mask.size:
        idx = np.concatenate([idx, mask[whole:].nonzero()[0] + whole])
    return idx


def _changed(
    new_u: np.ndarray, base_u: np.ndarray, start: int, stop: int, checksum: xxhash.xxh3_128
) -> tuple[np.ndarray, np.ndarray]:
    """(chunk-relative positions, new values) of the elements in [start, stop) whose bytes
    differ (``start`` is a multiple of 8).  64-bit words are compared first, then the
    elements inside the changed words, block by block so that the compare output and the
    gathers that follow it stay in cache; each block of ``new`` is fed to ``checksum`` while
    it is still there."""
    per_word = 8 // new_u.itemsize
    shift = per_word.bit_length() - 1
    w_lo, w_hi = start // per_word, stop // per_word
    new_w = new_u[w_lo * per_word : w_hi * per_word].view(np.uint64)
    base_w = base_u[w_lo * per_word : w_hi * per_word].view(np.uint64)
    mask = np.empty(min(_BLOCK_WORDS, w_hi - w_lo), dtype=np.bool_)
    pos_parts: list[np.ndarray] = []
    val_parts: list[np.ndarray] = []
    for lo in range(0, w_hi - w_lo, _BLOCK_WORDS):
        new_b, base_b = new_w[lo : lo + _BLOCK_WORDS], base_w[lo : lo + _BLOCK_WORDS]
        m = mask[: new_b.size]
        np.not_equal(new_b, base_b, out=m)
        checksum.update(new_b.data.cast("B"))
        widx = _true_indices(m)
        if not widx.size:
            continue
        changed_words = new_b.take(widx)
        if per_word == 1:
            widx += lo
            pos_parts.append(widx)
            val_parts.append(changed_words.view(new_u.dtype))
            continue
        lanes = ((changed_words ^ base_b.take(widx)).view(new_u.dtype) != 0).nonzero()[0]
        widx += lo
        widx <<= shift
        pos = widx[lanes >> shift]
        pos |= lanes & (per_word - 1)
        pos_parts.append(pos)
        val_parts.append(changed_words.view(new_u.dtype)[lanes])
    tail = w_hi * per_word
    if tail < stop:  # elements after the last whole word of the tensor
        new_t, base_t = new_u[tail:stop], base_u[tail:stop]
        checksum.update(new_t.data.cast("B"))
        t = np.flatnonzero(new_t != base_t)
        pos_parts.append(t + (tail - start))
        val_parts.append(new_t[t])
    if not pos_parts:
        return np.empty(0, np.int64), np.empty(0, new_u.dtype)
    if len(pos_parts) == 1:
        return pos_parts[0], val_parts[0]
    return np.concatenate(pos_parts), np.concatenate(val_parts)


def _encode_delta(
    new_u: np.ndarray, base_u: np.ndarray, chunk_elems: int
) -> tuple[bytes, int, str] | None:
    """(uncompressed delta payload, change count, checksum of ``new``), or None when the
    delta would not be smaller than the full payload (the encoder stops as soon as it knows)."""
    numel, itemsize = new_u.size, new_u.itemsize
    full_size = numel * itemsize
    num_chunks = -(-numel // chunk_elems)
    checksum = xxhash.xxh3_128()
    digest = xxhash.xxh3_64()
    parts: list[bytes] = [b""]
    size = _HEADER.size
    num_changed = 0
    for c in range(num_chunks):
        start = c * chunk_elems
        positions, values = _changed(
            new_u, base_u, start, min(numel, start + chunk_elems), checksum
        )
        n = int(positions.size)
        if n:
            gaps = _gaps(positions)
            k = _rice_k(gaps)
            unary, rem = _rice_encode(gaps, k)
        else:
            k, unary, rem = 0, b"", b""
        head = _CHUNK.pack(n, k, len(unary))
        digest.update(head)
        digest.update(unary)
        digest.update(rem)
        planes = _to_planes(values)
        parts += [head, unary, rem, planes]
        size += len(head) + len(unary) + len(rem) + len(planes)
        num_changed += n
        # an unchanged tensor stays a (tiny) delta even when its full payload is smaller still:
        # "no change" lets the producer leave it out of the update
        if size >= full_size and num_changed:
            return None
    header = bytearray(
        _HEADER.pack(
            MAGIC, FORMAT_VERSION, itemsize, 0, numel, num_changed, chunk_elems, num_chunks, 0
        )
    )
    digest_all = xxhash.xxh3_64(bytes(header))
    digest_all.update(digest.digest())
    struct.pack_into("<Q", header, _HASH_AT, digest_all.intdigest())
    parts[0] = bytes(header)
    return b"".join(parts), num_changed, checksum.hexdigest()


def _compress(payload: bytes, mode: Compress) -> tuple[bytes, Literal["none", "zstd"]]:
    if mode == "none" or (mode == "auto" and len(payload) < 64):
        return payload, "none"
    cctx = zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS)
    if mode == "auto" and len(payload) > _ZSTD_SAMPLE:
        # judge on evenly spaced slices first, so an incompressible payload costs little
        step = len(payload) // _ZSTD_SLICES
        width = _ZSTD_SAMPLE // _ZSTD_SLICES
        sample = b"".join(payload[i * step : i * step + width] for i in range(_ZSTD_SLICES))
        if len(cctx.compress(sample)) > ZSTD_KEEP_RATIO * len(sample):
            return payload, "none"
    packed = cctx.compress(payload)
    if mode == "auto" and len(packed) > ZSTD_KEEP_RATIO * len(payload):
        return payload, "none"
    return packed, "zstd"


def encode_tensor(
    name: str,
    new: torch.Tensor,
    base: torch.Tensor | None,
    *,
    compress: Compress = "auto",
    chunk_elems: int | None = None,
) -> TensorUpdate:
    """Encode ``new`` against ``base`` (a delta) or alone (``base`` None: a full payload).

    Both are contiguous CPU tensors of one dtype and shape, compared bytewise.  The delta
    falls back to a full payload (``num_changed`` -1) when that is smaller; a tensor without
    change stays an (empty) delta, so that producers can leave it out.  ``compress``:
    ``auto`` keeps zstd only where it saves at least 10% (judged on a sample first for
    payloads over 1 MiB), ``zstd`` always, ``none`` never.  ``chunk_elems`` (a multiple of
    8, at most 2**31) is the payload's chunk length, the unit of the gap code; the default
    covers ``CHUNK_BYTES`` of data.  ``checksum`` is ``tensor_checksum(new)``.

    Synchronous and CPU-bound (it compares and hashes every byte): call it off the event
    loop.  Raises ``ValueError`` for tensors that cannot be compared (device, layout,
    dtype, shape) or a bad ``chunk_elems``.

    Big tensors are scanned in 1 MiB blocks and coded in chunks: extra memory is a 128 KiB mask
    plus O(changes), never a full-size temporary (except the bytes of a full payload).  Header
    and gap sections are covered by an xxh3-64, checked before anything is decoded.

    Delta payload (all integers little-endian)::

        header  magic b"ARDT", version u8 = 1, itemsize u8, flags u8 = 0, pad u8,
                numel u64, num_changed u64, chunk_elems u64, num_chunks u32, pad u32,
                struct_hash u64  (xxh3-64 of header with this field zeroed + every chunk's
                                  header, unary and remainder sections)
        chunk   num_changes u32, k u8 (Rice parameter), pad 3, unary_len u32, then
                unary      the quotients g >> k in unary: q zero bits then a one bit, LSB first
                remainder  bits k%8 .. k-1 of each gap as k // 8 little-endian bytes per gap,
                           then bits 0 .. k%8-1 as k % 8 bit planes of ceil(n / 8) bytes
                values     the new values at the changed positions as byte planes (every
                           byte 0, then every byte 1, ...: sign/exponent bytes compress well)

    Within a chunk (at most 2**31 elements), gap i is ``pos[i] - pos[i-1] - 1`` with
    ``pos[-1] = -1`` and positions relative to the chunk start, so positions are strictly
    increasing by construction.  Random changes have geometric gaps, for which a Rice code is
    within ~0.03 bit of the entropy.  A payload with ``compression='zstd'`` is one zstd frame
    (content size and checksum included) of the above.
    """
    dtype = dtype_name(new.dtype)
    new_u = as_uint(new)
    payload: bytes | None = None
    num_changed = -1
    checksum = ""
    if base is not None:
        if base.dtype != new.dtype or base.shape != new.shape:
            raise ValueError(
                f"{name}: base is {base.dtype}{list(base.shape)}, new is {new.dtype}{list(new.shape)}"
            )
        chunk = chunk_elems or default_chunk_elems(new.element_size())
        if not 0 < chunk <= _MAX_CHUNK or chunk % 8:
            raise ValueError(f"chunk_elems must be a multiple of 8 in (0, 2**31], not {chunk}")
        encoded = _encode_delta(new_u, as_uint(base), chunk)
        if encoded is not None:
            payload, num_changed, checksum = encoded
    encoding: Literal["full", "delta"] = "delta" if payload is not None else "full"
    if payload is None:
        payload = new_u.tobytes()
        checksum = tensor_checksum(new)
    payload, compression = _compress(payload, compress)
    return TensorUpdate(
        name=name,
        dtype=dtype,
        shape=tuple(new.shape),
        encoding=encoding,
        payload=payload,
        checksum=checksum,
        compression=compression,
        num_changed=num_changed,
    )


def changed_fraction(update: TensorUpdate) -> float:
    """The fraction of elements the update replaces (1.0 for a full payload)."""
    if update.encoding == "full" or update.num_changed < 0:
        return 1.0
    return update.num_changed / update.numel if update.numel else 0.0


# --- decoding -----------------------------------------------------------------------------


@dataclass(slots=True)
class Undo:
    """What ``decode_into`` overwrote: ``restore(target)`` puts the previous bytes back.
    For a delta: the touched positions and their old values (per chunk); for a full
    payload: a copy of the whole old tensor (``whole``)."""

    name: str
    numel: int
    dtype: str
    positions: list[np.ndarray] = field(default_factory=list)
    old: list[np.ndarray] = field(default_factory=list)
    whole: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Memory the undo log holds."""
        held = sum(p.nbytes for p in self.positions) + sum(o.nbytes for o in self.old)
        return held + (self.whole.nbytes if self.whole is not None else 0)

    def restore(self, target: torch.Tensor) -> None:
        """Write the saved bytes back into ``target`` (the tensor that was decoded into).
        Raises ``WeightSyncError`` when ``target`` is not of the update's dtype and size."""
        target_u = _check_target(self.name, self.dtype, self.numel, target)
        if self.whole is not None:
            np.copyto(target_u, self.whole)
        for pos, old in zip(self.positions, self.old, strict=True):
            target_u[pos] = old


def _check_target(name: str, dtype: str, numel: int, target: torch.Tensor) -> np.ndarray:
    if target.device.type != "cpu" or not target.is_contiguous():
        raise WeightSyncError(f"tensor {name!r}: the target must be a contiguous CPU tensor")
    if _TORCH_NAMES.get(target.dtype) != dtype:
        raise WeightSyncError(f"tensor {name!r} is {dtype} in the update but {target.dtype} here")
    if target.numel() != numel:
        raise WeightSyncError(
            f"tensor {name!r} has {numel} elements in the update but {target.numel()} here"
        )
    return as_uint(target)


def payload_bound(encoding: str, compression: str, numel: int, itemsize: int) -> int:
    """The most payload bytes a tensor of ``numel`` elements of ``itemsize`` bytes can take
    in ``encoding`` (before any ``compression``): a full payload is the tensor's bytes; a
    delta is smaller than that (an encoder falls back to full otherwise) except one that
    changes nothing, which is its headers, one per chunk of at least 8 elements.  With
    ``zstd``, the frame of that many bytes at worst (zstd's compress bound).  Receivers
    refuse a longer payload before reading it."""
    full = numel * itemsize
    raw = full if encoding == "full" else full + _HEADER.size + _CHUNK.size * (numel // 8 + 1)
    if compression == "none":
        return raw
    # ZSTD_COMPRESSBOUND, plus the frame header and checksum
    return raw + (raw >> 8) + (((128 << 10) - raw) >> 11 if raw < 128 << 10 else 0) + 32


def _decompress(update: TensorUpdate, bound: int) -> bytes | bytearray:
    if update.compression == "none":
        return update.payload
    if update.compression != "zstd":
        raise WeightSyncError(f"tensor {update.name!r}: unknown compression {update.compression!r}")
    try:
        size = zstandard.frame_content_size(update.payload)
        if size < 0 or size > bound:
            raise WeightSyncError(
                f"tensor {update.name!r}: zstd frame announces {size} bytes (at most {bound} expected)"
            )
        return zstandard.ZstdDecompressor().decompress(update.payload, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise WeightSyncError(f"tensor {update.name!r}: corrupt zstd payload: {exc}") from exc


def _parse_delta(
    name: str, payload: bytes | bytearray, numel: int, itemsize: int, udt: np.dtype
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Validate a whole delta payload; (absolute positions, values) per chunk.  Raises
    ``WeightSyncError`` for anything malformed; writes nothing."""

    def bad(why: str) -> WeightSyncError:
        return WeightSyncError(f"tensor {name!r}: malformed delta payload: {why}")

    if len(payload) < _HEADER.size:
        raise bad("shorter than its header")
    magic, version, isz, flags, h_numel, num_changed, chunk, num_chunks, struct_hash = (
        _HEADER.unpack_from(payload)
    )
    if magic != MAGIC or version != FORMAT_VERSION:
        raise bad(f"magic/version {magic!r}/{version}")
    if isz != itemsize or flags != 0 or h_numel != numel:
        raise bad(f"header says {h_numel} elements of {isz} bytes, flags {flags}")
    if not 0 < chunk <= _MAX_CHUNK or chunk % 8 or num_chunks != -(-numel // chunk):
        raise bad(f"chunks of {chunk} elements, {num_chunks} of them")
    if num_changed > numel:
        raise bad("inconsistent chunking or change count")
    digest = xxhash.xxh3_64(payload[:_HASH_AT] + b"\0" * 8)
    sections = xxhash.xxh3_64()
    view = np.frombuffer(payload, dtype=np.uint8)
    layout: list[tuple[int, int, int, int, int]] = []  # (n, k, unary_at, unary_len, rem_len)
    at, total = _HEADER.size, 0
    for c in range(num_chunks):
        limit = min(chunk, numel - c * chunk)
        if at + _CHUNK.size > len(payload):
            raise bad("truncated chunk header")
        n, k, unary_len = _CHUNK.unpack_from(payload, at)
        rem_len = _rem_len(n, k)
        end = at + _CHUNK.size + unary_len + rem_len + n * itemsize
        if n > limit or k > _MAX_K or end > len(payload) or (n == 0) != (unary_len == 0):
            raise bad(f"chunk {c} announces sections that do not fit")
        sections.update(view[at : at + _CHUNK.size + unary_len + rem_len].data)
        layout.append((n, k, at + _CHUNK.size, unary_len, rem_len))
        at, total = end, total + n
    if at != len(payload):
        raise bad(f"{len(payload) - at} bytes after the last chunk")
    digest.update(sections.digest())
    if digest.intdigest() != struct_hash:
        raise bad("header or gap sections do not match their hash")
    if total != num_changed:
        raise bad("chunk change counts do not add up")
    positions: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for c, (n, k, u_at, u_len, r_len) in enumerate(layout):
        if n == 0:
            continue
        limit = min(chunk, numel - c * chunk)
        try:
            unary, rem = view[u_at : u_at + u_len], view[u_at + u_len : u_at + u_len + r_len]
            pos = _rice_decode(unary, rem, n, k, limit)
        except ValueError as exc:
            raise bad(f"chunk {c}: {exc}") from None
        pos += c * chunk
        v_at = u_at + u_len + r_len
        raw = view[v_at : v_at + n * itemsize]
        vals = _from_planes(raw, n, udt)
        positions.append(pos)
        values.append(vals)
    return positions, values


def decode_into(update: TensorUpdate, target: torch.Tensor) -> Undo:
    """Write ``update`` into ``target`` in place; returns the ``Undo`` that restores it.

    ``target`` is a contiguous CPU tensor of the update's dtype and element count (its
    shape is the caller's check).  The whole payload is validated first: a malformed one
    (bad magic, truncated, flipped bits in the header or gap sections, positions out of
    range, inconsistent counts, corrupt zstd frame) raises ``WeightSyncError`` with nothing
    written.  Corrupt *value* bytes of an uncompressed payload cannot be seen here: the
    caller compares ``tensor_checksum(target)`` with ``update.checksum`` afterwards and calls
    ``undo.restore(target)`` on a mismatch.  The undo log holds the touched positions and
    their old values (a delta) or a copy of the whole tensor (a full payload).

    Synchronous and CPU-bound: call it off the event loop, under the engine's pause.
    """
    target_u = _check_target(update.name, update.dtype, update.numel, target)
    itemsize = target_u.itemsize
    full_size = update.numel * itemsize
    undo = Undo(name=update.name, numel=update.numel, dtype=update.dtype)
    if update.encoding == "full":
        raw = _decompress(update, full_size)
        if len(raw) != full_size:
            raise WeightSyncError(
                f"tensor {update.name!r}: full payload has {len(raw)} bytes, expected {full_size}"
            )
        undo.whole = target_u.copy()
        np.copyto(target_u, np.frombuffer(raw, dtype=target_u.dtype))
        return undo
    if update.encoding != "delta":
        raise WeightSyncError(f"tensor {update.name!r}: unknown encoding {update.encoding!r}")
    # an encoder emits a delta only when it is smaller than the full payload, or when it
    # holds no change (headers only)
    raw = _decompress(update, payload_bound("delta", "none", update.numel, itemsize))
    positions, values = _parse_delta(update.name, raw, update.numel, itemsize, target_u.dtype)
    if update.num_changed != sum(p.size for p in positions):
        raise WeightSyncError(f"tensor {update.name!r}: num_changed does not match the payload")
    for pos, vals in zip(positions, values, strict=True):
        undo.positions.append(pos)
        undo.old.append(target_u[pos])
        target_u[pos] = vals
    return undo
