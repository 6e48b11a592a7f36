"""Replicas join and leave a running fleet: a new one starts at the fleet's version (a full
update), a leaving one hands its calls on with their KV (none restarts, none is lost), in
this process and in Ray actors."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.errors import BackendError, ConfigError, WeightSyncError
from agentroll.fleet import FleetBackend
from agentroll.testing import SyntheticTrainer
from agentroll.validate.common import collect_stream, start_streams

KINDS = ["local", pytest.param("ray", marks=pytest.mark.ray)]
ENGINE = {"kv_cache_mb": 4, "max_num_seqs": 16}


# long enough that calls seen in flight on a leaving replica are still running when its
# removal snapshots them, even when a loaded machine slows the round trip to Ray
def _request(i: int, tokens: int = 128) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{i}",
        prompt_ids=[5, 6, 7, 8 + i],
        sampling=SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=i),
        episode_id=f"e{i}",
    )


async def _reference(make_replicas: Any, model: Path, n: int) -> list[list[int]]:
    (solo,) = await make_replicas("local", 1, model, **ENGINE)
    async with FleetBackend([solo]) as fleet:
        return [(await collect_stream(fleet, _request(i)))[0] for i in range(n)]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_leaving_replicas_calls_move_with_their_kv_and_nothing_restarts(
    kind: str, make_replicas: Any, tiny_model: Path
) -> None:
    expected = await _reference(make_replicas, tiny_model, 6)
    replicas = await make_replicas(kind, 2, tiny_model, **ENGINE)
    async with FleetBackend(replicas) as fleet:
        tasks = await start_streams(fleet, [_request(i) for i in range(6)], 12)
        leaving = replicas[1].name
        assert fleet.calls_on(leaving), "the test needs calls in flight on the leaving replica"
        await fleet.remove_replica(leaving)
        assert leaving not in fleet.replicas and leaving not in fleet.router.slots
        results = await asyncio.gather(*tasks)
        assert fleet.stats.migrated >= 1
        assert fleet.stats.episodes_restarted == 0 and fleet.stats.tokens_discarded == 0
    # counter-based sampling: a moved call continues exactly as if it had stayed
    assert [ids for ids, _, _ in results] == expected


@pytest.mark.parametrize("kind", KINDS)
async def test_a_joining_replica_starts_at_the_fleets_version(
    kind: str, make_replicas: Any, tiny_model: Path
) -> None:
    trainer = SyntheticTrainer(tiny_model)
    (first,) = await make_replicas("local", 1, tiny_model, **ENGINE)
    async with FleetBackend([first]) as fleet:
        await fleet.update(trainer.step())
        await fleet.update(trainer.step())
        (fresh,) = await make_replicas(kind, 1, tiny_model, **ENGINE)  # at version 0
        with pytest.raises(WeightSyncError, match="pass the fleet's weights"):
            await fleet.add_replica(fresh)
        assert fresh.name not in fleet.replicas
        (fresh,) = await make_replicas(kind, 1, tiny_model, **ENGINE)
        stale = trainer.exporter.full()
        trainer.step()  # the trainer moved on: a full update at 3 is not the fleet's 2
        with pytest.raises(WeightSyncError, match="the fleet serves 2"):
            await fleet.add_replica(fresh, trainer.exporter.full())
        (fresh,) = await make_replicas(kind, 1, tiny_model, **ENGINE)
        assert await fleet.add_replica(fresh, stale) == 2
        assert fleet.router.slots[fresh.name].status == "active"
        with pytest.raises(ConfigError, match="already in the fleet"):
            await fleet.add_replica(fresh, stale)
        # the newcomer serves, and takes the next delta like the others
        nxt = trainer.exporter.update_for(2)
        assert nxt is not None and nxt.base_version == 2
        await fleet.update(nxt)
        assert {r.version for r in fleet.replicas.values()} == {3}
        await fleet.remove_replica(first.name)
        ids, _, versions = await collect_stream(fleet, _request(0, 8))
        assert len(ids) == 8 and {pv for pv, _ in versions} == {3}


async def test_membership_changes_are_refused_when_they_cannot_hold(
    make_replicas: Any, tiny_model: Path
) -> None:
    replicas = await make_replicas("local", 2, tiny_model, **ENGINE)
    async with FleetBackend(replicas) as fleet:
        with pytest.raises(ConfigError, match="no replica 'nope'"):
            await fleet.remove_replica("nope")
        await fleet.remove_replica(replicas[0].name)
        with pytest.raises(ConfigError, match="last one in rotation"):
            await fleet.remove_replica(replicas[1].name)
        await fleet.sleep(1)
        (extra,) = await make_replicas("local", 1, tiny_model, **ENGINE)
        with pytest.raises(BackendError, match="asleep"):
            await fleet.add_replica(extra)
        await fleet.wake()
        ids, _, _ = await collect_stream(fleet, _request(1, 8))
        assert len(ids) == 8
