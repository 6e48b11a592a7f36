"""Producer side of weight sync: full and delta updates from a live torch model.

Invariants: the exporter keeps the exact bytes of the last exported version (the base, a host
copy in the serving dtype); a delta is encoded against that base and carries replacement
values, so applying it to a replica at the base version reproduces the trainer's bytes; a
replica whose version is not the base gets a full update.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from agentroll.weights.delta import encode_tensor
from agentroll.weights.update import WeightUpdate, model_digest

StateFn = Callable[[], Mapping[str, torch.Tensor]]


class WeightExporter:
    """``WeightExporter(model)``: ``export()`` after each training step; ``update_for(v)``
    gives what a replica at version ``v`` needs.

    ``dtype`` is the serving dtype the replicas hold (e.g. ``torch.bfloat16`` while the
    trainer keeps fp32 master weights); ``None`` keeps each tensor's dtype.
    """

    def __init__(
        self,
        model: torch.nn.Module | StateFn,
        *,
        version: int = 0,
        dtype: torch.dtype | None = None,
        compress: str = "auto",
    ) -> None:
        self._state: StateFn = model.state_dict if isinstance(model, torch.nn.Module) else model
        self.dtype = dtype
        self.compress = compress
        self.version = version
        self.base = self._snapshot()
        self.last_delta: WeightUpdate | None = None
        self._full: WeightUpdate | None = None

    def _snapshot(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self._state().items():
            t = t.detach()
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            out[name] = t.to("cpu", copy=True).contiguous()
        return out

    def export(self, version: int | None = None) -> WeightUpdate:
        """Encode the live weights as version ``version`` (default: current + 1) against
        the base; the live weights become the new base.  Returns the delta update."""
        new_version = self.version + 1 if version is None else version
        if new_version <= self.version:
            raise ValueError(f"version {new_version} must be newer than {self.version}")
        current = self._snapshot()
        if current.keys() != self.base.keys():
            raise ValueError("the model's tensor names changed since the last export")
        tensors = tuple(
            encode_tensor(name, current[name], self.base[name], compress=self.compress)  # type: ignore[arg-type]
            for name in sorted(current)
        )
        checksums = {t.name: t.checksum for t in tensors}
        update = WeightUpdate(
            version=new_version,
            base_version=self.version,
            kind="delta",
            tensors=tuple(t for t in tensors if t.num_changed != 0),
            digest=model_digest(checksums),
        )
        self.base, self.version, self.last_delta, self._full = current, new_version, update, None
        return update

    def full(self) -> WeightUpdate:
        """A full update of the base (applies on any replica version)."""
        if self._full is None:
            tensors = tuple(
                encode_tensor(name, t, None, compress=self.compress)  # type: ignore[arg-type]
                for name, t in sorted(self.base.items())
            )
            self._full = WeightUpdate(
                version=self.version,
                base_version=-1,
                kind="full",
                tensors=tensors,
                digest=model_digest({t.name: t.checksum for t in tensors}),
            )
        return self._full

    def update_for(self, replica_version: int) -> WeightUpdate | None:
        """What a replica at ``replica_version`` needs: nothing, the last delta, or (too far
        behind, or ahead after a restart) a full update."""
        if replica_version == self.version:
            return None
        if self.last_delta is not None and replica_version == self.last_delta.base_version:
            return self.last_delta
        return self.full()
