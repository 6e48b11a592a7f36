"""Trajectories -> padded training tensors, and a torch ``IterableDataset`` over a stream.

Invariants: row ``i`` of every tensor of a ``Batch`` is trajectory ``i``, right-padded; the
token ids are exactly the sampled/rendered ids (never re-tokenised); ``loss_mask`` is 1
exactly on sampled tokens (within ``max_len``), never on padding, and behaviour logprobs are
0 and versions -1 wherever it is 0; the dataset's thread and loop end with its iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from agentroll.trainer.advantages import group_advantages
from agentroll.types import Trajectory

TrajectorySource = (
    Callable[[], AsyncIterator[list[Trajectory]] | AsyncIterable[list[Trajectory]]]
    | Callable[[], Iterable[list[Trajectory]]]
    | AsyncIterable[list[Trajectory]]
    | Iterable[list[Trajectory]]
)


@dataclass(slots=True, eq=False)
class Batch:
    """Padded tensors of ``B`` trajectories of at most ``T`` tokens (CPU tensors).

    ``input_ids`` [B,T] int64 (``pad_id`` past the end), ``attention_mask`` [B,T] bool,
    ``loss_mask`` [B,T] bool, ``behaviour_logprobs`` [B,T] float32 (0 where not in the loss),
    ``policy_version`` / ``kv_version`` [B,T] int32 (-1 where not in the loss),
    ``advantages`` [B] float32 (one per sequence), ``rewards`` [B] float32, ``lengths`` [B]
    int64 (tokens kept per row), ``num_truncated`` tokens dropped by ``max_len`` overall.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    policy_version: torch.Tensor
    kv_version: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_ids: list[str]
    trajectory_ids: list[str]
    lengths: torch.Tensor
    num_truncated: int = 0

    @property
    def size(self) -> int:
        """Number of trajectories (rows)."""
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: str | torch.device) -> Batch:
        """A copy whose tensors live on ``device``."""
        moved = {
            name: getattr(self, name).to(device)
            for name in (
                "input_ids",
                "attention_mask",
                "loss_mask",
                "behaviour_logprobs",
                "policy_version",
                "kv_version",
                "advantages",
                "rewards",
                "lengths",
            )
        }
        return Batch(
            **moved,
            group_ids=list(self.group_ids),
            trajectory_ids=list(self.trajectory_ids),
            num_truncated=self.num_truncated,
        )


def collate(
    trajectories: Sequence[Trajectory],
    *,
    pad_id: int = 0,
    advantages: np.ndarray | Sequence[float] | None = None,
    max_len: int | None = None,
) -> Batch:
    """Pad ``trajectories`` into a :class:`Batch`.

    ``advantages`` (one per trajectory) defaults to :func:`group_advantages` over the
    trajectories' rewards and group ids, so whole groups must be in the same call.  A
    trajectory longer than ``max_len`` keeps its first ``max_len`` tokens (a prefix stays a
    valid conditioning context); the dropped count is ``Batch.num_truncated``.  Behaviour
    logprobs that are NaN on a loss token stay NaN (a demonstration without logprobs is fine
    for ``sft_step``; the policy-gradient step refuses it).

    Raises ValueError for an empty list, a non-positive ``max_len`` or a misaligned
    ``advantages``.
    """
    if not trajectories:
        raise ValueError("collate: got no trajectories; pass at least one")
    if max_len is not None and max_len < 1:
        raise ValueError(f"collate: max_len must be >= 1 (or None), got {max_len}")
    n = len(trajectories)
    if advantages is None:
        adv = group_advantages([t.reward for t in trajectories], [t.group_id for t in trajectories])
    else:
        adv = np.asarray(advantages, dtype=np.float32)
        if adv.shape != (n,):
            raise ValueError(
                f"collate: advantages has shape {adv.shape}; pass one value per trajectory ({n})"
            )
    full = np.array([t.num_tokens for t in trajectories], dtype=np.int64)
    lengths = full if max_len is None else np.minimum(full, max_len)
    width = max(int(lengths.max()), 1)
    ids = np.full((n, width), pad_id, dtype=np.int64)
    attn = np.zeros((n, width), dtype=bool)
    loss = np.zeros((n, width), dtype=bool)
    blp = np.zeros((n, width), dtype=np.float32)
    pv = np.full((n, width), -1, dtype=np.int32)
    kv = np.full((n, width), -1, dtype=np.int32)
    for i, t in enumerate(trajectories):
        k = int(lengths[i])
        m = t.loss_mask[:k].astype(bool)
        ids[i, :k] = t.token_ids[:k]
        attn[i, :k] = True
        loss[i, :k] = m
        blp[i, :k] = np.where(m, t.logprobs[:k], 0.0)
        pv[i, :k] = np.where(m, t.policy_version[:k], -1)
        kv[i, :k] = np.where(m, t.kv_version[:k], -1)
    return Batch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        loss_mask=torch.from_numpy(loss),
        behaviour_logprobs=torch.from_numpy(blp),
        policy_version=torch.from_numpy(pv),
        kv_version=torch.from_numpy(kv),
        advantages=torch.from_numpy(np.ascontiguousarray(adv, dtype=np.float32)),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=[t.group_id for t in trajectories],
        trajectory_ids=[t.id for t in trajectories],
        lengths=torch.from_numpy(lengths.copy()),
        num_truncated=int((full - lengths).sum()),
    )


class _AsyncPump:
    """Runs a source on a private event loop in a thread; ``get`` blocks the caller until
    the next item.  At most ``maxsize`` items wait in the queue (back-pressure)."""

    END = object()

    def __init__(self, make: Callable[[], Any], maxsize: int) -> None:
        self._make, self._maxsize = make, maxsize
        self._loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self._loop.run_forever, name="agentroll-trajectory-dataset", daemon=True
        )
        self.thread.start()
        self._closed = False
        self._task: asyncio.Task[None] = self._call(self._start()).result()

    def _call(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> asyncio.Task[None]:
        self._queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue(self._maxsize)
        return asyncio.create_task(self._produce())

    async def _produce(self) -> None:
        iterator: Any = None
        try:
            source = self._make()  # called here, so an async source binds to this loop
            if hasattr(source, "__aiter__"):
                iterator = source.__aiter__()
                async for item in iterator:
                    await self._queue.put((item, None))
            else:
                for item in source:
                    await self._queue.put((item, None))
            await self._queue.put((self.END, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer and re-raised there
            await self._queue.put((self.END, exc))
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    def get(self) -> Any:
        """The next item, or ``END``; re-raises the source's exception in the caller."""
        if self._closed:
            return self.END
        item, exc = self._call(self._queue.get()).result()
        if exc is not None:
            raise exc
        return item

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the pump's loop (awaiting it if it returns an awaitable); return
        its result or raise its exception in the caller."""

        async def invoke() -> Any:
            result = fn()
            return await result if inspect.isawaitable(result) else result

        return self._call(invoke()).result()

    async def _stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._queue.empty():  # wakes a consumer blocked in get() on another thread
            self._queue.put_nowait((self.END, None))
        await self._loop.shutdown_asyncgens()

    def close(self) -> None:
        """Cancel the source (its ``finally`` blocks run), stop the loop, join the thread."""
        if self._closed:
            return
        self._closed = True
        self._call(self._stop()).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.thread.join()
        self._loop.close()


class TrajectoryDataset(IterableDataset[Batch]):
    """Yields one :class:`Batch` per list of trajectories from ``source``.

    ``source`` is a callable returning an async iterator of lists (e.g. a stream client's
    ``batches``) or a sync iterable of them, an async iterable, or a sync iterable of lists.
    A callable or async source runs on a private event loop in a background thread (one per
    iteration) with at most ``queue_size`` lists waiting, so the source feels back-pressure;
    its exceptions are re-raised in the consuming thread after the lists before them.
    Leaving the loop early (``break``, an exception, ``close()``) cancels the source (its
    ``finally`` blocks run) and joins the thread.  A plain sync iterable is read in the
    consuming thread.  ``ack`` (e.g. a stream client's ``ack``, with ``auto_ack=False``) is
    called with a batch's trajectory ids when the consumer asks for the next batch, i.e. after
    it trained on it -- on the source's loop for a callable or async source; a batch the
    consumer stops on is not acknowledged (the stream offers it again; dedupe by id).  Use
    ``DataLoader(ds, batch_size=None, num_workers=0)``: it already batches, and each worker
    process would open its own source.  ``pad_id`` and ``max_len`` go to :func:`collate`;
    ``advantages`` maps a list of trajectories to their advantages (default: group-normalised
    over the list).

    Its background thread and event loop never outlive the iteration that started them.
    """

    def __init__(
        self,
        source: TrajectorySource,
        *,
        pad_id: int = 0,
        max_len: int | None = None,
        queue_size: int = 2,
        advantages: Callable[[list[Trajectory]], np.ndarray] | None = None,
        ack: Callable[[list[str]], Any] | None = None,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.source = source
        self.pad_id, self.max_len, self.queue_size = pad_id, max_len, queue_size
        self.advantages = advantages
        self.ack = ack
        self._pumps: set[_AsyncPump] = set()
        self._lock = threading.Lock()

    def _collate(self, trajectories: list[Trajectory]) -> Batch:
        adv = None if self.advantages is None else self.advantages(trajectories)
        return collate(trajectories, pad_id=self.pad_id, advantages=adv, max_len=self.max_len)

    def __iter__(self) -> Iterator[Batch]:
        source: Any = self.source
        ack = self.ack
        if not callable(source) and not hasattr(source, "__aiter__"):
            for trajs in source:
                batch = self._collate(list(trajs))
                yield batch
                if ack is not None:
                    result = ack(batch.trajectory_ids)
                    if inspect.iscoroutine(result):
                        result.close()
                        raise TypeError("an async ack needs a callable or async source")
            return
        pump = _AsyncPump(source if callable(source) else lambda: source, self.queue_size)
        with self._lock:
            self._pumps.add(pump)
        try:
            while (item := pump.get()) is not _AsyncPump.END:
                batch = self._collate(list(item))
                yield batch
                if ack is not None:
                    pump.call(functools.partial(ack, batch.trajectory_ids))
        finally:
            with self._lock:
                self._pumps.discard(pump)
            pump.close()

    def close(self) -> None:
        """Stop every iteration still running (their source is cancelled, threads joined)."""
        with self._lock:
            pumps, self._pumps = list(self._pumps), set()
        for pump in pumps:
            pump.close()

    def __enter__(self) -> TrajectoryDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
