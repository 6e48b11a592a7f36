"""Version epochs of the vLLM backends (pure logic)."""

from __future__ import annotations

from agentroll.backends._vllm_common import Epochs


def test_keep_and_recompute_open_epochs_at_the_cut() -> None:
    e = Epochs(0)
    e.cutoff = 5
    e.resume(1, "keep")
    e.cutoff = 9
    e.resume(2, "recompute")
    assert [e.versions(i) for i in (0, 4, 5, 8, 9, 20)] == [
        (0, 0), (0, 0), (1, 0), (1, 0), (2, 2), (2, 2)
    ]  # fmt: skip
    assert e.policy_spans(12) == [(0, 0, 5), (1, 5, 9), (2, 9, 12)]
    assert e.policy_spans(7) == [(0, 0, 5), (1, 5, 7)]


def test_split_cuts_chunks_where_versions_change_and_finishes_the_last() -> None:
    e = Epochs(0)
    e.cutoff = 2
    e.resume(1, "keep")
    chunks = e.split(0, [10, 11, 12, 13], [-1.0, -2.0, -3.0, -4.0], "length")
    assert [(c.token_ids, c.policy_version, c.kv_version) for c in chunks] == [
        ([10, 11], 0, 0),
        ([12, 13], 1, 0),
    ]
    assert [c.finish_reason for c in chunks] == [None, "length"]
    (empty,) = e.split(4, [], [], "stop")
    assert empty.token_ids == [] and empty.finish_reason == "stop"


def test_nothing_computed_yet_starts_on_the_new_weights() -> None:
    e = Epochs(0)
    e.cutoff = 0
    e.resume(3, "keep")
    assert e.versions(0) == (3, 3) and e.policy_spans(4) == [(3, 0, 4)]


def test_restart_resets_and_rolls_back_what_was_delivered() -> None:
    e = Epochs(0)
    e.cutoff = 4
    e.resume(1, "keep")
    (chunk,) = e.restart(1, 6)
    assert chunk.rollback == 6 and (chunk.policy_version, chunk.kv_version) == (1, 1)
    assert e.epochs == [(0, 1, 1)] and e.restart(1, 0) == []


def test_an_update_without_a_version_change_keeps_one_span() -> None:
    e = Epochs(2)
    e.cutoff = 3
    e.resume(2, "keep")  # same weights: no new epoch
    assert e.epochs == [(0, 2, 2)] and e.policy_spans(5) == [(2, 0, 5)]
