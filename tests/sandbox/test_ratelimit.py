"""Pure pieces of the docker sandbox: the creation rate limit and the reaper's verdict."""

from __future__ import annotations

import pytest

from agentroll.sandbox._ratelimit import (
    LABEL_CREATED,
    LABEL_OWNER,
    LABEL_TTL,
    TokenBucket,
    reap_reason,
)


def test_bucket_allows_a_burst_then_the_rate() -> None:
    bucket = TokenBucket(rate=10, burst=3, now=0.0)
    waits = [bucket.reserve(0.0) for _ in range(6)]
    assert waits[:3] == [0.0, 0.0, 0.0]
    assert waits[3:] == pytest.approx([0.1, 0.2, 0.3])


def test_bucket_refills_over_time_up_to_the_burst() -> None:
    bucket = TokenBucket(rate=2, burst=2, now=0.0)
    assert bucket.reserve(0.0) == 0.0
    assert bucket.reserve(0.0) == 0.0
    assert bucket.reserve(0.5) == 0.0  # one token came back
    assert bucket.reserve(100.0) == 0.0
    assert bucket.reserve(100.0) == 0.0
    assert bucket.reserve(100.0) == pytest.approx(0.5)  # not more than the burst saved up


def test_bucket_ignores_a_clock_stepping_back() -> None:
    bucket = TokenBucket(rate=1, burst=1, now=10.0)
    assert bucket.reserve(10.0) == 0.0
    assert bucket.reserve(5.0) == pytest.approx(1.0)


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 1), (1, 0)])
def test_bucket_refuses_nonsense(rate: float, burst: int) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst, 0.0)


def labels(owner: str = "h:10:555", created: float = 100.0, ttl: float = 60.0) -> dict[str, str]:
    return {LABEL_OWNER: owner, LABEL_CREATED: str(created), LABEL_TTL: str(ttl)}


def alive(pid: int, ticks: str) -> bool:
    return (pid, ticks) == (10, "555")


def test_reaper_keeps_live_owners_within_ttl() -> None:
    assert reap_reason(labels(), now=150.0, host="h", owner_alive=alive) is None


def test_reaper_removes_past_ttl_whoever_owns_it() -> None:
    why = reap_reason(labels(owner="other:1:1"), now=161.0, host="h", owner_alive=alive)
    assert why is not None and "TTL" in why


def test_reaper_removes_containers_of_dead_owners_on_this_host_only() -> None:
    dead = labels(owner="h:10:999")  # pid reused by another process: different start time
    assert "gone" in (reap_reason(dead, now=150.0, host="h", owner_alive=alive) or "")
    elsewhere = labels(owner="g:10:999")
    assert reap_reason(elsewhere, now=150.0, host="h", owner_alive=alive) is None


@pytest.mark.parametrize(
    "bad",
    [
        {LABEL_CREATED: "soon", LABEL_TTL: "1"},
        {LABEL_OWNER: "h:notapid:1"},
        {LABEL_OWNER: "garbage"},
        {},
    ],
)
def test_reaper_keeps_what_it_cannot_read(bad: dict[str, str]) -> None:
    assert reap_reason(bad, now=1e12, host="h", owner_alive=lambda p, t: False) is None


def test_ttl_zero_means_none() -> None:
    assert reap_reason(labels(ttl=0), now=1e12, host="h", owner_alive=alive) is None
