"""The provenance and rolling_versions checks: their expectation logic on synthetic
timelines, and the checks themselves on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentroll.validate.fleet import _expected, check_provenance, check_rolling_versions


def test_expected_versions_follow_the_sync_timeline() -> None:
    versions = [0, 1, 2]
    # submitted in epoch 0; sync 0 found 3 tokens generated (KV computed), sync 1 found 5
    at_sync = [{"r": (3, 10)}, {"r": (5, 12)}]
    pol, kv = _expected("r", 7, 0, at_sync, versions)
    assert pol == [0, 0, 0, 1, 1, 2, 2]
    assert kv == 0  # keep: the KV of the prompt stays the oldest


def test_expected_kv_moves_when_prefill_had_not_started() -> None:
    at_sync = [{"r": (0, 0)}, {}]  # queued but not prefilled at sync 0, finished before sync 1
    pol, kv = _expected("r", 4, 0, at_sync, [0, 1, 2])
    assert pol == [1, 1, 1, 1] and kv == 1


def test_expected_for_a_request_submitted_after_syncs() -> None:
    pol, kv = _expected("r", 2, 2, [{}, {}], [0, 1, 2])
    assert pol == [2, 2] and kv == 2


@pytest.mark.slow
async def test_provenance_check_passes(tiny_model: Path) -> None:
    result = await check_provenance(tiny_model)
    assert result.passed, result.line()
    assert result.figures["turns_across_a_sync"] > 0


@pytest.mark.slow
async def test_rolling_versions_check_passes(tiny_model: Path) -> None:
    result = await check_rolling_versions(tiny_model)
    assert result.passed, result.line()
