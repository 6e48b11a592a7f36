"""Routing generation calls to replicas (pure logic, no I/O).

Invariants: only ``active`` replicas take new calls; a pinned episode only goes to a replica
at its pinned version; loads never go negative; a replica that is ``down`` is never picked
again; ``forget`` drops every trace of an episode and at most ``MAX_GROUPS`` groups are
remembered (no unbounded growth over a long run).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

ReplicaStatus = Literal["active", "draining", "updating", "failed", "down"]
MAX_GROUPS = 4096  # groups whose replica is remembered (the most recent)


@dataclass(slots=True)
class ReplicaSlot:
    name: str
    version: int
    capacity: int = 64
    status: ReplicaStatus = "active"
    load: int = 0


class Router:
    """Least-loaded routing with episode affinity and version pinning.

    The fleet asks ``pick`` which replica serves a call and tells the router when calls start
    and end and when replicas change status or version.  Rules, in order: only ``active``
    replicas take new calls; a pinned episode only goes to a replica at its pinned version; an
    episode goes back to the replica that served its previous call (its prefix KV is cached
    there) unless that replica carries more than ``affinity_slack`` calls above the
    least-loaded candidate; an episode's first call goes to the replica of its group's
    earlier episodes (the samples of a task share their prompt's prefill and prefix cache
    there) unless that one carries more than ``group_slack`` calls above the least-loaded;
    otherwise the least-loaded candidate (load relative to capacity), ties broken by name.
    ``pick`` returns ``None`` when no replica may take the call now (the caller waits for
    ``changed``).
    """

    def __init__(self, *, affinity_slack: int = 2, group_slack: int = 64) -> None:
        if affinity_slack < 0 or group_slack < 0:
            raise ValueError("affinity_slack and group_slack must be >= 0")
        self.affinity_slack = affinity_slack
        self.group_slack = group_slack
        self._groups: OrderedDict[str, str] = OrderedDict()  # group -> replica
        self.slots: dict[str, ReplicaSlot] = {}
        self._last: dict[str, str] = {}  # episode -> replica of its previous call
        self._pins: dict[str, int] = {}  # episode -> pinned version

    # -- replicas ----------------------------------------------------------------------------

    def add(self, name: str, version: int, capacity: int = 64) -> None:
        if name in self.slots:
            raise ValueError(f"replica {name!r} is already registered")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.slots[name] = ReplicaSlot(name, version, capacity)

    def remove(self, name: str) -> None:
        """Forget a replica that carries no call (it left the fleet)."""
        slot = self.slots[name]
        if slot.load:
            raise ValueError(f"replica {name!r} still carries {slot.load} call(s)")
        del self.slots[name]
        for episode in [e for e, n in self._last.items() if n == name]:
            del self._last[episode]
        for group in [g for g, n in self._groups.items() if n == name]:
            del self._groups[group]

    def set_status(self, name: str, status: ReplicaStatus) -> None:
        slot = self.slots[name]
        if slot.status == "down" and status != "down":
            raise ValueError(f"replica {name!r} is down and cannot come back")
        slot.status = status

    def set_version(self, name: str, version: int) -> None:
        self.slots[name].version = version

    def active(self) -> list[str]:
        return [s.name for s in self.slots.values() if s.status == "active"]

    def versions(self, statuses: Collection[str] = ("active",)) -> set[int]:
        return {s.version for s in self.slots.values() if s.status in statuses}

    # -- episodes ----------------------------------------------------------------------------

    def pin(self, episode_id: str, version: int) -> None:
        self._pins.setdefault(episode_id, version)

    def pinned_version(self, episode_id: str) -> int | None:
        return self._pins.get(episode_id)

    def unpin(self, episode_id: str) -> None:
        self._pins.pop(episode_id, None)

    def pinned_at(self, version: int) -> int:
        """Live episodes pinned to ``version``."""
        return sum(1 for v in self._pins.values() if v == version)

    def forget(self, episode_id: str) -> None:
        self._last.pop(episode_id, None)
        self._pins.pop(episode_id, None)

    # -- calls ---------------------------------------------------------------------------------

    def candidates(
        self, episode_id: str, exclude: Collection[str] = (), *, prefer_newest: bool = False
    ) -> list[ReplicaSlot]:
        """Active replicas the episode may use; with ``prefer_newest`` (an episode about to
        be pinned) only those at the newest active version."""
        pin = self._pins.get(episode_id)
        cands = [
            s
            for s in self.slots.values()
            if s.status == "active" and s.name not in exclude and (pin is None or s.version == pin)
        ]
        if prefer_newest and pin is None and cands:
            newest = max(s.version for s in cands)
            cands = [s for s in cands if s.version == newest]
        return cands

    def pick(
        self,
        episode_id: str,
        exclude: Collection[str] = (),
        *,
        prefer_newest: bool = False,
        group_id: str = "",
    ) -> str | None:
        """The replica that should serve the episode's next call, or None (wait)."""
        cands = self.candidates(episode_id, exclude, prefer_newest=prefer_newest)
        if not cands:
            return None
        best = min(cands, key=lambda s: (s.load / s.capacity, s.load, s.name))
        last = self.slots.get(self._last.get(episode_id, ""))
        if last is not None and last in cands and last.load <= best.load + self.affinity_slack:
            return last.name
        if last is None and group_id:
            home = self.slots.get(self._groups.get(group_id, ""))
            if home is not None and home in cands and home.load <= best.load + self.group_slack:
                return home.name
        return best.name

    def started(self, episode_id: str, name: str, *, group_id: str = "") -> None:
        self.slots[name].load += 1
        self._last[episode_id] = name
        if group_id:
            self._groups[group_id] = name
            self._groups.move_to_end(group_id)
            if len(self._groups) > MAX_GROUPS:
                self._groups.popitem(last=False)

    def finished(self, name: str) -> None:
        slot = self.slots[name]
        slot.load = max(0, slot.load - 1)


__all__ = ["MAX_GROUPS", "ReplicaSlot", "ReplicaStatus", "Router"]
