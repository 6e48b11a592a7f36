"""The accounting of the chaos benchmark: what was durable, delivered, lost or duplicated.

Pure logic on recorded events (no I/O): the kill plan, the tally and its explanation.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    pass


#: where a kill lands: a random moment of generation, within milliseconds of a spool write,
#: while the consumer holds a lease (its training step, before the ack), while a weight push
#: is in flight, while an ack is in flight, and 0-250 ms after the worker said it serves
#: (restoring its spool, taking the first full weight update)
MOMENTS = ("generate", "publish", "lease", "weights", "ack", "restart")


@dataclass
class Kill:
    """One SIGKILL: its moment, when it landed, what was in flight, what the spool held."""

    index: int
    moment: str
    seconds_after_ready: float
    push_in_flight: bool
    ack_in_flight: bool
    unacked: int  # ids the consumer leased and had no confirmed ack for
    spool_pending: int
    torn_records: int
    pending_ids: list[str] = field(repr=False, default_factory=list)

    def describe(self) -> str:
        return (
            f"kill {self.index + 1} ({self.moment}) {self.seconds_after_ready:.2f} s after "
            f"ready: push_in_flight={self.push_in_flight} ack_in_flight={self.ack_in_flight} "
            f"unacked={self.unacked}; "
            f"spool held {self.spool_pending} unacked ({self.torn_records} torn dropped)"
        )


class Event(NamedTuple):
    """What the consumer saw: a trajectory in a lease reply (``leased``, with its group), or
    its id in an ack the worker confirmed (``acked``).  ``incarnation``: which worker
    process (0 = the first) it came from, for the report."""

    kind: Literal["leased", "acked"]
    trajectory_id: str
    group_id: str = ""
    incarnation: int = 0


@dataclass(frozen=True)
class ChaosOutcome:
    """The result line's figures (``line()``) and the ids behind the failing ones."""

    kills: int
    durable: int
    delivered: int
    lost_ids: tuple[str, ...]
    duplicated_ids: tuple[str, ...]
    incomplete_groups: tuple[tuple[str, int], ...]  # (group_id, distinct members delivered)

    @property
    def target_met(self) -> bool:
        return not (self.lost_ids or self.duplicated_ids or self.incomplete_groups)

    def line(self) -> str:
        return (
            f"kills={self.kills} durable={self.durable} delivered={self.delivered} "
            f"lost={len(self.lost_ids)} duplicated_after_dedupe={len(self.duplicated_ids)} "
            f"groups_incomplete={len(self.incomplete_groups)}"
        )


def tally(
    *, kills: int, durable: Iterable[str], events: Iterable[Event], samples_per_task: int
) -> ChaosOutcome:
    """Count a chaos run from the ids the spool held (``durable``: after each kill and at the
    end) and the consumer's ``events`` in the order they happened.

    durable: distinct ids of ``durable`` and of every lease (the stream offers only records
    that are in the spool); delivered: distinct leased ids; lost: durable ids never leased;
    duplicated_after_dedupe: distinct ids leased again after the worker had confirmed their
    ack.  A consumer that dedupes by id (as this bench's does, and ``StreamClient``) skips
    them, so by construction it never trains on an id twice; these are the ids a trainer
    whose dedupe set does not outlive its own restart would train on twice, and each one is
    an acknowledged trajectory offered again, which the stream promises never happens.  groups_incomplete: groups with fewer distinct members leased than
    ``samples_per_task``.  Raises ``ValueError`` for an unknown event kind, an ack of an id
    never leased, or ``samples_per_task < 1``."""
    if samples_per_task < 1:
        raise ValueError(f"samples_per_task={samples_per_task}; use >= 1")
    delivered: set[str] = set()
    acked: set[str] = set()
    duplicated: dict[str, None] = {}  # insertion-ordered: the order they came back in
    members: dict[str, set[str]] = {}
    for event in events:
        tid = event.trajectory_id
        if event.kind == "leased":
            if tid in acked:
                duplicated[tid] = None
            delivered.add(tid)
            members.setdefault(event.group_id, set()).add(tid)
        elif event.kind == "acked":
            if tid not in delivered:
                raise ValueError(f"trajectory {tid!r} was acked before it was ever leased")
            acked.add(tid)
        else:
            raise ValueError(f"unknown event kind {event.kind!r}; use 'leased' or 'acked'")
    all_durable = set(durable) | delivered
    return ChaosOutcome(
        kills=kills,
        durable=len(all_durable),
        delivered=len(delivered),
        lost_ids=tuple(sorted(all_durable - delivered)),
        duplicated_ids=tuple(duplicated),
        incomplete_groups=tuple(
            sorted((g, len(m)) for g, m in members.items() if len(m) < samples_per_task)
        ),
    )


def kill_plan(kills: int, seed: int) -> list[str]:
    """The moment of each kill: every moment once per round of ``len(MOMENTS)`` kills, each
    round in its own seeded order."""
    rng = random.Random(seed)
    plan: list[str] = []
    while len(plan) < kills:
        round_ = list(MOMENTS)
        rng.shuffle(round_)
        plan += round_
    return plan[:kills]


def explain(outcome: ChaosOutcome, kills: Sequence[Kill], events: Sequence[Event]) -> str:
    """For each failing id or group: where the consumer saw it (``leased@2``: in a lease of
    the third worker process) and which kills left it in the spool; then every kill."""
    seen: dict[str, list[str]] = {}
    for e in events:
        seen.setdefault(e.trajectory_id, []).append(f"{e.kind}@{e.incarnation}")
        if e.group_id:
            seen.setdefault(e.group_id, []).append(f"member {e.trajectory_id}@{e.incarnation}")

    def spooled(tid: str) -> str:
        held = [f"{k.index + 1} ({k.moment})" for k in kills if tid in k.pending_ids]
        return f"; in the spool after kill {', '.join(held)}" if held else ""

    lines = [f"lost {tid}{spooled(tid) or '; in the final spool'}" for tid in outcome.lost_ids]
    lines += [
        f"delivered again after its ack {tid}: {' '.join(seen.get(tid, []))}{spooled(tid)}"
        for tid in outcome.duplicated_ids
    ]
    lines += [
        f"incomplete group {gid} ({n} delivered): {' '.join(seen.get(gid, []))}"
        for gid, n in outcome.incomplete_groups
    ]
    return "\n".join(lines + [k.describe() for k in kills])
