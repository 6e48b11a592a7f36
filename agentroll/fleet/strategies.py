"""Weight-update strategies of a fleet: ``pause``, ``rolling``, ``drain``, ``background``.

Each is ``async def S(fleet, update, names, report, policies)``: it installs ``update`` on
the replicas ``names``, records what it cost in ``report`` (pause lengths, failures) and
leaves every replica that took it ``active`` at the new version (DESIGN.md "Fleet").
Invariant: a replica applies only while paused, so no forward pass mixes two versions.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from agentroll.errors import WeightSyncError
from agentroll.fleet.replica import ReplicaDown

if TYPE_CHECKING:
    from agentroll.fleet.backend import FleetBackend, PolicySource
    from agentroll.types import SyncReport


def _idle(fleet: FleetBackend, group: list[str]) -> Any:
    return lambda: not any(fleet.calls_on(n) for n in group)


async def _wait(fleet: FleetBackend, done: Any, timeout: float) -> bool:
    """Wait until ``done()`` holds (re-checked whenever the fleet changes)."""
    try:
        async with asyncio.timeout(timeout):
            while not done():
                changed = fleet._changed
                try:
                    async with asyncio.timeout(0.05):
                        await changed.wait()
                except TimeoutError:
                    pass
    except TimeoutError:
        return False
    return True


async def _apply_group(
    fleet: FleetBackend,
    update: Any,
    group: list[str],
    report: SyncReport,
    policies: PolicySource | None,
    paused_at: dict[str, float],
    staged: set[str] | frozenset[str] = frozenset(),
) -> None:
    ok = await asyncio.gather(
        *(fleet.apply_on(n, update, report, staged=n in staged) for n in group)
    )
    chosen = policies() if policies is not None else None
    await asyncio.gather(*(fleet.resume_replica(n, chosen) for n in group))
    now = time.perf_counter()
    for n, applied in zip(group, ok, strict=True):
        if n in paused_at:
            report.pause_ms.append((now - paused_at[n]) * 1e3)
        if applied and fleet.status(n) != "down":
            fleet._set_status(n, "active")


async def pause(
    fleet: FleetBackend,
    update: Any,
    names: list[str],
    report: SyncReport,
    policies: PolicySource | None,
) -> None:
    """Every replica stops at a token boundary, applies, resumes (in-flight requests under their
    resume policy).  Shortest sync; the whole fleet stalls for it.
    """
    paused_at = {}
    for n in names:
        paused_at[n] = time.perf_counter()
    await asyncio.gather(*(fleet.pause_replica(n) for n in names))
    await _apply_group(fleet, update, names, report, policies, paused_at)


async def _pin_wait(fleet: FleetBackend, group: list[str]) -> None:
    """The last replicas of a version serve the episodes pinned to it until they end."""
    members = set(group)
    for v in {fleet.router.slots[n].version for n in group}:
        others = [
            s
            for s in fleet.router.slots.values()
            if s.name not in members and s.status == "active" and s.version == v
        ]
        if not others:
            await _wait(fleet, lambda v=v: fleet.router.pinned_at(v) == 0, fleet.pin_timeout)


async def _move_calls(
    fleet: FleetBackend, group: list[str], policies: PolicySource | None
) -> list[Any]:
    """Move the calls in flight on a paused group, each as its resume policy says: keep ->
    with its KV, recompute -> KV recomputed there, restart -> started over (the peers'
    baseline).  Returns the calls that could not move."""
    chosen = policies() if policies is not None else {}
    calls = [c for n in group for c in fleet.calls_on(n)]
    snaps: dict[str, Any] = {}
    for n in group:  # one engine call per replica, not one per request
        ids = [
            c.request.request_id
            for c in fleet.calls_on(n)
            if chosen.get(c.request.request_id, "keep") != "restart"
        ]
        for kv in (True, False):
            subset = [i for i in ids if (chosen.get(i, "keep") == "keep") == kv]
            if subset and fleet.replicas[n].supports_snapshots:
                with_kv = kv and fleet.migrate_with_kv
                hold = {"hold_kv": True} if with_kv and fleet.hold_kv else {}
                snaps.update(await fleet.replicas[n].snapshot_many(subset, with_kv=with_kv, **hold))

    async def move(call: Any) -> bool:
        rid = call.request.request_id
        policy = chosen.get(rid, "keep")
        replica = call.replica
        if policy != "restart" and rid not in snaps and replica and replica.supports_snapshots:
            return False  # finished there: its last chunk is on the way
        return await fleet.migrate(
            call,
            set(group),
            with_kv=None if policy == "keep" else False,
            restart=policy == "restart",
            snapshot=snaps.get(rid),
        )

    # all at once: each move waits for its pump to end (an event-loop round trip), which
    # one by one added up to tens of ms of the group's pause under load
    moved = await asyncio.gather(*(move(c) for c in calls))
    return [c for c, ok in zip(calls, moved, strict=True) if not ok]


async def _rebalance(fleet: FleetBackend, names: list[str], report: SyncReport) -> None:
    """Move half the difference from the busiest replica to the idlest, when it is worth a
    pause: the last group of a rolling update rejoins empty, and without new calls arriving
    it would stay idle until the calls elsewhere end."""
    loads = {n: len(fleet.calls_on(n)) for n in names if fleet.status(n) == "active"}
    if len(loads) < 2:
        return
    lo = min(loads, key=lambda n: (loads[n], n))
    hi = max(loads, key=lambda n: (loads[n], n))
    move = (loads[hi] - loads[lo]) // 2
    if move < 2 or not fleet.replicas[hi].supports_snapshots:
        return
    t0 = time.perf_counter()
    await fleet.pause_replica(hi)
    try:
        calls = fleet.calls_on(hi)[:move]
        ids = [c.request.request_id for c in calls]
        with_kv = fleet.migrate_with_kv
        hold = {"hold_kv": True} if with_kv and fleet.hold_kv else {}
        snaps = await fleet.replicas[hi].snapshot_many(ids, with_kv=with_kv, **hold)
        others = set(fleet.replicas) - {lo}
        await asyncio.gather(
            *(fleet.migrate(c, others, snapshot=snaps.get(c.request.request_id)) for c in calls)
        )
    finally:
        await fleet.resume_replica(hi)
        report.pause_ms.append((time.perf_counter() - t0) * 1e3)


async def rolling(
    fleet: FleetBackend,
    update: Any,
    names: list[str],
    report: SyncReport,
    policies: PolicySource | None,
) -> None:
    """Update ``group_size`` replicas at a time while the others keep generating.

    Every replica first verifies the update into a second copy while still generating (where
    memory allows; else it applies while paused); then a group stops taking calls, its
    in-flight calls migrate at once to the other replicas with their KV
    (``in_flight="migrate"``, the default: the sync takes a few pauses; between replicas in one
    process the KV is held where it is and read by the replica the call moves to, so the pause
    copies nothing) or finish there first (``in_flight="finish"``: the sync lasts as long as the
    longest call, up to ``drain_timeout``, after which the rest migrates), it installs the
    update and rejoins.  With pinned episodes the last replicas of a version wait until no live
    episode is pinned to it.
    """
    # Least-loaded replicas first: they have the fewest calls to move, and once updated they
    # take the calls of the next group.
    names = sorted(names, key=lambda n: (len(fleet.calls_on(n)), n))
    groups = [names[i : i + fleet.group_size] for i in range(0, len(names), fleet.group_size)]
    # Pipelining: while group k applies, group k+1 (already out of routing) runs to its next
    # token boundary, so k+1's calls move to k the moment k rejoins and k never idles.
    # With two groups the next one is the only place the calls can move to: taking it out of
    # routing early would stall the whole fleet, so pipelining needs a third.
    prefetch = fleet.in_flight == "migrate" and not fleet.pin_versions and len(groups) > 2
    pausing: dict[int, asyncio.Task[Any]] = {}
    paused_at: dict[str, float] = {}
    # Verify the update into a second copy on every replica while they all still generate
    # (where memory allows): a group's pause then holds a memcpy instead of the whole apply.
    staged: set[str] = set()
    if fleet.stage_updates:
        results = await asyncio.gather(
            *(fleet.replicas[n].stage(update, max_bytes=fleet.background_max_bytes) for n in names),
            return_exceptions=True,
        )
        staged = {
            n for n, r in zip(names, results, strict=True) if not isinstance(r, BaseException)
        }

    def start_pause(i: int) -> None:
        for n in groups[i]:
            fleet._set_status(n, "draining")
            paused_at[n] = time.perf_counter()
        pausing[i] = asyncio.ensure_future(
            asyncio.gather(*(fleet.pause_replica(n) for n in groups[i]))
        )

    try:
        for i, group in enumerate(groups):
            if i not in pausing:
                if fleet.pin_versions:
                    await _pin_wait(fleet, group)
                for n in group:
                    fleet._set_status(n, "draining")
                if fleet.in_flight == "finish":  # what is left after the deadline moves
                    await _wait(fleet, _idle(fleet, group), fleet.drain_timeout)
                start_pause(i)
            await pausing.pop(i)
            if prefetch and i + 1 < len(groups):
                for n in groups[i + 1]:  # no new calls or migrations onto the next group
                    fleet._set_status(n, "draining")
            stuck = await _move_calls(fleet, group, policies)
            if stuck:  # nowhere to move them (pinned, or no snapshot support): let them finish
                await asyncio.gather(*(fleet.resume_replica(n) for n in group))
                for n in group:
                    report.pause_ms.append((time.perf_counter() - paused_at[n]) * 1e3)
                await _wait(fleet, _idle(fleet, group), 600.0)
                start_pause(i)
                await pausing.pop(i)
            if prefetch and i + 1 < len(groups):
                start_pause(i + 1)
            for n in group:
                fleet._set_status(n, "updating")
            await _apply_group(fleet, update, group, report, policies, paused_at, staged)
        if fleet.in_flight == "migrate" and len(groups) > 1:
            await _rebalance(fleet, names, report)
    finally:
        for task in pausing.values():  # an error left a prefetched pause behind
            await asyncio.gather(task, return_exceptions=True)
            for n in names:
                if fleet.status(n) == "draining":
                    await fleet.resume_replica(n)
                    fleet._set_status(n, "active")


async def drain(
    fleet: FleetBackend,
    update: Any,
    names: list[str],
    report: SyncReport,
    policies: PolicySource | None,
) -> None:
    """No new calls; every in-flight call finishes; then apply everywhere."""
    t0 = time.perf_counter()
    for n in names:
        fleet._set_status(n, "draining")
    await _wait(fleet, _idle(fleet, names), 3600.0)
    await asyncio.gather(*(fleet.pause_replica(n) for n in names))
    await _apply_group(fleet, update, names, report, policies, dict.fromkeys(names, t0))


async def background(
    fleet: FleetBackend,
    update: Any,
    names: list[str],
    report: SyncReport,
    policies: PolicySource | None,
) -> None:
    """Each replica verifies the update into a second copy of the touched tensors while it keeps
    generating, then swaps it in at a token boundary (one memcpy of pause).  Refused, with
    nothing changed, when the second copy does not fit in memory.
    """
    results = await asyncio.gather(
        *(fleet.replicas[n].stage(update, max_bytes=fleet.background_max_bytes) for n in names),
        return_exceptions=True,
    )
    down = {n: r for n, r in zip(names, results, strict=True) if isinstance(r, ReplicaDown)}
    for n, exc in down.items():  # a dead replica must not block the others' updates forever
        report.failed[n] = f"down: {exc}"
        fleet._mark_down(n)
    refused = {
        n: r
        for n, r in zip(names, results, strict=True)
        if isinstance(r, BaseException) and n not in down
    }
    if refused:
        why = "; ".join(f"{n}: {r}" for n, r in refused.items())
        raise WeightSyncError(
            f"background update {update.version} refused, nothing changed ({why}); "
            "use the pause or rolling strategy"
        )
    for n in names:
        if n in down:
            continue
        t0 = time.perf_counter()
        try:
            version = await fleet.replicas[n].swap()
        except ReplicaDown as exc:
            report.failed[n] = f"down: {exc}"
            fleet._mark_down(n)
            continue
        except Exception as exc:
            report.failed[n] = f"{type(exc).__name__}: {exc}"
            fleet._set_status(n, "failed")
            continue
        report.pause_ms.append((time.perf_counter() - t0) * 1e3)
        fleet.router.set_version(n, version)


__all__ = ["background", "drain", "pause", "rolling"]
