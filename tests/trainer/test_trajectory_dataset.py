"""TrajectoryDataset over sync and async sources: nothing lost or reordered, back-pressure
bounds how far an async source runs ahead, errors reach the consumer, and leaving early
cancels the source and joins the background thread."""

import asyncio
import threading
from collections.abc import AsyncIterator

import numpy as np
import pytest
from torch.utils.data import DataLoader

from agentroll.trainer.batch import Batch, TrajectoryDataset
from agentroll.types import Trajectory


def lists(n: int, per: int = 2) -> list[list[Trajectory]]:
    return [
        [
            Trajectory(
                id=f"{i}-{j}",
                task_id="t",
                group_id=f"g{i}",
                reward=float(j),
                token_ids=np.arange(3 + j),
                loss_mask=np.r_[0, np.ones(2 + j)],
                logprobs=np.r_[np.nan, -np.ones(2 + j)],
                policy_version=np.r_[-1, np.zeros(2 + j)],
                kv_version=np.r_[-1, np.zeros(2 + j)],
            )
            for j in range(per)
        ]
        for i in range(n)
    ]


def ids(batches: list[Batch]) -> list[str]:
    return [tid for b in batches for tid in b.trajectory_ids]


def dataset_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "agentroll-trajectory-dataset"]


def test_sync_iterable_and_dataloader() -> None:
    data = lists(3)
    ds = TrajectoryDataset(data)
    out = list(DataLoader(ds, batch_size=None))
    assert ids(out) == [t.id for batch in data for t in batch]
    assert out[0].input_ids.shape == (2, 4)
    assert out[0].advantages.tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-4)


def test_async_source_delivers_everything_in_order() -> None:
    data = lists(20)

    async def source() -> AsyncIterator[list[Trajectory]]:
        for batch in data:
            await asyncio.sleep(0)
            yield batch

    out = list(TrajectoryDataset(source, queue_size=3))
    assert ids(out) == [t.id for batch in data for t in batch]
    assert not dataset_threads()


def test_callable_sync_source_and_async_iterable_object() -> None:
    data = lists(4)
    assert ids(list(TrajectoryDataset(lambda: iter(data)))) == ids(list(TrajectoryDataset(data)))

    class Stream:
        def __aiter__(self) -> AsyncIterator[list[Trajectory]]:
            return self.gen()

        async def gen(self) -> AsyncIterator[list[Trajectory]]:
            for batch in data:
                yield batch

    assert ids(list(TrajectoryDataset(Stream()))) == [t.id for b in data for t in b]
    assert not dataset_threads()


def test_back_pressure_bounds_the_lead_and_break_cancels_the_source() -> None:
    data = lists(1000, per=1)
    queue_size = 2
    produced = consumed = max_lead = 0
    cleaned = threading.Event()

    async def source() -> AsyncIterator[list[Trajectory]]:
        nonlocal produced, max_lead
        try:
            for batch in data:
                max_lead = max(max_lead, produced - consumed)
                produced += 1
                yield batch
        finally:
            cleaned.set()

    ds = TrajectoryDataset(source, queue_size=queue_size)
    for _ in ds:
        consumed += 1
        if consumed == 5:
            break
    # break closed the generator: the source was cancelled and the thread joined
    assert cleaned.is_set() and not dataset_threads()
    # ahead of the consumer: at most queue_size lists queued plus the one being handed over
    assert max_lead <= queue_size + 1
    assert produced <= consumed + queue_size + 1


def test_ack_runs_on_the_source_loop_after_the_consumer_is_done() -> None:
    data = lists(4)
    acked: list[list[str]] = []
    ack_threads: set[str] = set()

    async def source() -> AsyncIterator[list[Trajectory]]:
        for batch in data:
            yield batch

    async def ack(ids: list[str]) -> None:
        await asyncio.sleep(0)
        ack_threads.add(threading.current_thread().name)
        acked.append(ids)

    ds = TrajectoryDataset(source, ack=ack, queue_size=4)
    for k, batch in enumerate(ds):
        assert batch.trajectory_ids == [t.id for t in data[k]]
        assert acked == [[t.id for t in b] for b in data[:k]]  # only batches trained on
        if k == 2:
            break  # the batch the consumer stops on is not acknowledged
    assert acked == [[t.id for t in b] for b in data[:2]]
    assert ack_threads == {"agentroll-trajectory-dataset"}
    sync_acked: list[list[str]] = []
    for _ in TrajectoryDataset(data, ack=sync_acked.append):
        pass
    assert sync_acked == [[t.id for t in b] for b in data]


def test_source_errors_reach_the_consumer_after_earlier_lists() -> None:
    data = lists(2)

    async def source() -> AsyncIterator[list[Trajectory]]:
        for batch in data:
            yield batch
        raise RuntimeError("stream broke")

    got: list[Batch] = []
    with pytest.raises(RuntimeError, match="stream broke"):
        for b in TrajectoryDataset(source):
            got.append(b)
    assert ids(got) == [t.id for batch in data for t in batch]
    assert not dataset_threads()


def test_close_from_outside_stops_a_suspended_iteration() -> None:
    async def endless() -> AsyncIterator[list[Trajectory]]:
        while True:
            await asyncio.sleep(0)
            yield lists(1)[0]

    with TrajectoryDataset(endless) as ds:
        it = iter(ds)
        next(it)
        assert len(dataset_threads()) == 1
    assert not dataset_threads()  # __exit__ closed it
    with pytest.raises(StopIteration):
        next(it)


def test_rejects_a_zero_queue() -> None:
    with pytest.raises(ValueError, match="queue_size"):
        TrajectoryDataset([], queue_size=0)
