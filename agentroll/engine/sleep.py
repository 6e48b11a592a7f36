"""What a sleeping engine keeps: its paused requests as snapshots, and at level 2 its
last good weights parked off the device.

Invariants: the parked weights are the bytes the engine served, bit for bit (their checksums
are kept with them); on a CPU engine they live in a safetensors file (the host is the
device, so memory is only freed by leaving it), on a device engine in host memory; the file
is removed when the parked weights are discarded or garbage collected.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from agentroll.engine.snapshot import RequestSnapshot


class ParkedWeights:
    """The weights of a level-2 sleep, off the device until ``load``.  ``checksums`` are
    those of the bytes parked (so waking needs no hashing pass)."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        checksums: dict[str, str],
        *,
        spill_dir: str | Path | None = None,
    ) -> None:
        self.checksums = dict(checksums)
        self.names = list(tensors)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self._host: dict[str, torch.Tensor] | None = None
        self._path: Path | None = None
        self._finalizer: Any = None  # weakref.finalize removing the spill file
        if self.device.type == "cpu":
            directory = Path(tempfile.mkdtemp(prefix="agentroll-sleep-", dir=spill_dir))
            self._finalizer = weakref.finalize(self, _remove, directory)
            self._path = directory / "weights.safetensors"
            try:
                save_file({n: t.contiguous() for n, t in tensors.items()}, str(self._path))
            except BaseException:
                self._finalizer()
                raise
        else:
            self._host = {n: t.to("cpu", copy=True) for n, t in tensors.items()}

    def load(self) -> dict[str, torch.Tensor]:
        """Fresh tensors on the engine's device, equal to the parked bytes."""
        if self._host is not None:
            return {n: t.to(self.device, copy=True) for n, t in self._host.items()}
        if self._path is None or self._finalizer is None or not self._finalizer.alive:
            raise ValueError("the parked weights were discarded")
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(self._path), framework="pt") as f:
            for name in self.names:
                out[name] = f.get_tensor(name).clone()  # not a view of the file's mapping
        return out

    def discard(self) -> None:
        """Drop the parked copy (removes its file)."""
        self._host = None
        if self._finalizer is not None:
            self._finalizer()


@dataclass(slots=True)
class SleepState:
    """A sleeping engine: its level, the requests in flight (in arrival order) and, at level
    2, the parked weights."""

    level: int
    snapshots: dict[str, RequestSnapshot] = field(default_factory=dict)
    weights: ParkedWeights | None = None

    def snapshot_many(
        self, request_ids: list[str], *, with_kv: bool = True
    ) -> dict[str, RequestSnapshot]:
        """The parked snapshots of ``request_ids`` (without their KV unless ``with_kv``)."""
        out: dict[str, RequestSnapshot] = {}
        for rid in request_ids:
            snap = self.snapshots.get(rid)
            if snap is None:
                continue
            if not with_kv and snap.k is not None:
                snap = _without_kv(snap)
            out[rid] = snap
        return out


def _remove(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def _without_kv(snap: RequestSnapshot) -> RequestSnapshot:
    import msgspec

    return msgspec.structs.replace(snap, k=None, v=None, num_computed_tokens=0)
