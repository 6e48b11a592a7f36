"""Trajectory buffer and admission control: the staleness bound is exact, groups stay whole
and FIFO, back-pressure holds and nothing is lost (synthetic trajectories, fake clock)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from agentroll.errors import ConfigError
from agentroll.rollout.admission import AdmissionController
from agentroll.rollout.buffer import BufferConfig, TrajectoryBuffer
from agentroll.types import Trajectory


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def traj(tid: str, versions: Sequence[int] = (0,), gid: str | None = None) -> Trajectory:
    """Two prompt tokens (not sampled, version -1) then one sampled token per version."""
    n = 2 + len(versions)
    return Trajectory(
        id=tid,
        task_id="task-" + (gid or tid),
        group_id=gid or tid,
        token_ids=np.arange(n, dtype=np.int32),
        logprobs=np.zeros(n, np.float32),
        loss_mask=np.array([0, 0] + [1] * len(versions), np.uint8),
        policy_version=np.array([-1, -1, *versions], np.int32),
        kv_version=np.array([-1, -1, *versions], np.int32),
    )


def group(gid: str, n: int, version: int = 0) -> list[Trajectory]:
    return [traj(f"{gid}.{i}", (version,), gid) for i in range(n)]


def ids(trajs: Sequence[Trajectory]) -> list[str]:
    return [t.id for t in trajs]


async def settle() -> None:
    """Let every ready task run (no waiting for a condition: a fixed number of loop turns)."""
    for _ in range(5):
        await asyncio.sleep(0)


# -- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": 2, "group_size": 4}, "capacity"),
        ({"group_size": 0}, "group_size"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"on_stale": "skip"}, "on_stale"),
        ({"lease_ttl": 0.0}, "lease_ttl"),
        ({"lease_ttl": float("inf")}, "lease_ttl"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        BufferConfig(**kwargs)


def test_malformed_groups_are_refused_and_nothing_is_inserted() -> None:
    buf = TrajectoryBuffer(BufferConfig(group_size=2))
    with pytest.raises(ValueError, match="exactly 2"):
        buf.try_put(group("g", 3))
    with pytest.raises(ValueError, match="group_id"):
        buf.try_put([traj("a", gid="g1"), traj("b", gid="g2")])
    with pytest.raises(ValueError, match="twice"):
        buf.try_put([traj("a", gid="g"), traj("a", gid="g")])
    assert buf.try_put(group("g", 2))
    with pytest.raises(ValueError, match="already in the buffer"):
        buf.try_put([traj("g.0", gid="h"), traj("h.1", gid="h")])
    assert len(buf) == 2 and buf.statistics().put == 2


# -- staleness bound ----------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 3])
def test_bound_is_exact_at_k_and_k_plus_1_drop(k: int) -> None:
    dropped: list[list[str]] = []
    buf = TrajectoryBuffer(
        BufferConfig(max_staleness=k, on_stale="drop", group_size=2),
        on_drop=lambda trajs: dropped.append(ids(trajs)),
    )
    t = 10
    assert buf.try_put(group("old", 2, version=t - k - 1))  # staleness k + 1 at t
    assert buf.try_put(group("edge", 2, version=t - k))  # staleness exactly k at t
    buf.set_trainer_version(t)  # queued groups are re-checked now
    assert dropped == [["old.0", "old.1"]]
    lease = buf.try_lease(10)
    assert lease is not None and ids(lease.trajectories) == ["edge.0", "edge.1"]
    stats = buf.statistics()
    assert (stats.dropped_stale, stats.kept_stale, stats.staleness) == (2, 0, {k: 2})
    assert stats.queued == 0 and stats.leased == 2


@pytest.mark.parametrize("k", [0, 2])
def test_bound_is_exact_at_k_and_k_plus_1_keep(k: int) -> None:
    buf = TrajectoryBuffer(BufferConfig(max_staleness=k, on_stale="keep", group_size=2))
    buf.try_put(group("old", 2, version=0))
    buf.try_put(group("edge", 2, version=1))
    buf.set_trainer_version(k + 1)
    assert buf.statistics().kept_stale == 2  # counted when found stale
    lease = buf.try_lease(10, trainer_version=k + 1)
    assert lease is not None and len(lease.trajectories) == 4  # handed out anyway
    stats = buf.statistics()
    assert stats.kept_stale == 2 and stats.dropped_stale == 0  # counted once, not per check
    assert stats.staleness == {k: 2, k + 1: 2}


def test_oldest_sampled_token_decides_and_prompt_tokens_do_not() -> None:
    buf = TrajectoryBuffer(BufferConfig(max_staleness=1))
    buf.try_put([traj("mixed", (5, 3, 5))])  # oldest sampled token at version 3
    buf.set_trainer_version(5)
    assert buf.try_lease(1) is None and buf.statistics().dropped_stale == 1


def test_no_sampled_tokens_is_never_stale() -> None:
    buf = TrajectoryBuffer(BufferConfig(max_staleness=0))
    buf.try_put([traj("none", ())])
    buf.set_trainer_version(100)
    lease = buf.try_lease(1)
    assert lease is not None and ids(lease.trajectories) == ["none"]
    assert buf.statistics().staleness == {}  # nothing sampled: no staleness to record


def test_on_policy_mode_k0_hands_out_only_the_current_version() -> None:
    buf = TrajectoryBuffer(BufferConfig(max_staleness=0))
    for v in (3, 4, 4):
        buf.try_put([traj(f"v{v}-{len(buf)}", (v,))])
    lease = buf.try_lease(10, trainer_version=4)  # passing a newer version records it
    assert lease is not None and [t.min_policy_version() for t in lease.trajectories] == [4, 4]
    assert lease.trainer_version == 4 == buf.statistics().trainer_version
    assert buf.statistics().dropped_stale == 1


def test_no_bound_mode_keeps_everything() -> None:
    buf = TrajectoryBuffer(BufferConfig(max_staleness=None))
    buf.try_put([traj("ancient", (0,))])
    buf.set_trainer_version(1000)
    lease = buf.try_lease(1)
    assert lease is not None and buf.statistics().staleness == {1000: 1}
    assert buf.statistics().dropped_stale == buf.statistics().kept_stale == 0


def test_staleness_uses_the_max_of_set_and_passed_version() -> None:
    buf = TrajectoryBuffer(BufferConfig(max_staleness=1))
    buf.try_put([traj("a", (2,))])
    buf.set_trainer_version(3)
    lease = buf.try_lease(1, trainer_version=1)  # an older version does not lower the bound
    assert lease is not None and lease.trainer_version == 3
    with pytest.raises(ValueError, match="must not decrease"):
        buf.set_trainer_version(2)


def test_expired_lease_is_rechecked_for_staleness() -> None:
    clock = FakeClock()
    dropped: list[str] = []
    buf = TrajectoryBuffer(
        BufferConfig(max_staleness=1, lease_ttl=5),
        clock=clock,
        on_drop=lambda trajs: dropped.extend(ids(trajs)),
    )
    buf.try_put([traj("a", (0,))])
    assert buf.try_lease(1) is not None
    buf.set_trainer_version(2)  # leased groups are not re-checked (already handed out)
    assert dropped == []
    clock.advance(5)
    assert buf.expire() == 1 and dropped == ["a"] and len(buf) == 0


# -- groups and FIFO ----------------------------------------------------------------------


def test_groups_are_released_whole_in_fifo_order() -> None:
    buf = TrajectoryBuffer(BufferConfig(group_size=3, max_staleness=None))
    for gid in "abcd":
        buf.try_put(group(gid, 3))
    first = buf.try_lease(2)  # smaller than a group: still one whole group
    second = buf.try_lease(7)  # two groups fit, a third would not
    third = buf.try_lease(3)
    assert first and second and third
    assert ids(first.trajectories) == ["a.0", "a.1", "a.2"]
    assert ids(second.trajectories) == ["b.0", "b.1", "b.2", "c.0", "c.1", "c.2"]
    assert ids(third.trajectories) == ["d.0", "d.1", "d.2"]
    assert buf.try_lease(3) is None


def test_a_stale_group_in_the_middle_is_dropped_whole_and_order_kept() -> None:
    buf = TrajectoryBuffer(BufferConfig(group_size=2, max_staleness=1))
    buf.try_put(group("a", 2, version=5))
    buf.try_put([traj("b.0", (5,), "b"), traj("b.1", (3,), "b")])  # one stale member
    buf.try_put(group("c", 2, version=5))
    lease = buf.try_lease(4, trainer_version=5)
    assert lease and ids(lease.trajectories) == ["a.0", "a.1", "c.0", "c.1"]
    assert buf.statistics().dropped_stale == 2


# -- leases, expiry, acks ---------------------------------------------------------------


def test_expiry_reoffers_at_the_front_in_original_order() -> None:
    clock = FakeClock()
    buf = TrajectoryBuffer(BufferConfig(max_staleness=None, lease_ttl=10), clock=clock)
    for gid in "abcde":
        buf.try_put([traj(gid)])
    l1 = buf.try_lease(2)  # a, b
    clock.advance(1)
    l2 = buf.try_lease(1)  # c
    assert l1 and l2 and l1.expires_at == 10 and l2.expires_at == 11
    clock.advance(9 - 1e-9)
    assert buf.expire() == 0
    clock.advance(1e-9)  # l1 expires exactly at its expires_at
    assert buf.expire() == 1
    clock.advance(1)
    relet = buf.try_lease(10)  # l2 expires too: c goes back after a, b
    # and before d, e (put order)
    assert relet and ids(relet.trajectories) == ["a", "b", "c", "d", "e"]
    assert buf.statistics().expired_leases == 2


def test_ack_unknown_duplicate_and_partial() -> None:
    clock = FakeClock()
    buf = TrajectoryBuffer(
        BufferConfig(group_size=2, max_staleness=None, lease_ttl=10, capacity=4), clock=clock
    )
    buf.try_put(group("a", 2))
    buf.try_put(group("b", 2))
    lease = buf.try_lease(2)
    assert lease is not None
    assert buf.ack(["nope", "b.0"]) == 0  # unknown, and queued but never handed out
    assert buf.ack(["a.0", "a.0"]) == 1  # duplicate in one call counted once
    assert buf.ack(["a.0"]) == 0  # acked already
    stats = buf.statistics()
    assert (stats.acked, stats.leased, stats.queued, len(buf)) == (1, 1, 2, 3)
    clock.advance(10)  # the unacked rest of the partly acked lease is re-offered alone
    relet = buf.try_lease(1)
    assert relet and ids(relet.trajectories) == ["a.1"]
    clock.advance(10)
    buf.expire()  # a.1 back in the queue; a late ack of its expired lease still counts
    assert buf.ack(["a.1"]) == 1
    rest = buf.try_lease(10)
    assert rest and ids(rest.trajectories) == ["b.0", "b.1"]
    assert buf.ack(ids(rest.trajectories)) == 2
    assert len(buf) == 0 and buf.statistics().acked == 4 and buf.statistics().open_leases == 0


def test_statistics_histogram_counts_every_hand_out() -> None:
    clock = FakeClock()
    buf = TrajectoryBuffer(BufferConfig(max_staleness=3, lease_ttl=1), clock=clock)
    for i, v in enumerate((4, 3, 3, 1)):
        buf.try_put([traj(f"t{i}", (v,))])
    lease = buf.try_lease(2, trainer_version=4)
    assert lease
    clock.advance(1)  # re-offered: counted again at the version of its new hand-out
    buf.set_trainer_version(5)
    buf.try_lease(10)
    stats = buf.statistics()
    # first hand-out at 4: t0 -> 0, t1 -> 1; at 5: t0 -> 1, t1 -> 2, t2 -> 2
    assert stats.staleness == {0: 1, 1: 2, 2: 2}
    assert stats.dropped_stale == 1  # t3 (version 1) at trainer version 5


# -- back-pressure --------------------------------------------------------------------------


async def test_put_waits_until_an_ack_frees_space() -> None:
    clock = FakeClock()
    buf = TrajectoryBuffer(BufferConfig(capacity=2, max_staleness=None), clock=clock)
    await buf.put([traj("a")])
    await buf.put([traj("b")])
    blocked = asyncio.create_task(buf.put([traj("c")]))
    await settle()
    assert not blocked.done() and buf.statistics().waiting_producers == 1
    lease = buf.try_lease(1)
    assert lease and not buf.try_put([traj("x")])  # a lease still holds its capacity
    await settle()
    assert not blocked.done()
    clock.advance(2.5)
    buf.ack(ids(lease.trajectories))
    await asyncio.wait_for(blocked, 1)
    stats = buf.statistics()
    assert len(buf) == 2 and stats.put_wait_seconds == 2.5 and stats.waiting_producers == 0
    rest = buf.try_lease(10)
    assert rest and ids(rest.trajectories) == ["b", "c"]


async def test_cancelled_put_leaves_nothing_and_the_next_producer_goes_on() -> None:
    buf = TrajectoryBuffer(BufferConfig(capacity=2, group_size=2, max_staleness=None))
    await buf.put(group("a", 2))
    first = asyncio.create_task(buf.put(group("b", 2)))
    second = asyncio.create_task(buf.put(group("c", 2)))
    await settle()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert first.cancelled() and len(buf) == 2 and buf.statistics().waiting_producers == 1
    lease = buf.try_lease(2)
    assert lease
    buf.ack(ids(lease.trajectories))
    await asyncio.wait_for(second, 1)
    rest = buf.try_lease(10)
    assert rest and ids(rest.trajectories) == ["c.0", "c.1"]  # nothing of b got in
    assert buf.statistics().put == 4
    assert buf.try_put(group("b", 2)) is False  # full again, but b's ids are free
    buf.ack(ids(rest.trajectories))
    assert buf.try_put(group("b", 2))


async def test_producers_are_served_in_arrival_order() -> None:
    buf = TrajectoryBuffer(BufferConfig(capacity=1, max_staleness=None))
    buf.try_put([traj("a")])
    waiting = [asyncio.create_task(buf.put([traj(n)])) for n in ("b", "c")]
    await settle()
    assert not buf.try_put([traj("x")])  # no overtaking of waiting producers
    for expected in ("a", "b"):
        lease = buf.try_lease(1)
        assert lease and ids(lease.trajectories) == [expected]
        buf.ack(ids(lease.trajectories))
        await settle()
    await asyncio.wait_for(asyncio.gather(*waiting), 1)
    lease = buf.try_lease(1)
    assert lease and ids(lease.trajectories) == ["c"]


def test_restore_exceeds_capacity_then_producers_wait() -> None:
    buf = TrajectoryBuffer(BufferConfig(capacity=2, group_size=2, max_staleness=None))
    n = buf.restore([group("a", 2), [traj("b.1", gid="b")]])  # b partly acked before a crash
    assert n == 3 and len(buf) == 3 and buf.statistics().restored == 3
    assert not buf.try_put(group("c", 2))
    with pytest.raises(ValueError, match="1 to 2"):
        buf.restore([[]])
    lease = buf.try_lease(2)
    assert lease and ids(lease.trajectories) == ["a.0", "a.1"]
    buf.ack(ids(lease.trajectories))
    assert not buf.try_put(group("c", 2))  # 1 held + 2 > capacity
    lease = buf.try_lease(2)
    assert lease and ids(lease.trajectories) == ["b.1"]
    buf.ack(["b.1"])
    assert buf.try_put(group("c", 2))


# -- lease waiting -----------------------------------------------------------------------


async def test_lease_waits_for_a_group_and_times_out() -> None:
    buf = TrajectoryBuffer(BufferConfig(max_staleness=None))
    assert await buf.lease(1, timeout=0) is None
    assert await buf.lease(1, timeout=0.01) is None
    pending = asyncio.create_task(buf.lease(5))
    await settle()
    assert not pending.done()
    buf.try_put([traj("a")])
    lease = await asyncio.wait_for(pending, 1)
    assert lease and ids(lease.trajectories) == ["a"]
    with pytest.raises(ValueError, match="max_trajectories"):
        await buf.lease(0)


async def test_waiting_lease_gets_a_group_back_when_its_lease_expires() -> None:
    # the real monotonic clock: the waiter must wake by itself when the ttl passes
    buf = TrajectoryBuffer(BufferConfig(max_staleness=None, lease_ttl=0.05))
    buf.try_put([traj("a")])
    first = await buf.lease(1, timeout=0)
    assert first
    again = await asyncio.wait_for(buf.lease(1), 2)
    assert again and ids(again.trajectories) == ["a"] and again.id != first.id


# -- admission control ---------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("batch", [1, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_quota_rule_matches_in_order_consumption(k: int, batch: int, n: int) -> None:
    ctrl = AdmissionController(max_staleness=k, batch_size=batch, group_size=n)
    t = 7
    for p in range(t - k - 2, t + 1):
        for outstanding in range(0, (k + 3) * batch):
            # consumed in order, batch per step: the group's last sample is position
            # outstanding + n - 1, consumed at trainer version t + position // batch
            consumed_at = t + (outstanding + n - 1) // batch
            got = ctrl.decide(policy_version=p, trainer_version=t, outstanding=outstanding)
            assert got.ok == (consumed_at <= p + k), (p, outstanding, got)
            assert got.ok == (outstanding + n <= (p + k - t + 1) * batch)


def test_quota_k0_admits_exactly_one_batch_per_version() -> None:
    ctrl = AdmissionController(max_staleness=0, batch_size=4, group_size=2)
    ok = [ctrl.decide(policy_version=3, trainer_version=3, outstanding=o).ok for o in range(7)]
    assert ok == [True, True, True, False, False, False, False]  # 2 groups of 2 = one batch
    assert not ctrl.decide(policy_version=2, trainer_version=3, outstanding=0).ok
    assert ctrl.statistics()["admitted"] == 3 and ctrl.statistics()["refused"] == 5


def test_no_bound_always_admits() -> None:
    ctrl = AdmissionController(max_staleness=None, batch_size=1)
    assert ctrl.decide(policy_version=0, trainer_version=100, outstanding=10**6).ok


def _trained(ctrl: AdmissionController, clock: FakeClock, steps: int, every: float) -> None:
    for v in range(steps + 1):
        ctrl.observe_trainer_version(v)
        if v < steps:
            clock.advance(every)


def test_duration_rule_with_a_fake_clock() -> None:
    clock = FakeClock()
    ctrl = AdmissionController(
        max_staleness=2, batch_size=4, quantile=0.9, min_observations=3, clock=clock
    )
    _trained(ctrl, clock, steps=5, every=10.0)  # 0.1 steps per second
    t = 5
    for d in (5.0, 5.0):
        ctrl.observe_episode(d)
    ctrl.observe_episode(50.0)  # 0.9 quantile: 50 s -> 5 steps during the episode
    got = ctrl.decide(policy_version=t, trainer_version=t, outstanding=4)
    assert not got.ok and got.reason.startswith("duration") and got.predicted_staleness == 5
    # the trainer needs this group to step: refusing would starve it
    assert ctrl.decide(policy_version=t, trainer_version=t, outstanding=3).ok
    for _ in range(20):  # now the 0.9 quantile is 20 s -> exactly 2 steps -> allowed
        ctrl.observe_episode(20.0)
    got = ctrl.decide(policy_version=t, trainer_version=t, outstanding=4)
    assert got.ok and got.predicted_staleness == 2
    assert not ctrl.decide(policy_version=t - 1, trainer_version=t, outstanding=4).ok
    clock.advance(50.0)  # the trainer stopped stepping: the observed rate falls to 5/100 s
    assert ctrl.decide(policy_version=t - 1, trainer_version=t, outstanding=4).ok
    stats = ctrl.statistics()
    assert stats["duration_quantile"] == 20.0 and stats["step_rate"] == pytest.approx(0.05)


def test_duration_rule_waits_for_min_observations() -> None:
    clock = FakeClock()
    ctrl = AdmissionController(max_staleness=0, batch_size=1, min_observations=4, clock=clock)
    _trained(ctrl, clock, steps=3, every=1.0)
    for _ in range(10):
        ctrl.observe_episode(100.0)
    assert ctrl.decide(policy_version=3, trainer_version=3, outstanding=1).ok is False  # quota
    ctrl2 = AdmissionController(max_staleness=1, batch_size=1, min_observations=4, clock=clock)
    _trained(ctrl2, clock, steps=3, every=1.0)  # only 3 steps seen
    for _ in range(10):
        ctrl2.observe_episode(100.0)
    assert ctrl2.decide(policy_version=3, trainer_version=3, outstanding=1).ok
    clock.advance(1.0)
    ctrl2.observe_trainer_version(4)  # the fourth step enables the duration rule
    assert not ctrl2.decide(policy_version=4, trainer_version=4, outstanding=1).ok


async def test_wait_returns_when_the_trainer_version_advances() -> None:
    clock = FakeClock()
    ctrl = AdmissionController(max_staleness=0, batch_size=2, clock=clock)
    state = {"p": 0, "t": 0, "outstanding": 2}
    waiter = asyncio.create_task(
        ctrl.wait(
            policy_version=lambda: state["p"],
            trainer_version=lambda: state["t"],
            outstanding=lambda: state["outstanding"],
            poll=60.0,  # only an observation can wake it within the test's timeout
        )
    )
    await settle()
    assert not waiter.done()
    clock.advance(3.0)
    state.update(p=1, t=1, outstanding=0)
    ctrl.observe_trainer_version(1)
    assert await asyncio.wait_for(waiter, 2) == 3.0
    assert ctrl.statistics()["admitted"] == 1 and ctrl.statistics()["waited_seconds"] == 3.0


def test_admission_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        AdmissionController(max_staleness=1, batch_size=0)
    with pytest.raises(ConfigError, match="quantile"):
        AdmissionController(max_staleness=1, batch_size=1, quantile=0.0)
    with pytest.raises(ConfigError, match="max_staleness"):
        AdmissionController(max_staleness=-1, batch_size=1)


# -- property: random interleavings ----------------------------------------------------


class BufferMachine(RuleBasedStateMachine):
    """A model of what must hold whatever the interleaving: nothing lost, nothing handed
    out twice unless its lease expired, groups whole, the bound respected under drop."""

    @initialize(
        capacity=st.integers(3, 12),
        k=st.sampled_from([None, 0, 1, 2]),
        on_stale=st.sampled_from(["drop", "keep"]),
        group_size=st.integers(1, 3),
    )
    def setup(self, capacity: int, k: int | None, on_stale: str, group_size: int) -> None:
        self.clock = FakeClock()
        self.k = k
        self.on_stale = on_stale
        self.group_size = group_size
        self.dropped: set[str] = set()
        self.buf = TrajectoryBuffer(
            BufferConfig(
                capacity=capacity,
                max_staleness=k,
                on_stale=on_stale,  # type: ignore[arg-type]
                group_size=group_size,
                lease_ttl=10.0,
            ),
            clock=self.clock,
            on_drop=self._dropped,
        )
        self.members: dict[str, set[str]] = {}  # group id -> trajectory ids
        self.group_of: dict[str, str] = {}
        self.put_ids: set[str] = set()
        self.acked: set[str] = set()
        self.handed: set[str] = set()
        self.leases: dict[str, tuple[float, set[str]]] = {}  # open leases of the model
        self.next_id = 0

    def _dropped(self, trajs: list[Trajectory]) -> None:
        if self.k is not None:  # only a group that breaks the bound is dropped
            low = min(v for t in trajs if (v := t.min_policy_version()) >= 0)
            assert self.buf.statistics().trainer_version - low > self.k
        assert self.on_stale == "drop"
        self.dropped.update(ids(trajs))

    def _held(self) -> set[str]:
        return self.put_ids - self.acked - self.dropped

    def _expire_model(self) -> int:
        gone = [lid for lid, (exp, _) in self.leases.items() if self.clock() >= exp]
        for lid in gone:
            del self.leases[lid]
        return len(gone)

    @rule(versions=st.lists(st.integers(-1, 6), min_size=3, max_size=3))
    def put(self, versions: list[int]) -> None:
        gid = f"g{self.next_id}"
        self.next_id += 1
        group_ = [
            traj(f"{gid}.{i}", () if v < 0 else (v,), gid)
            for i, v in enumerate(versions[: self.group_size])
        ]
        fits = len(self.buf) + self.group_size <= self.buf.config.capacity
        assert self.buf.try_put(group_) == fits
        if fits:
            self.members[gid] = set(ids(group_))
            self.group_of.update(dict.fromkeys(ids(group_), gid))
            self.put_ids.update(ids(group_))

    @rule(max_trajectories=st.integers(1, 7), bump=st.integers(0, 2))
    def lease(self, max_trajectories: int, bump: int) -> None:
        self._expire_model()
        version = self.buf.statistics().trainer_version + bump
        lease = self.buf.try_lease(max_trajectories, trainer_version=version)
        if lease is None:
            return
        got = ids(lease.trajectories)
        open_ids = set().union(*(s for _, s in self.leases.values()))
        assert not set(got) & open_ids, "handed out twice without its lease expiring"
        assert set(got) <= self._held()
        gids = {self.group_of[i] for i in got}
        for gid in gids:  # whole: every held member of each group is in this lease
            assert self.members[gid] & self._held() <= set(got)
        assert len(got) <= max_trajectories or len(gids) == 1
        if self.k is not None and self.on_stale == "drop":
            for t in lease.trajectories:
                low = t.min_policy_version()
                assert low < 0 or lease.trainer_version - low <= self.k
        self.handed.update(got)
        self.leases[lease.id] = (lease.expires_at, set(got))
        # FIFO by put order: this lease's groups in order, and every group still queued
        # was put after all of them
        nums = [int(self.group_of[i][1:]) for i in got]
        assert nums == sorted(nums)
        queued = self._held() - set().union(*(s for _, s in self.leases.values()))
        assert all(int(self.group_of[i][1:]) > nums[-1] for i in queued)

    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        pool = sorted(self.handed | {"unknown"} | set(list(self.put_ids)[:3]))
        chosen = data.draw(st.lists(st.sampled_from(pool), max_size=6))
        expected = set(chosen) & self.handed & self._held()
        assert self.buf.ack(chosen) == len(expected)
        self.acked |= expected
        for lid, (_, open_ids) in list(self.leases.items()):
            open_ids -= expected
            if not open_ids:  # a fully acknowledged lease is closed: it cannot expire
                del self.leases[lid]

    @rule(dt=st.sampled_from([0.0, 3.0, 10.0]))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule()
    def expire(self) -> None:
        assert self.buf.expire() == self._expire_model()

    @rule(step=st.integers(0, 2))
    def trainer_steps(self, step: int) -> None:
        self.buf.set_trainer_version(self.buf.statistics().trainer_version + step)

    @invariant()
    def nothing_lost(self) -> None:
        stats = self.buf.statistics()
        assert not (self.acked & self.dropped)
        assert len(self.buf) == len(self._held()) == stats.queued + stats.leased
        assert stats.put == len(self.put_ids)
        assert (stats.acked, stats.dropped_stale) == (len(self.acked), len(self.dropped))
        assert len(self.buf) <= self.buf.config.capacity

    def teardown(self) -> None:
        if not hasattr(self, "buf"):
            return
        self.clock.advance(1000.0)  # every lease expires: everything held is offered again
        while (lease := self.buf.try_lease(100)) is not None:
            self.acked.update(ids(lease.trajectories))
            assert self.buf.ack(ids(lease.trajectories)) == len(lease.trajectories)
        assert len(self.buf) == 0
        assert self.put_ids == self.acked | self.dropped  # every put trajectory accounted for


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
