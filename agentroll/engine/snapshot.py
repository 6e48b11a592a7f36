"""A request's resumable state: ``RequestSnapshot``, and ``KVHold`` for KV kept in place.

Invariants: a snapshot holds everything a request needs to continue elsewhere exactly as if
never interrupted (tokens, logprobs, seed, versions, host copies of its KV or a hold on
them); a ``KVHold`` never leaves its process and its blocks are released exactly once;
``load`` raises ``ValueError`` naming what is wrong with a damaged snapshot.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from agentroll._fs import atomic_dir
from agentroll.types import SamplingParams

if TYPE_CHECKING:
    from agentroll.engine.model_runner import ModelRunner


class KVHold:
    """The KV blocks of a snapshotted request, kept allocated in the engine that took the
    snapshot (in this process) instead of copied out while it stood paused: the engine the
    request moves to reads them when it restores it, then ``release`` hands them back.  A
    hold never read is released when it is garbage collected.  ``release_fn`` is called
    once, from whatever thread, with the block ids; it must be thread-safe."""

    __slots__ = ("__weakref__", "_finalizer", "block_ids", "runner")

    def __init__(
        self, runner: ModelRunner, block_ids: list[int], release_fn: Callable[[list[int]], None]
    ) -> None:
        self.runner = runner
        self.block_ids = block_ids
        self._finalizer = weakref.finalize(self, release_fn, block_ids)

    def read(self, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of K and V of the first ``n_blocks`` blocks (as ``read_blocks``)."""
        if not self._finalizer.alive:
            raise ValueError("this KV hold was released")
        return self.runner.read_blocks(self.block_ids[:n_blocks])

    @property
    def alive(self) -> bool:
        """Whether the blocks are still held (not released yet)."""
        return self._finalizer.alive

    def release(self) -> None:
        self._finalizer()

    def __reduce__(self) -> Any:
        raise TypeError("a KV hold cannot leave its process; snapshot without hold_kv")


class RequestSnapshot(msgspec.Struct, kw_only=True):
    """Everything a request needs to continue elsewhere.  Tensors are host copies; ``save``
    writes the metadata as msgpack and the tensors as safetensors."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    kv_version: int
    min_kv_version: int
    params: SamplingParams
    seed: int
    logprobs: list[float]
    block_size: int
    model_fingerprint: str
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    #: instead of ``k``/``v``: the blocks held in the engine that took it (``hold_kv``)
    kv_hold: KVHold | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def live_hold(self) -> KVHold | None:
        """``kv_hold`` until it is released (then None: the blocks are gone)."""
        hold = self.kv_hold
        return hold if hold is not None and hold.alive else None

    @property
    def has_kv(self) -> bool:
        """Whether it carries its KV (copied in ``k``/``v``, or held: ``live_hold``)."""
        return self.live_hold is not None or (self.k is not None and self.v is not None)

    def truncated(self, num_generated: int) -> RequestSnapshot:
        """This snapshot as it was after ``num_generated`` sampled tokens (a consumer that
        received fewer tokens than the engine sampled continues from what it has; the
        dropped tail is re-sampled identically since sampling is counter-based)."""
        if not 0 <= num_generated <= self.num_generated:
            raise ValueError(f"cannot truncate {self.num_generated} tokens to {num_generated}")
        if num_generated == self.num_generated:
            return self
        n_tokens = self.num_prompt_tokens + num_generated
        computed = min(self.num_computed_tokens, n_tokens - 1)
        k = v = None
        if self.k is not None and self.v is not None and computed > 0:
            n_blocks = -(-computed // self.block_size)
            k, v = self.k[:, :n_blocks], self.v[:, :n_blocks]
        hold = self.kv_hold if computed > 0 else None  # restore reads only what it needs
        return msgspec.structs.replace(
            self,
            token_ids=self.token_ids[:n_tokens],
            logprobs=self.logprobs[:num_generated],
            num_computed_tokens=computed if k is not None or hold is not None else 0,
            k=k,
            v=v,
            kv_hold=hold,
        )

    def materialized(self, *, release: bool = True) -> RequestSnapshot:
        """This snapshot with its held KV read into ``k``/``v``; the hold is released unless
        ``release=False`` (this snapshot may still be restored in this process)."""
        hold = self.kv_hold
        if hold is None:
            return self
        n_blocks = -(-self.num_computed_tokens // self.block_size)
        k, v = hold.read(n_blocks) if n_blocks else (None, None)
        if release:
            hold.release()
        return msgspec.structs.replace(
            self,
            k=k,
            v=v,
            kv_hold=None,
            num_computed_tokens=self.num_computed_tokens if k is not None else 0,
        )

    def save(self, path: str | Path) -> Path:
        """Write ``path/meta.msgpack`` and ``path/kv.safetensors`` (atomically: temp + rename)."""
        from safetensors.torch import save_file

        snap = self.materialized(release=False)  # saving does not use this snapshot up
        meta = msgspec.structs.replace(snap, k=None, v=None)
        tensors = {}
        if snap.k is not None and snap.v is not None:
            tensors = {"k": snap.k.contiguous(), "v": snap.v.contiguous()}
        with atomic_dir(path) as tmp:
            (tmp / "meta.msgpack").write_bytes(msgspec.msgpack.encode(meta, enc_hook=_enc))
            save_file(tensors, str(tmp / "kv.safetensors"))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> RequestSnapshot:
        """Read a snapshot written by ``save``; raises ``ValueError`` naming what is wrong."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        p = Path(path)
        try:
            meta = msgspec.msgpack.decode(
                (p / "meta.msgpack").read_bytes(), type=cls, dec_hook=_dec
            )
        except (OSError, msgspec.DecodeError) as exc:
            raise ValueError(f"snapshot {p} has an unreadable meta.msgpack: {exc}") from exc
        try:
            tensors = load_file(str(p / "kv.safetensors"))
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"snapshot {p} has an unreadable kv.safetensors: {exc}") from exc
        meta.k, meta.v = tensors.get("k"), tensors.get("v")
        return meta


def _enc(obj: object) -> object:
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec(typ: type, obj: object) -> object:
    # a ValueError is a ValidationError to msgspec (a damaged meta.msgpack that holds
    # something where k and v are written as nil); NotImplementedError escaped it
    raise ValueError(f"unexpected {type(obj).__name__} for a {getattr(typ, '__name__', typ)}")
