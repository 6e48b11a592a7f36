"""Layout conversion at a phase switch: the trainer's weights (fp32 masters, possibly FSDP2 /
DTensor shards) become the serving weights (serving dtype, names, fused tensors) in bounded
buckets, with no disk round trip and no second full copy on the device.

Invariants: every rank of a sharded model iterates the same tensors in the same order (each
DTensor is gathered collectively, one at a time); a bucket holds at most ``bucket_bytes`` of
converted tensors unless one tensor alone is larger; the cast is torch's round-to-nearest-
even, the one ``WeightExporter`` applies, so the result is the trainer's full weights in the
serving dtype bit for bit.  Pure apart from the collectives a DTensor's gather runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgspec
import torch

from agentroll.errors import ConfigError
from agentroll.weights.delta import encode_tensor
from agentroll.weights.update import DTYPES, WeightUpdate, model_digest

#: prefixes wrappers add to parameter names (torch.compile, DDP, FSDP1)
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class Fuse(msgspec.Struct, frozen=True, kw_only=True):
    """Serving tensor ``target`` is ``sources`` (serving names) concatenated along ``dim``."""

    target: str
    sources: tuple[str, ...]
    dim: int = 0


class ServingLayout(msgspec.Struct, frozen=True, kw_only=True):
    """How the engine keeps the weights: ``dtype`` (None: the trainer's), renames from
    trainer to serving names (after wrapper prefixes are stripped), tensors it fuses, and
    trainer tensors it does not serve (``skip``, exact names)."""

    dtype: str | None = None
    rename: dict[str, str] = {}
    fuse: tuple[Fuse, ...] = ()
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"serving dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        seen: set[str] = set()
        for f in self.fuse:
            if len(f.sources) < 2 or seen.intersection(f.sources):
                raise ConfigError(
                    f"fuse {f.target!r}: give two or more sources, each in one fusion only"
                )
            seen.update(f.sources)

    def serving_name(self, name: str) -> str:
        for prefix in WRAPPER_PREFIXES:
            while prefix in name:
                name = name.replace(prefix, "")
        return self.rename.get(name, name)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank calls it), else itself."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def convert(
    named: Iterable[tuple[str, torch.Tensor]],
    layout: ServingLayout,
    *,
    bucket_bytes: int = 64 << 20,
    device: str | torch.device = "cpu",
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the serving weights in buckets of at most ``bucket_bytes`` (one tensor larger
    than that is a bucket of its own), in the order of ``named`` (``model.named_parameters()``
    of a plain or FSDP2-sharded model; with buffers if the engine serves them).  Each tensor
    is gathered whole (FSDP2: ``DTensor.full_tensor``), cast, moved to ``device`` and its
    gathered fp32 copy dropped before the next: the extra memory is one tensor plus one bucket.
    Tensors of a fusion wait until all their sources are converted.  Raises ``ConfigError``
    when a fusion's sources never all appear, or two tensors get one serving name."""
    if bucket_bytes < 1:
        raise ConfigError(f"bucket_bytes={bucket_bytes}; use >= 1")
    dtype = DTYPES[layout.dtype][0] if layout.dtype is not None else None
    fusion_of = {src: f for f in layout.fuse for src in f.sources}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    seen: set[str] = set()
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    skip = set(layout.skip)
    for name, tensor in named:
        full = _full(tensor.detach())  # collective first: every rank, whatever it keeps
        serving = layout.serving_name(name)
        if name in skip or serving in skip:
            continue
        out = full.to(device=device, dtype=dtype if full.is_floating_point() else None)
        out = out.contiguous()
        del full
        fusion = fusion_of.get(serving)
        if fusion is not None:
            parts = pending.setdefault(fusion.target, {})
            parts[serving] = out
            if len(parts) < len(fusion.sources):
                continue
            out = torch.cat([parts[s] for s in fusion.sources], dim=fusion.dim)
            del pending[fusion.target]
            serving = fusion.target
        if serving in seen:
            raise ConfigError(f"two trainer tensors convert to the serving tensor {serving!r}")
        seen.add(serving)
        nbytes = out.numel() * out.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[serving] = out
        size += nbytes
    if pending:
        target, parts = next(iter(pending.items()))
        raise ConfigError(f"fused tensor {target!r} is missing sources; it got {sorted(parts)}")
    if bucket:
        yield bucket


def full_update(
    buckets: Iterable[Mapping[str, torch.Tensor]], *, version: int, compress: Any = "none"
) -> WeightUpdate:
    """A full, self-verifying ``WeightUpdate`` of converted buckets (each tensor encoded and
    then dropped with its bucket, so the host holds the payload, not a second copy)."""
    tensors = []
    for bucket in buckets:
        for name, t in bucket.items():
            tensors.append(encode_tensor(name, t.to("cpu").contiguous(), None, compress=compress))
    tensors.sort(key=lambda t: t.name)
    return WeightUpdate(
        version=version,
        base_version=-1,
        kind="full",
        tensors=tuple(tensors),
        digest=model_digest({t.name: t.checksum for t in tensors}),
    )


__all__ = ["WRAPPER_PREFIXES", "Fuse", "ServingLayout", "convert", "full_update"]
