"""The weight update record and checksums: what travels from a trainer to a replica.

Invariants: a ``WeightUpdate`` is self-verifying -- every tensor carries the xxh3-128 of its
bytes *after* the update, and ``digest`` is the xxh3-128 over the per-tensor checksums of the
whole model in name order, so a replica proves bit-exactness by recomputing both; delta
payloads carry replacement values, never differences; nothing here is pickled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec
import numpy as np
import torch
import xxhash

UpdateKind = Literal["full", "delta"]
Encoding = Literal["full", "delta"]

#: torch dtype name <-> unsigned integer view used for bytewise comparison
DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
    "float16": (torch.float16, np.dtype("<u2")),
    "float32": (torch.float32, np.dtype("<u4")),
    "float64": (torch.float64, np.dtype("<u8")),
    "int32": (torch.int32, np.dtype("<u4")),
    "int64": (torch.int64, np.dtype("<u8")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "int8": (torch.int8, np.dtype("u1")),
}
_TORCH_TO_NAME = {t: name for name, (t, _) in DTYPES.items()}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TensorUpdate(msgspec.Struct, kw_only=True, frozen=True):
    """One tensor of an update.  ``payload`` is the raw little-endian bytes (``encoding``
    full) or a delta (see ``agentroll.weights.delta``); ``compression`` is ``none`` or
    ``zstd`` on top; ``checksum`` is the xxh3-128 (hex) of the tensor's bytes after the
    update; ``num_changed`` counts the elements a delta replaces (-1 for full).  A received
    update's payloads are the bytearrays they were received into (not copied again)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    payload: bytes | bytearray
    checksum: str
    compression: Literal["none", "zstd"] = "none"
    num_changed: int = -1

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class WeightUpdate(msgspec.Struct, kw_only=True, frozen=True):
    """Weights version ``version``, to apply on ``base_version`` (-1: on any version, only
    for ``kind='full'`` updates that cover every tensor)."""

    version: int
    base_version: int
    kind: UpdateKind
    tensors: tuple[TensorUpdate, ...]
    digest: str

    @property
    def payload_bytes(self) -> int:
        return sum(len(t.payload) for t in self.tensors)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _TORCH_TO_NAME[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported in weight updates") from None


def as_uint(t: torch.Tensor) -> np.ndarray:
    """A flat unsigned-integer numpy view of a contiguous CPU tensor's bytes (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("as_uint needs a contiguous CPU tensor")
    view = t.detach().reshape(-1).view(_INT_VIEW[t.element_size()])
    return view.numpy().view(DTYPES[dtype_name(t.dtype)][1])


def tensor_checksum(t: torch.Tensor) -> str:
    """xxh3-128 (hex) of a tensor's bytes (CPU; a device tensor is copied to the host)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().contiguous().cpu()
    return xxhash.xxh3_128_hexdigest(as_uint(t).data.cast("B"))


def model_digest(checksums: Mapping[str, str] | Iterable[tuple[str, str]]) -> str:
    """The whole-model digest: xxh3-128 over the per-tensor checksums in name order."""
    items = sorted(checksums.items() if isinstance(checksums, Mapping) else checksums)
    h = xxhash.xxh3_128()
    for name, checksum in items:
        h.update(name.encode())
        h.update(b"\0")
        h.update(checksum.encode())
        h.update(b"\n")
    return h.hexdigest()


def state_checksums(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_checksum(t) for name, t in state.items()}
