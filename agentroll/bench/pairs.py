"""Paired measurement: a subject and its baseline measured alternately, the ratio per pair.

A benchmark that reports a ratio runs ``measure_a`` (the subject) and ``measure_b`` (the
baseline) in the order A B A B ..., one pair at a time, and reports the median of the
per-pair ratios with their min and max: drift of a shared machine hits both sides of a pair
alike and cancels, instead of deciding the result.  Pure apart from calling the measures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from agentroll.errors import ConfigError

A = TypeVar("A")
B = TypeVar("B")

MIN_PAIRS = 5  # fewer pairs give no useful spread (min and max are then near the median)
DEFAULT_PAIRS = 5


def check_pairs(pairs: int, flag: str = "--pairs") -> int:
    """``pairs`` if it is at least ``MIN_PAIRS``; raises ``ConfigError`` otherwise."""
    if pairs < MIN_PAIRS:
        raise ConfigError(
            f"{flag} must be >= {MIN_PAIRS} (got {pairs}): the ratio is a median over "
            "alternating pairs of runs; pass 5 or more"
        )
    return pairs


@dataclass(frozen=True, slots=True)
class PairedRatio:
    """The median of the per-pair ratios, their min and max, and the number of pairs."""

    ratio: float
    ratio_min: float
    ratio_max: float
    pairs: int

    def fields(self) -> dict[str, float | int]:
        """The three keys a result line appends: ``pairs``, ``ratio_min``, ``ratio_max``."""
        return {"pairs": self.pairs, "ratio_min": self.ratio_min, "ratio_max": self.ratio_max}


def _ratio(subject: float, baseline: float) -> float:
    """``subject / baseline``; a zero baseline gives ``inf`` (``nan`` if both are zero), not
    an exception: one broken pair shows in ``ratio_max`` instead of losing the run."""
    if baseline == 0:
        return math.nan if subject == 0 else math.copysign(math.inf, subject)
    return subject / baseline


def pair_ratios(measurements: Sequence[tuple[float, float]]) -> list[float]:
    """``subject / baseline`` of each ``(subject, baseline)`` pair, in order."""
    return [_ratio(a, b) for a, b in measurements]


def paired_ratio(measurements: Sequence[tuple[float, float]]) -> PairedRatio:
    """Median, min and max of the ratios ``subject / baseline`` over ``(subject, baseline)``
    pairs.  For an even count the median is the mean of the middle two.  A ``nan`` ratio
    (both sides zero) makes all three ``nan``.  Raises ``ValueError`` for no pairs."""
    if not measurements:
        raise ValueError("paired_ratio needs at least one (subject, baseline) pair")
    ratios = pair_ratios(measurements)
    if any(math.isnan(r) for r in ratios):
        return PairedRatio(math.nan, math.nan, math.nan, len(ratios))
    return PairedRatio(statistics.median(ratios), min(ratios), max(ratios), len(ratios))


def median_side(values: Sequence[float]) -> float:
    """The median of one side's figures over the pairs (``nan`` for none)."""
    return statistics.median(values) if values else math.nan


def alternate(
    measure_a: Callable[[int], A], measure_b: Callable[[int], B], pairs: int
) -> list[tuple[A, B]]:
    """Call ``measure_a(i)`` then ``measure_b(i)`` for ``i`` in ``range(pairs)`` (A B A B
    ...) and return the ``(a, b)`` results per pair.  An exception of a measure ends the run
    (it propagates)."""
    out: list[tuple[A, B]] = []
    for i in range(pairs):
        a = measure_a(i)
        out.append((a, measure_b(i)))
    return out


async def alternate_async(
    measure_a: Callable[[int], Awaitable[A]],
    measure_b: Callable[[int], Awaitable[B]],
    pairs: int,
) -> list[tuple[A, B]]:
    """``alternate`` for coroutine measures: each is awaited before the next starts, so the
    two sides never overlap.  Cancellation propagates from the measure in flight."""
    out: list[tuple[A, B]] = []
    for i in range(pairs):
        a = await measure_a(i)
        out.append((a, await measure_b(i)))
    return out


__all__ = [
    "DEFAULT_PAIRS",
    "MIN_PAIRS",
    "PairedRatio",
    "alternate",
    "alternate_async",
    "check_pairs",
    "median_side",
    "pair_ratios",
    "paired_ratio",
]
