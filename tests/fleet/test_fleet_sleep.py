"""A fleet's sleep and wake, with replicas in this process and in Ray actors: calls in flight
survive, the update installed at wake reaches every replica, a refused one changes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.errors import BackendError, WeightSyncError
from agentroll.fleet import FleetBackend
from agentroll.testing import SyntheticTrainer
from agentroll.validate.common import collect_stream, start_streams

KINDS = ["local", pytest.param("ray", marks=pytest.mark.ray)]
ENGINE = {"kv_cache_mb": 4, "max_num_seqs": 16}
# long enough that a sleep issued after 8 tokens finds the calls still running, even when
# a loaded machine delays the sleep's round trip to a Ray replica
MAX_TOKENS = 128


def _request(i: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{i}",
        prompt_ids=[5, 6, 7, 8 + i],
        sampling=SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i),
        episode_id=f"e{i}",
    )


@pytest.mark.parametrize("kind", KINDS)
async def test_fleet_sleeps_and_wakes_with_the_next_version(
    kind: str, make_replicas: Any, tiny_model: Path
) -> None:
    update = SyntheticTrainer(tiny_model).step()
    replicas = await make_replicas(kind, 2, tiny_model, **ENGINE)
    async with FleetBackend(replicas) as fleet:
        tasks = await start_streams(fleet, [_request(i) for i in range(4)], 8)
        report = await fleet.sleep(2)
        assert fleet.asleep == 2 and report.freed_bytes > 0 and report.parked >= 1
        with pytest.raises(BackendError, match="sleeps already"):
            await fleet.sleep(1)
        wake = await fleet.wake(update)
        assert wake.updated and not wake.failed and fleet.policy_version == update.version
        assert all(r.version == update.version for r in replicas)
        results = await asyncio.gather(*tasks)
    for ids, _, versions in results:
        assert len(ids) == MAX_TOKENS
        assert all(kv <= pv for pv, kv in versions)
    # every request parked by the sleep samples again after it: on the new weights
    on_new = sum(versions[-1][0] == update.version for _, _, versions in results)
    assert on_new >= report.parked


async def test_a_refused_update_at_wake_leaves_the_fleet_asleep(
    make_replicas: Any, tiny_model: Path
) -> None:
    trainer = SyntheticTrainer(tiny_model)
    trainer.step()
    second = trainer.step()  # based on version 1: the replicas are at 0
    replicas = await make_replicas("local", 2, tiny_model, **ENGINE)
    async with FleetBackend(replicas) as fleet:
        await fleet.sleep(1)
        with pytest.raises(WeightSyncError, match="no replica took"):
            await fleet.wake(second)
        assert fleet.asleep == 1
        await fleet.wake()
        ids, _, _ = await collect_stream(fleet, _request(0))
        assert len(ids) == MAX_TOKENS and fleet.policy_version == 0


async def test_the_fleets_sleep_policy_reaches_its_replicas(
    make_replicas: Any, tiny_model: Path
) -> None:
    replicas = await make_replicas("local", 2, tiny_model, **ENGINE)
    async with FleetBackend(replicas) as fleet:
        tasks = await start_streams(fleet, [_request(i) for i in range(4)], 8)
        report = await fleet.sleep(1, policy="recompute")
        # recompute: nothing of the parked requests' KV is kept on the host
        assert report.parked >= 1 and report.kept_bytes == 0
        await fleet.wake()
        results = await asyncio.gather(*tasks)
    assert all(len(ids) == MAX_TOKENS for ids, _, _ in results)
