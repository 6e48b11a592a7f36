"""The warm pool alone: how many it keeps started, what it refuses to hand out (expired,
failed), and that a cancelled taker or a close leaves no sandbox open."""

from __future__ import annotations

import asyncio

import pytest

from agentroll.rollout.prewarm import WarmPool
from agentroll.sandbox.base import SandboxConfig
from agentroll.testing import FakeSandbox


class Slow(FakeSandbox):
    made: list[Slow] = []
    fail = False
    delay = 0.01

    def __init__(self) -> None:
        super().__init__()
        self.started = False
        Slow.made.append(self)

    async def start(self) -> None:
        await asyncio.sleep(Slow.delay)
        if Slow.fail:
            raise RuntimeError("no room")
        self.started = True


@pytest.fixture(autouse=True)
def made(monkeypatch: pytest.MonkeyPatch) -> list[Slow]:
    Slow.made, Slow.fail, Slow.delay = [], False, 0.01
    monkeypatch.setattr("agentroll.rollout.prewarm.open_sandbox", lambda cfg, **kw: Slow())
    return Slow.made


async def test_keeps_its_target_started_and_replaces_each_taken(made: list[Slow]) -> None:
    pool = WarmPool(SandboxConfig(), 3)
    pool.fill()
    await asyncio.sleep(0.05)
    assert len(made) == 3 and all(b.started for b in made)
    got = [await pool.take() for _ in range(5)]
    assert len({id(b) for b in got}) == 5 and all(b is not None and b.started for b in got)
    assert len(pool) == 3 and pool.counters["taken"] == 5 and pool.counters["started"] == 8
    await pool.close()
    left = [b for b in made if b not in got]
    assert len(left) == 3 and all(b.closed for b in left)
    assert not any(b.closed for b in got)  # the episodes' own now


async def test_a_take_waits_for_a_start_under_way(made: list[Slow]) -> None:
    Slow.delay = 0.05
    pool = WarmPool(SandboxConfig(), 1)
    pool.fill()
    box = await pool.take()
    assert box is not None and box.started
    await pool.close()


async def test_an_expired_sandbox_is_closed_not_handed_out(made: list[Slow]) -> None:
    pool = WarmPool(SandboxConfig(), 1, max_idle=0.02)
    pool.fill()
    await asyncio.sleep(0.05)
    first = made[0]
    box = await pool.take()  # the first expired; none left: the episode opens its own
    assert box is None and pool.counters["expired"] == 1
    await pool.close()
    assert first.closed


async def test_a_failed_start_gives_none_and_is_counted(made: list[Slow]) -> None:
    Slow.fail = True
    pool = WarmPool(SandboxConfig(), 2)
    pool.fill()
    assert await pool.take() is None
    assert pool.counters["failed"] == 1
    await pool.close()
    assert all(b.closed for b in made)


async def test_a_cancelled_taker_leaves_no_sandbox_open(made: list[Slow]) -> None:
    Slow.delay = 0.2
    pool = WarmPool(SandboxConfig(), 1)
    pool.fill()
    taker = asyncio.create_task(pool.take())
    await asyncio.sleep(0.01)
    taker.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taker
    await pool.close()
    assert len(made) == 2 and all(b.closed for b in made)


async def test_close_stops_starts_and_no_more_fill(made: list[Slow]) -> None:
    pool = WarmPool(SandboxConfig(), 4)
    pool.fill()
    await pool.close()
    pool.fill()
    assert len(made) <= 4 and len(pool) == 0 and all(b.closed for b in made)
    assert await pool.take() is None


def test_a_pool_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="target=0"):
        WarmPool(SandboxConfig(), 0)
