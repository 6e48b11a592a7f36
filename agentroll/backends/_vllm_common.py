"""Pieces the two vLLM backends share (``vllm`` in-process, ``http`` to a server).

``Epochs`` keeps the versions of one request's output tokens; ``HostWeights`` the verified
host copy of the served weights.  Invariant: a failed update leaves the engine on its old
weights and the host copy uncommitted.  No vLLM import here: the engine is reached through
the ``reload`` coroutine passed in.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from agentroll.backends.base import GenerationChunk
from agentroll.errors import BackendError, WeightSyncError


class Epochs:
    """Per-request output-token versions.

    ``epochs`` holds ``(first output index, policy_version, kv_version)`` entries; a pause
    records where the engine had produced tokens, and the resume opens a new epoch there.
    ``split`` turns a run of tokens into chunks that each carry one version pair.
    """

    __slots__ = ("cutoff", "epochs")

    def __init__(self, version: int) -> None:
        self.epochs: list[tuple[int, int, int]] = [(0, version, version)]
        self.cutoff: int | None = None  # tokens the engine had produced at the pause

    def reset(self, version: int) -> None:
        self.epochs = [(0, version, version)]
        self.cutoff = None

    def versions(self, index: int) -> tuple[int, int]:
        for start, pv, kv in reversed(self.epochs):
            if start <= index:
                return pv, kv
        return self.epochs[0][1], self.epochs[0][2]

    def restart(self, version: int, delivered: int) -> list[GenerationChunk]:
        """The turn starts over on ``version``: what the consumer must be told (a
        ``rollback`` of the ``delivered`` tokens, if any)."""
        self.reset(version)
        if not delivered:
            return []
        return [
            GenerationChunk(
                token_ids=[],
                logprobs=[],
                policy_version=version,
                kv_version=version,
                rollback=delivered,
            )
        ]

    def policy_spans(self, n: int) -> list[tuple[int, int, int]]:
        """``(policy_version, start, end)`` runs over the first ``n`` output tokens."""
        spans: list[tuple[int, int, int]] = []
        starts = [e for e in self.epochs if e[0] < n]
        for k, (start, pv, _) in enumerate(starts):
            end = starts[k + 1][0] if k + 1 < len(starts) else n
            if spans and spans[-1][0] == pv:
                spans[-1] = (pv, spans[-1][1], end)
            elif end > start:
                spans.append((pv, start, end))
        return spans

    def resume(self, version: int, policy: str) -> None:
        """Open the epoch that starts at the recorded cutoff (``keep``: old kv version)."""
        cutoff = self.cutoff or 0
        self.cutoff = None
        if cutoff == 0:  # nothing computed yet: it starts on the current weights
            self.reset(version)
            return
        _, pv, kv = self.epochs[-1]
        new_kv = version if policy == "recompute" else kv
        if (pv, kv) != (version, new_kv):
            self.epochs.append((cutoff, version, new_kv))

    def split(
        self, start: int, ids: list[int], lps: list[float], finish: Any = None
    ) -> list[GenerationChunk]:
        """Chunks of ``ids`` (output indexes from ``start``), one per version pair; the last
        carries ``finish`` (an empty chunk when there are no tokens)."""
        chunks: list[GenerationChunk] = []
        i = 0
        while i < len(ids):
            pv, kv = self.versions(start + i)
            j = i + 1
            while j < len(ids) and self.versions(start + j) == (pv, kv):
                j += 1
            chunks.append(
                GenerationChunk(
                    token_ids=ids[i:j], logprobs=lps[i:j], policy_version=pv, kv_version=kv
                )
            )
            i = j
        if finish is not None:
            if not chunks:
                pv, kv = self.versions(start)
                chunks.append(
                    GenerationChunk(token_ids=[], logprobs=[], policy_version=pv, kv_version=kv)
                )
            chunks[-1].finish_reason = finish
        return chunks


def finish_reason(reason: str | None) -> Any:
    if reason is None:
        return None
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason, "stop")


class HostWeights:
    """The verified host copy of what the engine serves, and its checkpoint directories.

    ``stage`` applies a ``WeightUpdate`` aside (per-tensor checksums and the model digest
    checked, as the built-in engine does) and writes the resulting checkpoint; ``reload_into``
    has the engine load it and reloads the previous checkpoint if that fails (or if ``verify``
    finds the engine serving other bytes), so a failed update leaves the engine on its old
    weights; only then is the host copy committed.  ``push`` is the same without a checkpoint
    on disk, for transfers that move tensors (NCCL): a failure sends the old tensors back.
    """

    def __init__(self, model_dir: Path, version: int = 0, root: str | Path | None = None) -> None:
        self.model_dir = model_dir
        self.version = version
        self.served = model_dir  # the checkpoint the engine loaded last
        self._root = root
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._store: Any = None

    @property
    def store(self) -> Any:
        if self._store is None:
            from agentroll.engine.models import read_tensors
            from agentroll.weights.apply import WeightStore

            self._store = WeightStore(read_tensors(self.model_dir), version=self.version)
        return self._store

    def _dir(self, version: int) -> Path:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="agentroll-weights-", dir=self._root)
        return Path(self._tmp.name) / f"v{version}"

    def stage(self, update: Any) -> tuple[Any, Path]:
        """Verify ``update`` on the host copy (``WeightSyncError``) and write the checkpoint
        it leads to.  Blocking: run it off the event loop."""
        from safetensors.torch import save_file

        store = self.store
        staged = store.stage(update)
        target = self._dir(int(update.version))
        target.mkdir(parents=True, exist_ok=True)
        tensors = {n: staged.tensors.get(n, t).contiguous() for n, t in store.tensors.items()}
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
        for item in self.model_dir.iterdir():  # config, tokenizer, generation config
            if item.is_file() and not item.name.endswith((".safetensors", ".index.json")):
                shutil.copy2(item, target / item.name)
        return staged, target

    async def apply(
        self,
        update: Any,
        reload: Callable[[Path], Awaitable[None]],
        what: str,
        verify: Callable[[Mapping[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        """Stage ``update``, have the engine ``reload`` it, ``verify`` what it serves against
        the staged tensors (every tensor of the model), commit.  On a failed reload or
        verification the previous checkpoint is reloaded and ``WeightSyncError`` raised
        (nothing changed)."""
        staged, target = await asyncio.to_thread(self.stage, update)
        await self.install(update, staged, target, reload, what, verify)

    async def install(
        self,
        update: Any,
        staged: Any,
        target: Path,
        reload: Callable[[Path], Awaitable[None]],
        what: str,
        verify: Callable[[Mapping[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        """The second half of ``apply``, for an update ``stage`` prepared earlier (while the
        engine kept generating)."""
        previous = self.served

        async def undo() -> None:
            shutil.rmtree(target, ignore_errors=True)
            await reload(previous)

        await self._load(update, staged, lambda: reload(target), undo, what, verify)
        self.store.commit(staged)
        if previous != self.model_dir:
            shutil.rmtree(previous, ignore_errors=True)
        self.served = target
        self.version = int(update.version)

    async def push(
        self,
        update: Any,
        send: Callable[[Mapping[str, Any], Mapping[str, Any]], Awaitable[None]],
        what: str,
        verify: Callable[[Mapping[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        """Like ``apply`` without a checkpoint on disk: ``send(new, old)`` moves the staged
        tensors (and the ones they replace) into the engine; a failure sends ``old`` back."""
        staged = await asyncio.to_thread(self.store.stage, update)
        old = {name: self.store.tensors[name] for name in staged.tensors}
        await self._load(
            update,
            staged,
            lambda: send(staged.tensors, old),
            lambda: send(old, staged.tensors),
            what,
            verify,
        )
        self.store.commit(staged)
        self.version = int(update.version)

    async def _load(
        self,
        update: Any,
        staged: Any,
        load: Callable[[], Awaitable[None]],
        undo: Callable[[], Awaitable[None]],
        what: str,
        verify: Callable[[Mapping[str, Any]], Awaitable[None]] | None,
    ) -> None:
        """``load`` then ``verify`` (against every tensor of the model); on a failure,
        ``undo`` and raise ``WeightSyncError`` (``BackendError`` if the undo fails too)."""
        try:
            await load()
            if verify is not None:
                await verify({**self.store.tensors, **staged.tensors})
        except Exception as exc:
            try:
                await undo()
            except Exception as again:  # pragma: no cover - the engine is broken
                raise BackendError(
                    f"{what}: restoring version {self.version} after a failed update failed "
                    f"too: {again}"
                ) from exc
            raise WeightSyncError(f"{what} could not load version {update.version}: {exc}") from exc

    def cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def tensors(self) -> Mapping[str, Any]:
        return dict(self.store.tensors)
