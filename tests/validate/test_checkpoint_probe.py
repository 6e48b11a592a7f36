"""The checkpoint check's probe: a stop set fitted to a trained model."""

from __future__ import annotations


def test_a_fitted_stop_set_ends_each_first_turn_inside_the_window() -> None:
    """Seeded sampling makes a turn identical up to its first stop id: the fitted set
    ends the given sequences where the checkpoint check can pause them mid-way."""
    from agentroll.validate.checkpoint import _first, fit_stop_ids

    frequent = [1, 2, 3, 1, 2, 3]  # a trained model's favourites, early everywhere
    seqs = [
        frequent * 4 + [50, 51] + frequent * 6,
        frequent * 5 + [60] + frequent * 5,
        frequent * 10,  # nothing rare in its window: no stop can be given to it
    ]
    stops = fit_stop_ids(seqs, window=(20, 56))
    assert 1 not in stops and 2 not in stops and 3 not in stops
    assert 20 <= _first(seqs[0], list(stops)) < 56 and 20 <= _first(seqs[1], list(stops)) < 56
