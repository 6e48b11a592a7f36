"""torch.distributed weight transport: one rank broadcasts an update to every rank of a group.

Invariants: receivers verify every payload's xxh3 and never return a partial update; every
rank, the sender too, raises ``WeightSyncError`` if any receiver failed to verify its copy;
a dead or stuck rank surfaces as ``WeightSyncError`` once the process group's timeout
expires, and the group must then be destroyed and re-created before a retry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from agentroll.errors import WeightSyncError
from agentroll.weights.transport import (
    FrameDecoder,
    WeightTransport,
    decode_header,
    describe,
    run_blocking,
)
from agentroll.weights.update import WeightUpdate


def _collective(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except RuntimeError as exc:  # DistBackendError and gloo/NCCL timeouts are RuntimeErrors
        raise WeightSyncError(f"weight broadcast failed: {exc}") from exc


def _buckets(
    payloads: Sequence[bytes | bytearray], bucket_bytes: int
) -> Iterator[list[memoryview]]:
    """The payload bytes cut into consecutive buckets of ``bucket_bytes`` (the last shorter)."""
    pieces: list[memoryview] = []
    room = bucket_bytes
    for payload in payloads:
        view = memoryview(payload)
        while len(view):
            take = min(room, len(view))
            pieces.append(view[:take])
            view, room = view[take:], room - take
            if room == 0:
                yield pieces
                pieces, room = [], bucket_bytes
    if pieces:
        yield pieces


def broadcast_update(
    update: WeightUpdate | None,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = 64 << 20,
) -> WeightUpdate:
    """Broadcast ``update`` from global rank ``src`` to every rank of ``group`` and return it
    on every rank.  ``src`` passes the update, every other rank passes ``None``; all ranks
    must call this together.  ``bucket_bytes`` (taken from ``src``) bounds the extra memory
    per rank.  Blocks; from async code use ``DistTransport``.

    Raises ``ValueError`` when called wrongly (no process group, update given on the wrong
    rank) and ``WeightSyncError`` on every rank when a rank dies or times out, or when any
    receiver's copy fails verification.

    Wire format (all collectives are broadcasts from ``src``, then one all-reduce):

    1. an int64 tensor ``[len(H), payload_bytes, bucket_bytes]``;
    2. ``H``: the msgpack ``UpdateHeader`` (per-payload length and xxh3) as a uint8 tensor;
    3. the payloads concatenated in header order, in uint8 buckets of ``bucket_bytes`` (the
       last one shorter; a bucket may span payloads);
    4. an all-reduce(MIN) of a per-rank ok flag, so every rank learns whether all verified.

    Init the process group with ``timeout=timedelta(...)``.  After a failure destroy the group
    (``dist.destroy_process_group()``, else gloo can abort the interpreter at exit) and
    re-create it before a retry.  gloo buckets live on the CPU; with NCCL they live on the
    current CUDA device and the sender stages through pinned host memory (the NCCL path is
    exercised only on a GPU machine).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("broadcast_update needs an initialised torch.distributed process group")
    is_src = dist.get_rank() == src
    if is_src != (update is not None):
        raise ValueError(f"rank {src} must pass the update and every other rank None")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    broadcast = functools.partial(_collective, dist.broadcast, src=src, group=group)

    head = b""
    sizes = torch.zeros(3, dtype=torch.int64)
    if update is not None:
        head = msgspec.msgpack.encode(describe(update))
        sizes = torch.tensor([len(head), update.payload_bytes, bucket_bytes], dtype=torch.int64)
    sizes = sizes.to(device)
    broadcast(sizes)
    head_len, total, bucket_bytes = (int(x) for x in sizes.tolist())

    head_t = torch.empty(head_len, dtype=torch.uint8)
    if is_src:
        head_t.numpy()[:] = np.frombuffer(head, dtype=np.uint8)
    head_t = head_t.to(device)
    broadcast(head_t)

    # receivers keep taking part after a verification error so the group stays in step
    error: WeightSyncError | None = None
    decoder: FrameDecoder | None = None
    if not is_src:
        try:
            decoder = FrameDecoder(decode_header(head_t.cpu().numpy().tobytes()))
        except WeightSyncError as exc:
            error = exc

    bucket = torch.empty(min(bucket_bytes, total), dtype=torch.uint8, device=device)
    staging = bucket
    if is_src and device.type != "cpu":
        staging = torch.empty(bucket.numel(), dtype=torch.uint8, pin_memory=True)
    pieces = _buckets([t.payload for t in update.tensors], bucket_bytes) if update else None
    for start in range(0, total, bucket_bytes):
        view = bucket[: min(bucket_bytes, total - start)]
        if pieces is not None:
            host = staging.numpy()
            offset = 0
            for piece in next(pieces):
                host[offset : offset + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
                offset += len(piece)
            if staging is not bucket:
                view.copy_(staging[: view.numel()])
        broadcast(view)
        if decoder is not None and error is None:
            try:
                decoder.feed(view.cpu().numpy().data)
            except WeightSyncError as exc:
                error = exc

    result = update
    if decoder is not None and error is None:
        try:
            result = decoder.finish()
        except WeightSyncError as exc:
            error = exc
    ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=device)
    _collective(dist.all_reduce, ok, op=dist.ReduceOp.MIN, group=group)
    if error is not None:
        raise error
    if int(ok.item()) == 0 or result is None:
        raise WeightSyncError("a receiving rank could not verify its copy of the update")
    return result


class DistTransport(WeightTransport):
    """``broadcast_update`` for async code: rank ``src`` calls ``send``, every other rank
    ``receive``; the collective runs in a worker thread.  A collective cannot be interrupted:
    on cancellation the call waits for it to finish or hit the group timeout, then re-raises,
    so no thread outlives the call (and the group stays in step)."""

    def __init__(
        self, *, src: int = 0, group: dist.ProcessGroup | None = None, bucket_bytes: int = 64 << 20
    ) -> None:
        self._call = functools.partial(
            broadcast_update, src=src, group=group, bucket_bytes=bucket_bytes
        )

    async def send(self, update: WeightUpdate) -> None:
        await run_blocking(self._call, update)

    async def receive(self) -> WeightUpdate:
        return await run_blocking(self._call, None)
