"""Paired measurement on synthetic inputs: the median ratio and its range for odd and even
pair counts, a zero baseline, the A B A B order of the measures, and the minimum count."""

from __future__ import annotations

import math

import pytest

from agentroll.bench.pairs import (
    MIN_PAIRS,
    PairedRatio,
    alternate,
    alternate_async,
    check_pairs,
    median_side,
    pair_ratios,
    paired_ratio,
)
from agentroll.errors import ConfigError


def test_odd_count_takes_the_middle_ratio() -> None:
    # ratios 2, 4, 1, 3, 5: median 3, even though neither side's median ratio is 3
    pairs = [(2.0, 1.0), (8.0, 2.0), (1.0, 1.0), (9.0, 3.0), (5.0, 1.0)]
    assert pair_ratios(pairs) == [2.0, 4.0, 1.0, 3.0, 5.0]
    assert paired_ratio(pairs) == PairedRatio(ratio=3.0, ratio_min=1.0, ratio_max=5.0, pairs=5)


def test_even_count_takes_the_mean_of_the_middle_two() -> None:
    pairs = [(1.0, 1.0), (6.0, 2.0), (2.0, 1.0), (10.0, 2.0), (4.0, 1.0), (12.0, 2.0)]
    r = paired_ratio(pairs)  # ratios 1, 3, 2, 5, 4, 6
    assert (r.ratio, r.ratio_min, r.ratio_max, r.pairs) == (3.5, 1.0, 6.0, 6)


def test_drift_shared_by_both_sides_cancels() -> None:
    # the machine slows down 10x over the run; the subject is always twice the baseline
    pairs = [(2.0 / (1 + i), 1.0 / (1 + i)) for i in range(9)]
    r = paired_ratio(pairs)
    assert r.ratio == pytest.approx(2.0)
    assert r.ratio_min == pytest.approx(2.0) and r.ratio_max == pytest.approx(2.0)


def test_a_zero_baseline_is_an_infinite_ratio_not_an_exception() -> None:
    pairs = [(2.0, 1.0), (3.0, 0.0), (2.0, 1.0), (2.0, 1.0), (2.0, 1.0)]
    r = paired_ratio(pairs)
    assert r.ratio == 2.0 and r.ratio_min == 2.0 and r.ratio_max == math.inf and r.pairs == 5
    # both sides zero: no ratio at all, and the summary says so instead of a made-up median
    nothing = paired_ratio([(0.0, 0.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0)])
    assert math.isnan(nothing.ratio) and math.isnan(nothing.ratio_min)
    assert math.isnan(nothing.ratio_max) and nothing.pairs == 5


def test_no_pairs_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        paired_ratio([])


def test_fields_are_the_three_appended_keys_in_order() -> None:
    r = PairedRatio(ratio=3.0, ratio_min=1.0, ratio_max=5.0, pairs=5)
    assert list(r.fields().items()) == [("pairs", 5), ("ratio_min", 1.0), ("ratio_max", 5.0)]


def test_median_side() -> None:
    assert median_side([3.0, 1.0, 2.0]) == 2.0
    assert median_side([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert math.isnan(median_side([]))


@pytest.mark.parametrize("n", [5, 6])
def test_alternate_runs_a_b_a_b(n: int) -> None:
    calls: list[str] = []

    def a(i: int) -> float:
        calls.append(f"a{i}")
        return float(i)

    def b(i: int) -> str:
        calls.append(f"b{i}")
        return f"b{i}"

    out = alternate(a, b, n)
    assert calls == [f"{side}{i}" for i in range(n) for side in "ab"]
    assert out == [(float(i), f"b{i}") for i in range(n)]


async def test_alternate_async_awaits_each_side_before_the_next() -> None:
    calls: list[str] = []
    running = 0

    async def measure(tag: str, i: int) -> int:
        nonlocal running
        running += 1
        assert running == 1, "the two sides overlapped"
        calls.append(f"{tag}{i}")
        running -= 1
        return i

    out = await alternate_async(lambda i: measure("a", i), lambda i: measure("b", i), MIN_PAIRS)
    assert calls == [f"{side}{i}" for i in range(MIN_PAIRS) for side in "ab"]
    assert out == [(i, i) for i in range(MIN_PAIRS)]


def test_an_exception_ends_the_run() -> None:
    calls: list[int] = []

    def b(i: int) -> int:
        if i == 2:
            raise RuntimeError("broken baseline")
        return i

    with pytest.raises(RuntimeError, match="broken baseline"):
        alternate(lambda i: calls.append(i) or i, b, 5)
    assert calls == [0, 1, 2]


def test_fewer_than_five_pairs_is_a_config_error() -> None:
    assert check_pairs(5) == 5 and check_pairs(9) == 9
    with pytest.raises(ConfigError, match="--pairs must be >= 5"):
        check_pairs(4)
    with pytest.raises(ConfigError, match="--repeats must be >= 5"):
        check_pairs(2, "--repeats")
