"""The pure Router on synthetic inputs: least-loaded routing, affinity, pinning, statuses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentroll.fleet.router import ReplicaStatus, Router

STATUSES: tuple[ReplicaStatus, ...] = ("active", "draining", "updating", "failed", "down")


def make_router(*names: str, slack: int = 2, version: int = 0) -> Router:
    router = Router(affinity_slack=slack)
    for name in names:
        router.add(name, version)
    return router


def load(router: Router, name: str, n: int, episode: str = "other") -> None:
    for _ in range(n):
        router.started(episode, name)


def test_least_loaded_relative_to_capacity() -> None:
    router = Router()
    router.add("big", 0, capacity=8)
    router.add("small", 0, capacity=2)
    load(router, "big", 3)  # 3/8
    load(router, "small", 1)  # 1/2
    assert router.pick("e") == "big"  # fewer calls would pick "small"; capacity decides
    load(router, "big", 2)  # 5/8 > 1/2
    assert router.pick("e") == "small"


def test_ties_are_broken_by_name_not_insertion_order() -> None:
    router = make_router("r2", "r0", "r1")
    assert router.pick("e") == "r0"
    load(router, "r0", 1)
    assert router.pick("e") == "r1"
    load(router, "r1", 1)
    assert router.pick("e") == "r2"


def test_affinity_sticks_within_slack_then_moves() -> None:
    router = make_router("a", "b", slack=2)
    router.started("e", "b")  # the episode's previous call ran on b (b: 1, a: 0)
    router.finished("b")
    assert router.pick("e") == "b"  # equal load: b keeps its prefix KV
    load(router, "b", 2)  # b is exactly slack above a
    assert router.pick("e") == "b"
    load(router, "b", 1)  # now slack + 1 above
    assert router.pick("e") == "a"
    assert router.pick("fresh") == "a"  # an episode without history goes least-loaded


def test_affinity_ignores_a_last_replica_that_may_not_serve() -> None:
    router = make_router("a", "b", slack=100)
    router.started("e", "b")
    router.set_status("b", "draining")
    assert router.pick("e") == "a"
    assert router.pick("e", exclude={"a"}) is None
    router.set_status("b", "active")
    assert router.pick("e", exclude={"b"}) == "a"


def test_zero_slack_is_plain_least_loaded() -> None:
    router = make_router("a", "b", slack=0)
    router.started("e", "b")
    assert router.pick("e") == "a"  # b carries 1 call, a none


def test_pinned_episode_goes_only_to_its_version() -> None:
    router = make_router("old", slack=0)
    router.add("new", 1)
    load(router, "old", 5)
    router.pin("e", 0)
    router.pin("e", 1)  # the first pin holds
    assert router.pinned_version("e") == 0
    assert router.pick("e") == "old"  # although "new" is idle
    assert router.pick("unpinned") == "new"
    router.set_status("old", "draining")
    assert router.pick("e") is None  # its version has no active replica: wait
    assert router.pinned_at(0) == 1 and router.pinned_at(1) == 0
    router.unpin("e")
    assert router.pick("e") == "new"


def test_prefer_newest_picks_the_newest_active_version() -> None:
    router = make_router("a", "b")
    router.add("c", 2)
    load(router, "c", 10)
    assert router.pick("e", prefer_newest=True) == "c"
    assert router.pick("e") == "a"
    router.set_status("c", "updating")  # newest among *active* replicas
    assert {s.name for s in router.candidates("e", prefer_newest=True)} == {"a", "b"}
    router.pin("p", 0)  # a pinned episode keeps its version
    router.set_status("c", "active")
    assert router.pick("p", prefer_newest=True) == "a"


@pytest.mark.parametrize("status", ["draining", "updating", "failed", "down"])
def test_only_active_replicas_take_calls(status: ReplicaStatus) -> None:
    router = make_router("a", "b")
    load(router, "b", 50)
    router.set_status("a", status)
    assert router.pick("e") == "b"
    router.set_status("b", status)
    assert router.pick("e") is None
    assert router.active() == []
    assert router.versions() == set()
    assert router.versions((status,)) == {0}


def test_down_is_final_failed_is_not() -> None:
    router = make_router("a")
    router.set_status("a", "failed")
    router.set_status("a", "active")
    router.set_status("a", "down")
    router.set_status("a", "down")  # idempotent
    statuses: tuple[ReplicaStatus, ...] = ("active", "draining", "updating", "failed")
    for status in statuses:
        with pytest.raises(ValueError, match="down"):
            router.set_status("a", status)
    assert router.pick("e") is None


def test_forget_drops_affinity_and_pin() -> None:
    router = make_router("a", "b", slack=5)
    router.started("e", "b")
    router.pin("e", 0)
    router.forget("e")
    router.forget("never-seen")  # no error
    assert router.pinned_version("e") is None and router.pinned_at(0) == 0
    assert router.pick("e") == "a"  # no affinity left: least loaded
    assert "e" not in router._last and "e" not in router._pins  # no growth over a long run


def test_loads_never_go_negative() -> None:
    router = make_router("a", "b")
    router.finished("a")
    router.finished("a")
    assert router.slots["a"].load == 0
    router.started("e", "a")
    router.finished("a")
    router.finished("a")
    assert router.slots["a"].load == 0
    assert router.pick("x") == "a"


def test_versions_follow_set_version() -> None:
    router = make_router("a", "b")
    router.set_version("a", 3)
    assert router.versions() == {0, 3}
    assert router.pick("e", prefer_newest=True) == "a"


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="affinity_slack"):
        Router(affinity_slack=-1)
    router = make_router("a")
    with pytest.raises(ValueError, match="already registered"):
        router.add("a", 0)
    with pytest.raises(ValueError, match="capacity"):
        router.add("b", 0, capacity=0)


# -- property: pick never returns an ineligible replica --------------------------------------

NAMES = ["r0", "r1", "r2", "r3"]
EPISODES = ["e0", "e1", "e2"]

op = st.one_of(
    st.tuples(st.just("status"), st.sampled_from(NAMES), st.sampled_from(STATUSES)),
    st.tuples(st.just("version"), st.sampled_from(NAMES), st.integers(0, 3)),
    st.tuples(st.just("pin"), st.sampled_from(EPISODES), st.integers(0, 3)),
    st.tuples(st.just("start"), st.sampled_from(EPISODES), st.sampled_from(NAMES)),
    st.tuples(st.just("finish"), st.sampled_from(NAMES), st.just(0)),
    st.tuples(st.just("forget"), st.sampled_from(EPISODES), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(
    capacities=st.lists(st.integers(1, 4), min_size=1, max_size=len(NAMES)),
    slack=st.integers(0, 3),
    ops=st.lists(op, max_size=40),
    episode=st.sampled_from(EPISODES),
    exclude=st.sets(st.sampled_from(NAMES), max_size=2),
    prefer_newest=st.booleans(),
)
def test_pick_never_returns_an_ineligible_replica(
    capacities: list[int],
    slack: int,
    ops: list[tuple[str, str, object]],
    episode: str,
    exclude: set[str],
    prefer_newest: bool,
) -> None:
    router = Router(affinity_slack=slack)
    names = NAMES[: len(capacities)]
    for name, cap in zip(names, capacities, strict=True):
        router.add(name, 0, capacity=cap)
    for kind, a, b in ops:
        if kind != "pin" and kind not in ("start", "forget") and a not in router.slots:
            continue
        if kind == "status":
            if router.slots[a].status == "down" and b != "down":
                with pytest.raises(ValueError):
                    router.set_status(a, b)  # type: ignore[arg-type]
            else:
                router.set_status(a, b)  # type: ignore[arg-type]
        elif kind == "version":
            router.set_version(a, int(b))  # type: ignore[call-overload]
        elif kind == "pin":
            router.pin(a, int(b))  # type: ignore[call-overload]
        elif kind == "start" and b in router.slots:
            router.started(a, str(b))
        elif kind == "finish":
            router.finished(a)
        elif kind == "forget":
            router.forget(a)
        assert all(s.load >= 0 for s in router.slots.values())

    pin = router.pinned_version(episode)
    eligible = [
        s
        for s in router.slots.values()
        if s.status == "active" and s.name not in exclude and (pin is None or s.version == pin)
    ]
    if prefer_newest and pin is None and eligible:
        newest = max(s.version for s in eligible)
        eligible = [s for s in eligible if s.version == newest]

    got = router.pick(episode, exclude, prefer_newest=prefer_newest)
    if not eligible:
        assert got is None
        return
    assert got in {s.name for s in eligible}
    slot = router.slots[got]
    best = min(eligible, key=lambda s: (s.load / s.capacity, s.load, s.name))
    if got != best.name:  # only affinity may override least-loaded, and only within slack
        assert router._last.get(episode) == got
        assert slot.load <= best.load + slack


def test_a_groups_episodes_start_on_one_replica_within_the_group_slack() -> None:
    r = Router(group_slack=3)
    r.add("a", 0)
    r.add("b", 0)
    first = r.pick("e0", group_id="g")
    assert first == "a"
    r.started("e0", first, group_id="g")
    for i in range(1, 4):  # the group's samples follow, though b is idle
        name = r.pick(f"e{i}", group_id="g")
        assert name == "a"
        r.started(f"e{i}", name, group_id="g")
    assert r.pick("e4", group_id="g") == "b"  # a is 4 above b: the slack is spent
    assert r.pick("x", group_id="other") == "b"  # another group goes to the least loaded
    r.set_status("a", "draining")
    assert r.pick("e5", group_id="g") == "b"  # only active replicas take calls


def test_group_memory_is_bounded() -> None:
    from agentroll.fleet.router import MAX_GROUPS

    r = Router()
    r.add("a", 0)
    for i in range(MAX_GROUPS + 10):
        r.started(f"e{i}", "a", group_id=f"g{i}")
        r.forget(f"e{i}")
        r.finished("a")
    assert len(r._groups) == MAX_GROUPS and "g0" not in r._groups
    r.remove("a")
    assert not r._groups
