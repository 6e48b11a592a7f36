"""The rolling strategy's call moves on a synthetic fleet: the calls of a paused group move
at once, not one after another (each move waits for its pump to end: one by one under load
those waits added tens of ms to the group's pause, and `bench pause` p99 over its target)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from agentroll.fleet import strategies
from agentroll.types import SyncReport


class FakeFleet:
    """What ``_move_calls`` and ``_rebalance`` use of a ``FleetBackend``."""

    migrate_with_kv = True
    hold_kv = False

    def __init__(self, calls: dict[str, int]) -> None:
        self.calls = {
            n: [
                SimpleNamespace(request=SimpleNamespace(request_id=f"{n}-{i}"), replica=None)
                for i in range(k)
            ]
            for n, k in calls.items()
        }
        self.replicas = {n: SimpleNamespace(supports_snapshots=True) for n in calls}
        for n, replica in self.replicas.items():
            replica.snapshot_many = self._snapshots(n)  # type: ignore[attr-defined]
        self.in_flight = 0
        self.most_in_flight = 0
        self.moved: list[str] = []
        self.paused: list[str] = []

    def _snapshots(self, name: str) -> Any:
        async def snapshot_many(ids: list[str], *, with_kv: bool) -> dict[str, str]:
            return {i: f"snap-{i}" for i in ids}

        return snapshot_many

    def calls_on(self, name: str) -> list[Any]:
        return list(self.calls[name])

    def status(self, name: str) -> str:
        return "active"

    async def pause_replica(self, name: str) -> None:
        self.paused.append(name)

    async def resume_replica(self, name: str, policies: Any = None) -> None:
        pass

    async def migrate(self, call: Any, exclude: set[str], **kwargs: Any) -> bool:
        assert kwargs["snapshot"] == f"snap-{call.request.request_id}"
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01)  # the pump's end: an event-loop round trip or more
        self.in_flight -= 1
        self.moved.append(call.request.request_id)
        return True


async def test_a_paused_groups_calls_move_at_once() -> None:
    fleet = FakeFleet({"a": 8, "b": 3})
    stuck = await strategies._move_calls(fleet, ["a"], None)  # type: ignore[arg-type]
    assert stuck == []
    assert sorted(fleet.moved) == sorted(f"a-{i}" for i in range(8))
    assert fleet.most_in_flight == 8


async def test_a_rebalance_moves_its_calls_at_once() -> None:
    fleet = FakeFleet({"a": 10, "b": 0})
    report = SyncReport(strategy="rolling", version=1)
    await strategies._rebalance(fleet, ["a", "b"], report)  # type: ignore[arg-type]
    assert fleet.paused == ["a"] and len(report.pause_ms) == 1
    assert len(fleet.moved) == 5 and fleet.most_in_flight == 5  # half the difference
