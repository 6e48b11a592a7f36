"""Replica side of weight sync: apply a ``WeightUpdate`` to live weights, all or nothing.

Invariants: an update whose base version, a tensor name, dtype or shape does not match is
refused before anything is written; once writing starts, every touched tensor's checksum and
then the whole-model digest are verified, and any mismatch or error restores the previous
bytes and raises ``WeightSyncError``; after success the digest equals the trainer's.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Protocol

import torch

from agentroll.errors import WeightSyncError
from agentroll.weights.delta import decode_into
from agentroll.weights.update import WeightUpdate, dtype_name, model_digest, tensor_checksum


class TensorSpec(Protocol):
    """What the checks read of one tensor of an update (``TensorUpdate`` or ``PayloadInfo``)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


class UpdatePlan(Protocol):
    """What the checks read of an update: a ``WeightUpdate`` or its transport header."""

    @property
    def version(self) -> int: ...
    @property
    def base_version(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def tensors(self) -> Sequence[TensorSpec]: ...


def check_base(plan: UpdatePlan, version: int, *, holder: str = "this replica") -> None:
    """Refuse (``WeightSyncError``) ``plan`` for weights at ``version`` when its base is
    another version (a delta, or a full update that names a base) or it is not newer."""
    if (plan.kind == "delta" or plan.base_version != -1) and plan.base_version != version:
        raise WeightSyncError(
            f"update to version {plan.version} is based on version {plan.base_version}, "
            f"but {holder} has version {version}; ask for a full update"
        )
    if plan.version <= version and plan.base_version != -1:
        raise WeightSyncError(f"update version {plan.version} is not newer than {version}")


class WeightLayout:
    """The dtype name and shape of every tensor of a model, by name: what an update's
    tensors must match.  With each tensor's size bounded by its shape (the transport's
    ``payload_bound``), that also bounds an update by the model's own size."""

    __slots__ = ("specs",)

    def __init__(self, specs: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        self.specs = dict(specs)

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> WeightLayout:
        """The layout of ``tensors`` (reads no tensor data; a dtype that updates do not
        support keeps torch's name, which no update matches)."""
        return cls({n: (_dtype_label(t.dtype), tuple(t.shape)) for n, t in tensors.items()})

    def check(self, plan: UpdatePlan) -> None:
        """Refuse (``WeightSyncError``) ``plan`` when it names a tensor the model lacks or
        twice, or one whose dtype or shape differs from the model's."""
        seen: set[str] = set()
        for tu in plan.tensors:
            spec = self.specs.get(tu.name)
            if spec is None:
                raise WeightSyncError(f"the model has no tensor {tu.name!r}")
            if tu.name in seen:
                raise WeightSyncError(f"tensor {tu.name!r} appears twice in the update")
            seen.add(tu.name)
            if spec != (tu.dtype, tuple(tu.shape)):
                raise WeightSyncError(
                    f"tensor {tu.name!r} is {tu.dtype}{list(tu.shape)} in the update but "
                    f"{spec[0]}{list(spec[1])} in the model"
                )


def _dtype_label(dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except ValueError:
        return str(dtype)


class WeightStore:
    """The live weights of one replica (a name -> tensor mapping whose tensors are written in
    place), their version and a cache of per-tensor checksums.

    The refusal before writing comes from ``check_base`` and ``WeightLayout.check``, which a
    receiver also runs on an update's header before reading its payloads.  A failed update
    restores the previous bytes (undo log for CPU tensors, host staging for device tensors) and
    leaves version and weights unchanged.
    """

    def __init__(
        self,
        tensors: MutableMapping[str, torch.Tensor],
        *,
        version: int = 0,
        checksums: Mapping[str, str] | None = None,
    ) -> None:
        """``checksums``, when given, are trusted as those of ``tensors`` (weights parked
        with theirs and loaded back); otherwise they are computed when first needed."""
        self.tensors = tensors
        self.version = version
        self._checksums: dict[str, str] | None = None if checksums is None else dict(checksums)

    @property
    def checksums(self) -> dict[str, str]:
        if self._checksums is None:
            self._checksums = {n: tensor_checksum(t) for n, t in self.tensors.items()}
        return self._checksums

    def digest(self) -> str:
        """The whole-model digest of the live weights (from the checksum cache)."""
        return model_digest(self.checksums)

    def verify(self) -> str:
        """Recompute every checksum from the live bytes (slow) and return the digest."""
        self._checksums = None
        return self.digest()

    def layout(self) -> WeightLayout:
        """The names, dtypes and shapes of the live weights."""
        return WeightLayout.of(self.tensors)

    def check(self, plan: UpdatePlan) -> None:
        """Refuse (``WeightSyncError``) an update, or its header before any payload is read,
        that does not fit these weights: its base version, tensor names, dtypes, shapes."""
        check_base(plan, self.version)
        self.layout().check(plan)

    def apply(self, update: WeightUpdate) -> str:
        """Apply ``update``; returns the new digest.  Raises ``WeightSyncError`` (nothing
        changed) when it is refused or fails verification."""
        self.check(update)
        checksums = dict(self.checksums)
        done: list[tuple[torch.Tensor, torch.Tensor, Any]] = []  # (live, host, undo)
        try:
            for tu in update.tensors:
                live = self.tensors[tu.name]
                on_host = live.device.type == "cpu" and live.is_contiguous()
                host = live if on_host else live.detach().contiguous().cpu()
                undo = decode_into(tu, host)
                done.append((live, host, undo if on_host else None))
                checksum = tensor_checksum(host)
                if checksum != tu.checksum:
                    raise WeightSyncError(
                        f"checksum mismatch for {tu.name!r} after applying the update"
                    )
                checksums[tu.name] = checksum
            digest = model_digest(checksums)
            if digest != update.digest:
                raise WeightSyncError(
                    "the model digest after the update does not match the trainer's"
                )
        except Exception as exc:
            for _, host, undo in reversed(done):
                if undo is not None:
                    undo.restore(host)
            if isinstance(exc, WeightSyncError):
                raise
            raise WeightSyncError(f"update to version {update.version} failed: {exc}") from exc
        for live, host, undo in done:
            if undo is None:  # device tensor: staged on the host, copied only after verification
                live.copy_(host)
        self._checksums = checksums
        self.version = update.version
        return digest

    # -- background updates: stage a second copy while generating, swap at a token boundary --

    def staging_bytes(self, update: WeightUpdate) -> int:
        """Memory a ``stage`` of ``update`` needs (a host copy of every touched tensor)."""
        return sum(
            self.tensors[tu.name].numel() * self.tensors[tu.name].element_size()
            for tu in update.tensors
            if tu.name in self.tensors
        )

    def stage(self, update: WeightUpdate) -> StagedUpdate:
        """Build and verify the updated tensors aside, without touching the live weights
        (safe while another thread runs forward passes).  Raises ``WeightSyncError``."""
        self.check(update)
        checksums = dict(self.checksums)
        staged: dict[str, torch.Tensor] = {}
        try:
            for tu in update.tensors:
                host = self.tensors[tu.name].detach().to("cpu", copy=True).contiguous()
                decode_into(tu, host)
                checksum = tensor_checksum(host)
                if checksum != tu.checksum:
                    raise WeightSyncError(f"checksum mismatch for {tu.name!r} while staging")
                checksums[tu.name] = checksum
                staged[tu.name] = host
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"staging version {update.version} failed: {exc}") from exc
        digest = model_digest(checksums)
        if digest != update.digest:
            raise WeightSyncError("the staged model digest does not match the trainer's")
        return StagedUpdate(self.version, update.version, staged, checksums, digest)

    def commit(self, staged: StagedUpdate) -> str:
        """Copy a staged update into the live weights (call between forward passes)."""
        if staged.base_version != self.version:
            raise WeightSyncError(
                f"the staged update was built on version {staged.base_version}, but the "
                f"replica is at {self.version}; stage it again"
            )
        # one call for every tensor: a copy_ each gave the GIL up and waited to get it back
        # once per tensor, which the other replicas' threads made last (a rolling sync pauses
        # for this)
        names = list(staged.tensors)
        if names:  # an update that changed nothing stages no tensor (and _foreach refuses [])
            torch._foreach_copy_(
                [self.tensors[n] for n in names], [staged.tensors[n] for n in names]
            )
        self._checksums = staged.checksums
        self.version = staged.version
        return staged.digest


class StagedUpdate:
    """A verified update held aside by ``WeightStore.stage``."""

    __slots__ = ("base_version", "checksums", "digest", "tensors", "version")

    def __init__(
        self,
        base_version: int,
        version: int,
        tensors: dict[str, torch.Tensor],
        checksums: dict[str, str],
        digest: str,
    ) -> None:
        self.base_version = base_version
        self.version = version
        self.tensors = tensors
        self.checksums = checksums
        self.digest = digest
