"""Weight-update strategies of a fleet (DESIGN.md "Fleet").

Each strategy is ``async def S(fleet, update, names, report, policies)``: it installs
``update`` on the replicas ``names`` of ``fleet`` (a ``FleetBackend``), records what it cost
in ``report`` (pause lengths per replica, failures) and leaves every replica that took the
update ``active`` at the new version.

- ``pause``: every replica stops at a token boundary, applies, resumes (in-flight requests
  under their resume policy).  Shortest sync, the whole fleet stalls for it.
- ``rolling``: replicas are updated ``group_size`` at a time; a group stops taking calls,
  its in-flight calls migrate to the other replicas with their KV (or finish first), it
  applies and rejoins, so the others keep generating throughout.  With pinned episodes the
  last replicas of a version wait until no live episode is pinned to it.
- ``drain``: no new calls; every in-flight call finishes; then apply everywhere.
- ``background``: each replica verifies the update into a second copy of the touched
  tensors while it keeps generating, then swaps it in at a token boundary (one memcpy of
  pause).  Refused, with nothing changed, when the second copy does not fit in memory.

Invariant: a replica applies only while paused, so no forward pass mixes two versions.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from agentroll.errors import WeightSyncError

if TYPE_CHECKING:
    from agentroll.fleet.backend import FleetBackend, PolicySource, SyncReport


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
) -> None:
    ok = await asyncio.gather(*(fleet.apply_on(n, update, report) for n in group))
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
    paused_at = {}
    for n in names:
        paused_at[n] = time.perf_counter()
    await asyncio.gather(*(fleet.pause_replica(n) for n in names))
    await _apply_group(fleet, update, names, report, policies, paused_at)


async def rolling(
    fleet: FleetBackend,
    update: Any,
    names: list[str],
    report: SyncReport,
    policies: PolicySource | None,
) -> None:
    groups = [names[i : i + fleet.group_size] for i in range(0, len(names), fleet.group_size)]
    for group in groups:
        members = set(group)
        if fleet.pin_versions:
            # The last replicas of a version serve the episodes pinned to it until they end.
            old = {fleet.router.slots[n].version for n in group}
            for v in old:
                others = [
                    s
                    for s in fleet.router.slots.values()
                    if s.name not in members and s.status == "active" and s.version == v
                ]
                if not others:
                    await _wait(
                        fleet, lambda v=v: fleet.router.pinned_at(v) == 0, fleet.pin_timeout
                    )
        for n in group:
            fleet._set_status(n, "draining")
        if fleet.in_flight == "finish":
            await _wait(fleet, _idle(fleet, group), 600.0)
        paused_at = {}
        for n in group:
            paused_at[n] = time.perf_counter()
        await asyncio.gather(*(fleet.pause_replica(n) for n in group))
        # Calls in flight move on, each as its resume policy says: keep -> with its KV,
        # recompute -> KV recomputed there, restart -> started over (the peers' baseline).
        chosen = policies() if policies is not None else {}
        calls = [c for n in group for c in fleet.calls_on(n)]
        moved = await asyncio.gather(
            *(
                fleet.migrate(
                    call,
                    members,
                    with_kv=None
                    if chosen.get(call.request.request_id, "keep") == "keep"
                    else False,
                    restart=chosen.get(call.request.request_id) == "restart",
                )
                for call in calls
            )
        )
        stuck = [c for c, ok in zip(calls, moved, strict=True) if not ok]
        if stuck:  # nowhere to move them (pinned, or no snapshot support): let them finish
            await asyncio.gather(*(fleet.resume_replica(n) for n in group))
            for n in group:
                report.pause_ms.append((time.perf_counter() - paused_at[n]) * 1e3)
            await _wait(fleet, _idle(fleet, group), 600.0)
            for n in group:
                paused_at[n] = time.perf_counter()
            await asyncio.gather(*(fleet.pause_replica(n) for n in group))
        for n in group:
            fleet._set_status(n, "updating")
        await _apply_group(fleet, update, group, report, policies, paused_at)


async def drain(
    fleet: FleetBackend,
    update: Any,
    names: list[str],
    report: SyncReport,
    policies: PolicySource | None,
) -> None:
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
    results = await asyncio.gather(
        *(fleet.replicas[n].stage(update, max_bytes=fleet.background_max_bytes) for n in names),
        return_exceptions=True,
    )
    refused = {n: r for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)}
    if refused:
        why = "; ".join(f"{n}: {r}" for n, r in refused.items())
        raise WeightSyncError(
            f"background update {update.version} refused, nothing changed ({why}); "
            "use the pause or rolling strategy"
        )
    for n in names:
        t0 = time.perf_counter()
        try:
            version = await fleet.replicas[n].swap()
        except Exception as exc:
            report.failed[n] = f"{type(exc).__name__}: {exc}"
            fleet._set_status(n, "failed")
            continue
        report.pause_ms.append((time.perf_counter() - t0) * 1e3)
        fleet.router.set_version(n, version)


__all__ = ["background", "drain", "pause", "rolling"]
