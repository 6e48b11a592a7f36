"""RayReplica against the real engine in a Ray actor: the same tokens as in-process, weight
updates, migration of a request with its KV across processes, and a dying actor."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agentroll.backends.base import GenerationChunk, GenerationRequest, SamplingParams
from agentroll.errors import ConfigError, MissingDependencyError, WeightSyncError
from agentroll.fleet.ray import RayReplica
from agentroll.fleet.replica import ReplicaDown
from agentroll.testing import SyntheticTrainer

pytestmark = pytest.mark.ray

PROMPT = [5, 6, 7, 8, 9]


def request(rid: str, *, temperature: float = 1.0, max_tokens: int = 16) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        prompt_ids=PROMPT,
        sampling=SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=11, ignore_eos=True
        ),
    )


async def collect(
    stream: AsyncIterator[GenerationChunk],
) -> tuple[list[int], list[float], list[int]]:
    """Token ids, logprobs and the policy version of every token."""
    ids: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    async for chunk in stream:
        assert chunk.rollback == 0
        ids += chunk.token_ids
        lps += chunk.logprobs
        versions += [chunk.policy_version] * len(chunk.token_ids)
    return ids, lps, versions


def test_without_ray_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    with pytest.raises(MissingDependencyError, match=r"pip install 'agentroll\[ray\]'"):
        RayReplica("model")


async def test_start_needs_a_connected_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    replica = RayReplica("model")
    with pytest.raises(ConfigError, match=r"ray\.init\(\)"):
        await replica.start()
    assert replica.actor is None


def test_the_cluster_is_bound_to_loopback(ray_cluster: Any) -> None:
    assert {node["NodeManagerAddress"] for node in ray_cluster.nodes()} == {"127.0.0.1"}


async def test_streams_equal_a_local_replica(make_replicas: Any, tiny_model: Path) -> None:
    (remote,), (local,) = await asyncio.gather(
        make_replicas("ray", 1, tiny_model), make_replicas("local", 1, tiny_model)
    )
    assert remote.supports_snapshots and remote.version == 0
    busy = await remote.busy_seconds()
    for temperature in (0.0, 1.0):  # greedy, then sampled with a seed
        req = request(f"t{temperature}", temperature=temperature, max_tokens=24)
        got = await collect(remote.generate(req))
        want = await collect(local.generate(req))
        assert got == want and len(got[0]) == 24 and set(got[2]) == {0}
        assert await remote.busy_seconds() > busy
        busy = await remote.busy_seconds()
    assert await remote.inflight() == {}


async def test_pause_apply_resume_then_stage_and_swap(make_replicas: Any, tiny_model: Path) -> None:
    (remote,) = await make_replicas("ray", 1, tiny_model)
    trainer = SyntheticTrainer(tiny_model, fraction=0.05)
    first, second = trainer.step(), trainer.step()

    async def update_midway(update: Any) -> list[int]:
        """The policy version of each token of a stream that gets ``update`` after its
        4th token; read until 4 tokens of the new version came."""
        old = remote.version
        stream: Any = remote.generate(request(f"v{old}", max_tokens=4000))
        versions: list[int] = []
        async for chunk in stream:
            versions += [chunk.policy_version] * len(chunk.token_ids)
            if len(versions) >= 4 and remote.version == old:
                await update(old)
                assert remote.version == old + 1
            if versions.count(old + 1) >= 4:
                break
        await stream.aclose()
        return versions

    async def pause_apply_resume(old: int) -> None:
        await remote.pause()
        assert await remote.apply(first) == 1
        with pytest.raises(WeightSyncError):  # the actor's error type reaches the caller
            await remote.apply(first)  # its base version is no longer the replica's
        await remote.resume()

    async def stage_swap(old: int) -> None:
        await remote.stage(second)  # while generating
        assert await remote.swap() == 2

    versions = await update_midway(pause_apply_resume)
    assert versions[0] == 0 and versions == sorted(versions) and versions[-1] == 1
    with pytest.raises(WeightSyncError, match="MiB"):  # refused: over the memory bound
        await remote.stage(second, max_bytes=1)
    versions = await update_midway(stage_swap)
    assert versions[0] == 1 and versions == sorted(versions) and versions[-1] == 2
    # the closed streams were aborted in the actor (before this request was added)
    assert len((await collect(remote.generate(request("n", max_tokens=4))))[0]) == 4
    assert await remote.inflight() == {}


async def test_snapshots_migrate_between_processes(make_replicas: Any, tiny_model: Path) -> None:
    """A request snapshotted on the Ray replica continues on a local one, and back on the
    Ray one, token for token as if never interrupted."""
    # batch invariance: "m" shares its batch with "o" on the Ray replica, not on the local one
    (remote,), (local,) = await asyncio.gather(
        make_replicas("ray", 1, tiny_model, batch_invariant=True),
        make_replicas("local", 1, tiny_model, batch_invariant=True),
    )
    req = request("m", max_tokens=96)  # still running when the pause lands
    want = await collect(local.generate(req))

    other: Any = remote.generate(request("o", max_tokens=96))
    await anext(other)  # a second request in flight, for snapshot_many
    ids: list[int] = []
    lps: list[float] = []
    stream: Any = remote.generate(req)
    async for chunk in stream:
        ids += chunk.token_ids
        lps += chunk.logprobs
        if len(ids) >= 8:
            break
    await remote.pause()
    snap = await remote.snapshot("m")
    many = await remote.snapshot_many(["m", "unknown", "o"])
    await stream.aclose()  # migrated away: the actor drops the requests
    await other.aclose()
    assert snap.k is not None and snap.num_generated >= len(ids)  # the KV crossed processes
    assert sorted(many) == ["m", "o"] and many["m"].token_ids == snap.token_ids
    assert torch.equal(many["m"].k, snap.k) and torch.equal(many["m"].v, snap.v)
    for t in (many["m"].k, many["m"].v, many["o"].k):  # no views of both requests' KV
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()

    part = snap.truncated(len(ids))  # the consumer had fewer tokens than the engine made
    rest = await collect(local.restore(part))
    assert (ids + rest[0], lps + rest[1]) == (want[0], want[1])
    await remote.resume()
    assert await collect(remote.restore(part)) == rest  # and back into the actor

    # the closed stream left nothing behind
    assert len((await collect(remote.generate(request("n", max_tokens=4))))[0]) == 4
    assert await remote.inflight() == {}


async def test_a_dead_actor_fails_streams_and_calls(
    make_replicas: Any, tiny_model: Path, ray_cluster: Any
) -> None:
    killed, died = await make_replicas("ray", 2, tiny_model)

    def die() -> None:  # died outside our control: only Ray tells
        ray_cluster.kill(died.actor, no_restart=True)

    for remote, kill in ((killed, killed.kill), (died, die)):
        n = 0
        t_kill: float | None = None
        with pytest.raises(ReplicaDown):
            async with asyncio.timeout(10):
                async for chunk in remote.generate(request("k", max_tokens=4000)):
                    n += len(chunk.token_ids)
                    if n >= 3 and t_kill is None:
                        t_kill = time.perf_counter()
                        kill()
        assert t_kill is not None and time.perf_counter() - t_kill < 5
        for call in (remote.pause(), remote.inflight(), remote.snapshot("k"), remote.swap()):
            with pytest.raises(ReplicaDown):
                await call
        with pytest.raises(ReplicaDown):
            await collect(remote.generate(request("after")))
        await remote.abort("k")  # nothing to abort on a dead replica: no error
        await remote.close()
        await remote.close()
