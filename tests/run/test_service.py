"""The recipe worker: served groups within the staleness bound, syncs mid-generation with
``keep`` (nothing restarted), and a stop/start that loses and repeats nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentroll.rollout.engine import RolloutEngine
from agentroll.run.build import cycle_tasks
from agentroll.run.metrics import read_trace
from agentroll.run.recipe import Recipe, parse_recipe
from agentroll.run.service import RolloutService
from agentroll.stream.client import StreamClient, StreamError
from agentroll.stream.server import TrajectoryStream
from agentroll.testing import SyntheticTrainer
from agentroll.types import Task, Trajectory

HEAD = """
[run]
seed = 3
[environment]
name = "calculator"
kwargs = { num_tasks = 32, max_operand = 20 }
[buffer]
max_staleness = 1
capacity = 64
"""


def test_cycle_tasks_repeats_each_epoch_in_a_new_order() -> None:
    tasks = [Task(id=str(i)) for i in range(10)]
    it = cycle_tasks(tasks, seed=1)
    first = [next(it).id for _ in range(10)]
    second = [next(it).id for _ in range(10)]
    assert sorted(first) == sorted(second) == sorted(t.id for t in tasks)
    assert first != second


def test_a_damaged_checkpoint_stops_the_start_with_what_to_do(tmp_path: Path) -> None:
    """A checkpoint left by the last stop that is refused and whose sample cannot be read
    either (no intact job.msgpack) cannot be restarted, and its group would wait for it
    forever: the start fails with a ConfigError naming it and the way out.  (A refused
    checkpoint whose sample is known restarts: tests/security/test_checkpoint_integrity.py.)"""
    from agentroll.errors import ConfigError

    damaged = tmp_path / "checkpoints" / "episode-1"
    damaged.mkdir(parents=True)
    (damaged / "episode.msgpack").write_bytes(b"\x93not a checkpoint")
    service = RolloutService(parse_recipe(HEAD), model_dir=tmp_path, run_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"episode-1.*task is unknown.*move \S+episode-1 out"):
        service._load_stopped()


async def test_what_a_stop_saved_stays_until_published_and_is_not_published_twice(
    tmp_path: Path,
) -> None:
    """FINISHED and UNSTARTED (what a stop saved beside the checkpoints) are read at the
    start and kept until every group they hold is published, so a kill before then loses
    none of them; what a killed run had published already (pending in the spool) is
    neither delivered nor run again at the next start."""
    from types import SimpleNamespace

    import msgspec

    from agentroll.bench.stream import synthetic_trajectory
    from agentroll.errors import ConfigError
    from agentroll.rollout.checkpoint import EpisodeJob, save_finished, save_jobs
    from agentroll.run.service import FINISHED, UNSTARTED

    def member(group: str, index: int) -> Trajectory:
        t = synthetic_trajectory(hash((group, index)) % 1000, 64, turns=2)
        return msgspec.structs.replace(t, id=f"{group}-{index}", group_id=group, sample_index=index)

    def job(group: str, index: int) -> EpisodeJob:
        return EpisodeJob(task=Task(id=group), sample_index=index, group_id=group)

    recipe = parse_recipe(HEAD + "[rollout]\nsamples_per_task = 2\n")
    service = RolloutService(recipe, model_dir=tmp_path, run_dir=tmp_path)
    cp_dir = tmp_path / "checkpoints"
    # the stop saved "a" and "b" (finished first samples) and their second samples, unstarted
    cp_dir.mkdir()
    save_finished(cp_dir / FINISHED, [member("a", 0), member("b", 0)])
    jobs = [job("a", 1), job("b", 1)]
    save_jobs(cp_dir / UNSTARTED, jobs)
    # the next run published group "a" and was killed before it removed the files
    async with TrajectoryStream(service.spool_dir, service.stream_config) as stream:
        await stream.publish([member("a", 0), member("a", 1)])

    checkpoints, stopped, loaded = service._load_stopped()
    assert [t.id for t in stopped] == ["a-0", "b-0"] and loaded == jobs
    assert service._restored == 4 and (cp_dir / FINISHED).exists()
    async with TrajectoryStream(service.spool_dir, service.stream_config) as stream:
        service.stream = stream
        # a checkpoint of group "a" the killed run continued and published but did not remove
        leftover: Any = SimpleNamespace(episode_id="a-1", group_id="a")  # what it reads
        (cp_dir / "a-1").mkdir()
        checkpoints, stopped, loaded = service._skip_published(
            [*checkpoints, leftover], stopped, loaded
        )
        assert checkpoints == [] and not (cp_dir / "a-1").exists()
        assert [t.id for t in stopped] == ["b-0"] and loaded == [job("b", 1)]
        assert service._restored == 2 and service._stop_groups == {"b"}
        # the engine hands over whole groups only (run_groups): the files stay until then
        assert (cp_dir / FINISHED).exists() and (cp_dir / UNSTARTED).exists()
        await service._publish([member("b", 0), member("b", 1)])  # the last group saved
        assert not (cp_dir / FINISHED).exists() and not (cp_dir / UNSTARTED).exists()

    (cp_dir / UNSTARTED).write_bytes(b"\xc1")
    with pytest.raises(ConfigError, match=r"unstarted\.msgpack.*move what is damaged out of"):
        service._load_stopped()


async def _serve(recipe: Recipe, model: Path, run_dir: Path) -> tuple[Any, asyncio.Event, str]:
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    service = RolloutService(recipe, model_dir=model, run_dir=run_dir)
    task = asyncio.create_task(service.serve(stop, ready=ready.set_result))
    url = await asyncio.wait_for(asyncio.shield(ready), 60)
    return task, stop, url


@pytest.mark.slow
async def test_serve_sync_stop_and_continue(
    tiny_model: Path, tmp_path: Path, small_fleet_toml: str
) -> None:
    recipe = parse_recipe(HEAD + small_fleet_toml)
    trainer = SyntheticTrainer(tiny_model, fraction=0.01, seed=0)
    seen: dict[str, Trajectory] = {}

    task, stop, url = await _serve(recipe, tiny_model, tmp_path)
    async with StreamClient(url, run_dir=tmp_path) as client:
        for _ in range(3):
            batch = await client.lease(8, wait=30, trainer_version=trainer.version)
            assert batch is not None and len(batch.trajectories) % 2 == 0
            for t in batch.trajectories:
                assert t.id not in seen
                # the bound: trainer version - oldest sampled token's version <= 1
                assert trainer.version - t.min_policy_version() <= 1
                seen[t.id] = t
            await client.ack(t.id for t in batch.trajectories)
            await client.push_weights(trainer.step())
        # one more lease, left unacknowledged: it must come back after the restart
        held = await client.lease(8, wait=30, trainer_version=trainer.version)
        assert held is not None
    stop.set()
    summary = await asyncio.wait_for(task, 60)
    assert summary["syncs"] == 3
    # every episode in flight at the stop is a checkpoint directory the restart continues
    cp_dir = tmp_path / "checkpoints"
    written = [p for p in cp_dir.iterdir() if p.is_dir()] if cp_dir.is_dir() else []
    assert summary["checkpointed"] == len(written)

    trace = read_trace(tmp_path)
    syncs = trace.syncs
    assert [s.version for s in syncs] == [1, 2, 3]
    assert all(s.episodes_restarted == 0 for s in syncs)
    assert any(s.mid_generation > 0 for s in syncs)  # episodes were generating at a sync
    new_tokens = [t for t in seen.values() if t.policy_version.max() >= 1]
    assert new_tokens, "no trajectory sampled tokens with the pushed weights"

    # Restart on the same run directory: the unacknowledged lease and the checkpointed
    # episodes come back; nothing already acknowledged is offered again.
    held_ids = {t.id for t in held.trajectories}
    task, stop, url = await _serve(recipe, tiny_model, tmp_path)
    got: set[str] = set()
    async with StreamClient(url, run_dir=tmp_path) as client:  # the token the start kept
        # the restarted worker serves the checkpoint's weights: the trainer reports the
        # version the worker has (its own is refused until it pushes weights again)
        served = (await client.status())["policy_version"]
        assert served == 0 and trainer.version == 3
        with pytest.raises(StreamError, match="409"):
            await client.lease(16, trainer_version=trainer.version)
        while not held_ids <= got:
            batch = await client.lease(16, wait=30, trainer_version=served)
            assert batch is not None
            ids = {t.id for t in batch.trajectories}
            assert not ids & set(seen), "an acknowledged trajectory was offered again"
            got |= ids
            await client.ack(ids)
    stop.set()
    await asyncio.wait_for(task, 60)


@pytest.mark.slow
async def test_on_policy_mode_never_hands_out_or_drops_stale_data(
    tiny_model: Path, tmp_path: Path, small_fleet_toml: str
) -> None:
    """max_staleness = 0: generation waits for each new version (fully synchronous)."""
    recipe = parse_recipe(HEAD.replace("max_staleness = 1", "max_staleness = 0") + small_fleet_toml)
    trainer = SyntheticTrainer(tiny_model, fraction=0.01, seed=1)
    task, stop, url = await _serve(recipe, tiny_model, tmp_path)
    try:
        async with StreamClient(url, run_dir=tmp_path) as client:
            for _ in range(3):
                got: list[Trajectory] = []
                while len(got) < 8:
                    batch = await client.lease(
                        8 - len(got), wait=30, trainer_version=trainer.version
                    )
                    assert batch is not None
                    got += batch.trajectories
                # every sampled token of every trajectory came from the trainer's version
                for t in got:
                    sampled = t.policy_version[t.loss_mask.astype(bool)]
                    assert set(sampled.tolist()) == {trainer.version}
                await client.ack(t.id for t in got)
                await client.push_weights(trainer.step())
            status = await client.status()
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert status["stream"]["dropped_stale"] == 0


@pytest.mark.slow
async def test_a_stop_while_the_producer_is_held_loses_no_finished_episode(
    tiny_model: Path, tmp_path: Path, small_fleet_toml: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Episodes that finish while the worker's producer is held in a publish (back-pressure,
    a slow disk) wait inside the rollout engine, neither live nor published: a stop saves
    them beside the checkpoints and the next start delivers them.  None is lost."""
    recipe = parse_recipe(HEAD + small_fleet_toml)
    finished: set[str] = set()
    real_episode = RolloutEngine.run_episode

    async def run_episode(self: RolloutEngine, *args: Any, **kwargs: Any) -> Any:
        outcome = await real_episode(self, *args, **kwargs)
        finished.add(outcome.trajectory.id)
        return outcome

    real_publish = TrajectoryStream.publish
    held = asyncio.Event()

    async def publish(self: TrajectoryStream, group: Any) -> None:
        await real_publish(self, group)  # durable and offered, then the producer is held
        held.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(RolloutEngine, "run_episode", run_episode)
    monkeypatch.setattr(TrajectoryStream, "publish", publish)
    task, stop, url = await _serve(recipe, tiny_model, tmp_path)
    await asyncio.wait_for(held.wait(), 60)
    async with asyncio.timeout(60):  # more groups finish and wait in the engine
        while len(finished) < 8:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(task, 60)
    before_stop = set(finished)

    monkeypatch.setattr(TrajectoryStream, "publish", real_publish)
    task, stop, url = await _serve(recipe, tiny_model, tmp_path)
    got: set[str] = set()
    try:
        async with StreamClient(url, run_dir=tmp_path) as client, asyncio.timeout(120):
            while not before_stop <= got:
                batch = await client.lease(16, wait=30)
                assert batch is not None, f"never delivered: {sorted(before_stop - got)}"
                got |= {t.id for t in batch.trajectories}
                await client.ack(t.id for t in batch.trajectories)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
