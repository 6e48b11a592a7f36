"""Episode checkpoints (agentroll.rollout.checkpoint): the on-disk form and its refusals, then
episodes checkpointed mid-generation and mid-tool-call, torn down and continued by a fresh
backend and engine, finishing exactly as uninterrupted runs do."""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import agentroll.rollout.episode_loop as rollout_module
from agentroll.backends.base import GenerationChunk, GenerationRequest, SamplingParams
from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.engine.snapshot import RequestSnapshot
from agentroll.env import Environment, Rubric, tool
from agentroll.errors import CheckpointError
from agentroll.rollout.builder import TrajectoryBuilder
from agentroll.rollout.checkpoint import EpisodeCheckpoint, load_checkpoints, load_jobs, save_jobs
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.sandbox.base import SandboxConfig
from agentroll.types import Message, Task, ToolCall, ToolResult, Trajectory, Turn
from agentroll.validate.checkpoint import (
    CheckpointProbe,
    ProbeBackend,
    is_mid_generation,
    probe_config,
    same_trajectory,
    turn_lengths,
)

# -- the on-disk form --------------------------------------------------------------------------


def synthetic(phase: Any = "generating") -> EpisodeCheckpoint:
    b = TrajectoryBuilder()
    b.add_context([1, 2, 3])
    b.add_sampled([4, 5], [-0.5, -0.25], 2, 1)
    b.add_context([6])
    b.add_sampled([7], [-1.5], 3, 3)
    params = SamplingParams(max_tokens=9, seed=42, stop_token_ids=(5,))
    snap = RequestSnapshot(
        request_id="e-1",
        token_ids=[1, 2, 3, 4, 5, 6, 7],
        num_prompt_tokens=6,
        num_computed_tokens=6,
        kv_version=3,
        min_kv_version=1,
        params=params,
        seed=42,
        logprobs=[-1.5],
        block_size=4,
        model_fingerprint="fp",
        k=torch.randn(2, 2, 4, 1, 8),
        v=torch.randn(2, 2, 4, 1, 8),
    )
    call = ToolCall(id="c0", name="work", arguments={"n": 1})
    return EpisodeCheckpoint(
        task=Task(id="t", data={"prompt": "p", "nested": {"x": [1, 2]}}, answer=3),
        episode_id="e",
        group_id="g",
        sample_index=1,
        seed=11,
        env_name="probe",
        env_version="2",
        env_state={"calls": 2},
        state_data={"seen": [1, 2]},
        phase=phase,
        next_turn=1,
        format_errors=1,
        prompt_len=3,
        started_at=123.5,
        token_ids=b.token_ids.tobytes(),
        logprobs=b.logprobs.tobytes(),
        loss_mask=b.mask.tobytes(),
        policy_version=b.policy.tobytes(),
        kv_version=b.kv.tobytes(),
        turns=[
            Turn(
                index=0,
                gen_start=3,
                gen_end=5,
                env_end=6,
                finish_reason="stop",
                tool_calls=[call],
                tool_results=[ToolResult(call_id="c0", name="work", content="ok")],
            )
        ],
        messages=[Message(role="user", content="p"), Message(role="assistant", tool_calls=[call])],
        request_id="e-1" if phase == "generating" else "",
        gen_start=6 if phase == "generating" else 0,
        sampling=params if phase == "generating" else None,
        restarted_turns=2,
        sandbox=b"a tar archive",
        pending=snap if phase == "generating" else None,
    )


def test_save_load_round_trip(tmp_path: Path) -> None:
    cp = synthetic()
    path = cp.save(tmp_path / "e")
    names = sorted(p.name for p in path.iterdir())
    assert names == ["episode.msgpack", "job.msgpack", "request", "sandbox.tar"]
    back = EpisodeCheckpoint.load(path)
    plain = ("pending", "sandbox")
    for field in EpisodeCheckpoint.__struct_fields__:
        if field not in plain:
            assert getattr(back, field) == getattr(cp, field), field
    assert back.sandbox == cp.sandbox
    assert cp.pending is not None and back.pending is not None
    assert msgspec.structs.replace(back.pending, k=None, v=None) == msgspec.structs.replace(
        cp.pending, k=None, v=None
    )
    assert torch.equal(back.pending.k, cp.pending.k) and torch.equal(back.pending.v, cp.pending.v)
    b = back.builder()
    assert b.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and b.mask.tolist() == [
        0,
        0,
        0,
        1,
        1,
        0,
        1,
    ]
    assert b.policy.tolist() == [-1, -1, -1, 2, 2, -1, 3] and b.logprobs[6] == -1.5
    # saving again replaces the directory atomically, and leaves no temp directory behind
    msgspec.structs.replace(cp, phase="turn", pending=None, sandbox=None).save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]
    assert EpisodeCheckpoint.load(path).phase == "turn" and not (path / "request").exists()


def test_load_checkpoints_orders_by_episode_and_skips_temp_dirs(tmp_path: Path) -> None:
    for name in ("b", "a"):
        msgspec.structs.replace(synthetic("turn"), episode_id=name).save(tmp_path / name)
    (tmp_path / ".c.tmp123").mkdir()  # a save that a crash interrupted
    (tmp_path / ".c.tmp123" / "episode.msgpack").write_bytes(b"partial")
    assert [cp.episode_id for cp in load_checkpoints(tmp_path)] == ["a", "b"]
    assert load_checkpoints(tmp_path / "missing") == []


def _damage(path: Path, how: str) -> None:
    if how == "garbage":
        (path / "episode.msgpack").write_bytes(b"\x93not a checkpoint")
    elif how == "truncated":
        data = (path / "episode.msgpack").read_bytes()
        (path / "episode.msgpack").write_bytes(data[: len(data) // 2])
    elif how == "no_request":
        for f in (path / "request").iterdir():
            f.unlink()
        (path / "request").rmdir()
    elif how == "request_meta":
        (path / "request" / "meta.msgpack").write_bytes(b"\x00\x01")
    elif how == "request_k":  # something where k is written as nil (the KV is separate)
        meta = msgspec.msgpack.decode((path / "request" / "meta.msgpack").read_bytes())
        meta["k"] = 1
        (path / "request" / "meta.msgpack").write_bytes(msgspec.msgpack.encode(meta))
    elif how == "request_kv":
        (path / "request" / "kv.safetensors").unlink()
    elif how == "ragged":
        cp = EpisodeCheckpoint.load(path)
        msgspec.structs.replace(cp, logprobs=cp.logprobs[:-4]).save(path)
    elif how == "format":
        cp = EpisodeCheckpoint.load(path)
        msgspec.structs.replace(cp, format=99).save(path)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("garbage", r"episode\.msgpack is refused: it has no checkpoint header"),
        ("truncated", r"episode\.msgpack is refused: it has \d+ payload bytes"),
        ("no_request", r"request/\S+ is refused: it cannot be read"),
        ("request_meta", r"request/meta\.msgpack is refused: its xxh3-128 checksum"),
        ("request_k", r"request/meta\.msgpack is refused: its xxh3-128 checksum"),
        ("request_kv", r"request/kv\.safetensors is refused: it cannot be read"),
        ("ragged", "ragged token arrays"),
        ("format", "has format 99"),
    ],
)
def test_damaged_checkpoints_are_refused(tmp_path: Path, how: str, message: str) -> None:
    path = synthetic().save(tmp_path / "e")
    _damage(path, how)
    with pytest.raises(CheckpointError, match=message) as refused:
        EpisodeCheckpoint.load(path)
    assert "restarts this episode from its task" in str(refused.value)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoints(tmp_path)


# -- continuing on the tiny model ------------------------------------------------------------------


def probe_tasks() -> list[Task]:
    return CheckpointProbe().tasks()


async def reference_run(model: Path) -> dict[str, Trajectory]:
    backend = ProbeBackend(model, batch_invariant=True)
    async with backend, RolloutEngine(backend, CheckpointProbe(), probe_config()) as engine:
        return {t.task_id: t async for t in engine.run(probe_tasks())}


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, Trajectory]:
    """The uninterrupted runs of the probe tasks (computed once for this module)."""
    return asyncio.run(reference_run(tiny_model))


async def checkpointed_run(
    model: Path, reference: dict[str, Trajectory], directory: Path, *, with_kv: bool
) -> tuple[list[Trajectory], list[Path], list[str]]:
    """Run the probe tasks; pause when a generation is mid-way while a tool call is held
    open, release the tool call, checkpoint, and tear everything down.  Returns the
    trajectories that finished, the checkpoint paths and the held episode."""
    lengths = turn_lengths(list(reference.values()))
    release, paused = asyncio.Event(), asyncio.Event()
    env = CheckpointProbe(hold=release.wait)
    backend = ProbeBackend(model, batch_invariant=True)

    async def on_chunk(request: GenerationRequest, n: int) -> None:
        if not paused.is_set() and env.held and is_mid_generation(lengths, request, n):
            await engine.pause()  # at this token boundary of this generation
            paused.set()

    backend.on_chunk = on_chunk
    finished: list[Trajectory] = []
    async with backend, RolloutEngine(backend, env, probe_config(concurrency=4)) as engine:

        async def consume() -> None:
            async for t in engine.run(probe_tasks()):
                finished.append(t)

        consumer = asyncio.create_task(consume())
        await paused.wait()
        release.set()  # the held tool call finishes while paused; its result is kept
        paths = await engine.checkpoint(directory, with_kv=with_kv)
        consumer.cancel()
        await asyncio.wait({consumer})
    return finished, paths, env.held


async def continue_run(
    model: Path, directory: Path, *, pause_first: Path | None = None
) -> tuple[list[Trajectory], dict[str, int]]:
    """A fresh backend and engine continue every checkpoint under ``directory``.  With
    ``pause_first``, the engine is paused before anything runs and, once every episode is
    restored, checkpointed again into that directory instead (nothing finishes)."""
    checkpoints = load_checkpoints(directory)
    backend = ProbeBackend(model, batch_invariant=True)
    async with (
        backend,
        RolloutEngine(backend, CheckpointProbe(), probe_config(concurrency=4)) as engine,
    ):
        if pause_first is None:
            trajs = [t async for t in engine.run([], checkpoints=checkpoints)]
            return trajs, dict(engine.stats)
        restored, all_in = 0, asyncio.Event()
        restore = engine._restore_run

        async def counting(run: Any, cp: EpisodeCheckpoint) -> None:
            nonlocal restored
            await restore(run, cp)
            restored += 1
            if restored == len(checkpoints):
                all_in.set()

        engine._restore_run = counting  # type: ignore[method-assign]
        await engine.pause()
        consumer = asyncio.create_task(first(engine.run([], checkpoints=checkpoints)))
        await all_in.wait()
        await engine.checkpoint(pause_first)
        assert not consumer.done()
        consumer.cancel()
        await asyncio.wait({consumer})
        return [], dict(engine.stats)


async def first(trajectories: AsyncIterator[Trajectory]) -> Trajectory:
    return await anext(aiter(trajectories))


def check_against(reference: dict[str, Trajectory], trajs: list[Trajectory]) -> None:
    assert sorted(t.task_id for t in trajs) == sorted(reference)  # each task exactly once
    for t in trajs:
        assert same_trajectory(reference[t.task_id], t), t.task_id


def sandbox_files(blob: bytes | None) -> dict[str, bytes]:
    assert blob is not None
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        return {m.name: f.read() for m in tar.getmembers() if (f := tar.extractfile(m)) is not None}


@pytest.mark.parametrize("with_kv", [True, False])
async def test_checkpoint_mid_generation_and_mid_tool_then_continue_elsewhere(
    tiny_model: Path, tmp_path: Path, reference: dict[str, Trajectory], with_kv: bool
) -> None:
    finished, paths, held = await checkpointed_run(
        tiny_model, reference, tmp_path / "cp", with_kv=with_kv
    )
    cps = {cp.episode_id: cp for cp in load_checkpoints(tmp_path / "cp")}
    assert sorted(p.name for p in paths) == sorted(cps) and len(cps) + len(finished) == 4
    mid_gen = [cp for cp in cps.values() if cp.phase == "generating"]
    assert any(len(cp.builder()) > cp.gen_start for cp in mid_gen)  # tokens of the turn kept
    for cp in mid_gen:
        assert cp.pending is not None
        # the KV of what was computed: a request still waiting for its prefill (an episode
        # that had just sent its next turn when the pause came) has none to save
        assert (cp.pending.k is not None) == (with_kv and cp.pending.num_computed_tokens > 0)
        assert cp.pending.num_generated == len(cp.builder()) - cp.gen_start
    [tool_cp] = [cps[e] for e in held]  # the held call finished before the checkpoint
    assert tool_cp.phase == "turn" and tool_cp.turns[-1].tool_results
    assert tool_cp.env_state == {"calls": len(tool_cp.turns)}
    log = sandbox_files(tool_cp.sandbox)["log.txt"].decode()
    assert len(log.splitlines()) == len(tool_cp.turns)  # the sandbox file made it to disk

    restored, stats = await continue_run(tiny_model, tmp_path / "cp")
    check_against(reference, finished + restored)
    assert stats["restarted_turns"] == 0
    assert all(t.metrics["restarted_turns"] == 0 for t in restored)


async def test_a_restored_episode_checkpointed_again_before_it_runs(
    tiny_model: Path, tmp_path: Path, reference: dict[str, Trajectory]
) -> None:
    finished, _, _ = await checkpointed_run(tiny_model, reference, tmp_path / "a", with_kv=True)
    assert any(cp.phase == "generating" for cp in load_checkpoints(tmp_path / "a"))
    await continue_run(tiny_model, tmp_path / "a", pause_first=tmp_path / "b")
    again = load_checkpoints(tmp_path / "b")
    first = {cp.episode_id: cp for cp in load_checkpoints(tmp_path / "a")}
    for cp in again:  # the pending generation is still pending, with its snapshot
        assert (cp.phase, cp.token_ids, cp.gen_start) == (
            first[cp.episode_id].phase,
            first[cp.episode_id].token_ids,
            first[cp.episode_id].gen_start,
        )
        assert (cp.pending is None) == (first[cp.episode_id].pending is None)
    restored, _ = await continue_run(tiny_model, tmp_path / "b")
    check_against(reference, finished + restored)


# -- a backend without snapshots -------------------------------------------------------------------


class Tools(Environment):
    max_turns = 3

    @tool
    def add(self, a: int, b: int) -> str:
        """Add."""
        return str(a + b)


SCRIPT = [
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "the answer is five, as the tool said",
]


class Gated(MockBackend):
    """Stops each turn-1 request (only the ``nth`` one, counting from 1, when given) after
    its first chunk until ``proceed`` is set."""

    def __init__(self, *args: Any, nth: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arrived, self.proceed = asyncio.Event(), asyncio.Event()
        self.nth, self.seen = nth, 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        gated = False
        if request.turn_index == 1:
            self.seen += 1
            gated = self.nth is None or self.seen == self.nth
        async for chunk in super().generate(request):
            yield chunk
            if gated:
                gated = False
                self.arrived.set()
                await self.proceed.wait()


async def test_without_snapshots_a_mid_generation_checkpoint_regenerates_the_turn(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    cfg = RolloutConfig(progress="off")
    task = Task(id="t", data={"prompt": "2 + 3?"})
    async with RolloutEngine(MockBackend(SCRIPT, tokenizer=tok), Tools(), cfg) as engine:
        [ref] = [t async for t in engine.run([task])]

    backend = Gated(SCRIPT, tokenizer=tok, chunk_size=3)
    async with RolloutEngine(backend, Tools(), cfg) as engine:
        consumer = asyncio.create_task(first(engine.run([task])))
        await backend.arrived.wait()  # three tokens into turn 1
        await engine.pause()
        backend.proceed.set()
        await engine.checkpoint(tmp_path)
        consumer.cancel()
        await asyncio.wait({consumer})
    [cp] = load_checkpoints(tmp_path)
    assert (cp.phase, cp.dropped_generation, cp.next_turn) == ("turn", True, 1)
    assert len(cp.builder()) == ref.turns[1].gen_start  # the partial turn was dropped

    fresh = MockBackend(SCRIPT, tokenizer=tok, record=True)
    async with RolloutEngine(fresh, Tools(), cfg) as engine:
        [got] = [t async for t in engine.run([], checkpoints=[cp])]
        assert engine.stats["restarted_turns"] == 1
    assert got.metrics["restarted_turns"] == 1 and same_trajectory(ref, got)
    assert [r.turn_index for r in fresh.requests] == [1]  # only the dropped turn was redone


# -- a stop while the consumer of run() is behind ---------------------------------------------------


async def test_episodes_finished_but_not_yet_yielded_survive_a_stop(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    """A consumer busy with one trajectory (a slow publish) while the other episodes finish:
    they wait in run()'s queue, are neither live (no checkpoint) nor delivered.  A stop hands
    them back (take_undelivered) and the next run(finished=...) yields them without running
    anything again: every task exactly once, as in an uninterrupted run."""
    tasks = [Task(id=f"t{i}", data={"prompt": f"{i} + 3?"}) for i in range(6)]
    cfg = RolloutConfig(progress="off", concurrency=6)
    async with RolloutEngine(MockBackend(SCRIPT, tokenizer=tok), Tools(), cfg) as engine:
        reference = {t.task_id: t async for t in engine.run(tasks)}

    hold = asyncio.Event()
    got: list[Trajectory] = []

    async def busy_consumer(trajectories: AsyncIterator[Trajectory]) -> None:
        async for t in trajectories:
            got.append(t)
            await hold.wait()

    async with RolloutEngine(MockBackend(SCRIPT, tokenizer=tok), Tools(), cfg) as engine:
        consumer = asyncio.create_task(busy_consumer(engine.run(tasks)))
        async with asyncio.timeout(30):  # no event for "an episode finished": poll
            while engine.stats["episodes"] < len(tasks):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        await engine.pause()
        assert await engine.checkpoint(tmp_path) == []  # nothing is live
        consumer.cancel()
        await asyncio.wait({consumer})
        left = engine.take_undelivered()
        assert engine.take_undelivered() == []
    assert len(got) == 1 and len(left) == len(tasks) - 1
    assert not {t.id for t in got} & {t.id for t in left}

    fresh = MockBackend(SCRIPT, tokenizer=tok, record=True)
    async with RolloutEngine(fresh, Tools(), cfg) as engine:
        again = [t async for t in engine.run([], finished=left)]
    assert fresh.requests == []  # delivered, not run again
    assert sorted(t.task_id for t in got + again) == sorted(reference)
    for t in got + again:
        assert same_trajectory(reference[t.task_id], t), t.task_id


def spread(trajectories: list[Trajectory]) -> list[float]:
    """A group reward that needs every sample: each one's distance from the group's mean
    number of tokens."""
    mean = sum(t.num_tokens for t in trajectories) / len(trajectories)
    return [t.num_tokens - mean for t in trajectories]


class GroupTools(Tools):
    rubric = Rubric(group_funcs=[spread])


async def test_a_group_cut_by_a_stop_is_scored_whole_after_the_restart(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    """With group rewards a finished sample waits in run() for its group; stopped while the
    group's other sample is mid-generation, the finished one is handed back and the next
    run scores it with the continued one: the group's rewards are those of an uninterrupted
    run, and no sample is run twice."""
    tasks = [Task(id=f"t{i}", data={"prompt": f"{i} + 3?"}) for i in range(3)]
    cfg = RolloutConfig(progress="off", concurrency=1, samples_per_task=2)
    chunks = {"chunk_size": 3}
    async with RolloutEngine(MockBackend(SCRIPT, tokenizer=tok, **chunks), GroupTools(), cfg) as e:
        reference = {(t.task_id, t.sample_index): t async for t in e.run(tasks)}

    # one episode at a time: t0 (both samples) finishes, t1's first sample finishes and
    # waits for its group, t1's second sample is held three tokens into its second turn
    backend = Gated(SCRIPT, tokenizer=tok, nth=4, **chunks)  # never let go
    got: list[Trajectory] = []

    async def consume(trajectories: AsyncIterator[Trajectory]) -> None:
        async for t in trajectories:
            got.append(t)

    async with RolloutEngine(backend, GroupTools(), cfg) as engine:
        consumer = asyncio.create_task(consume(engine.run(tasks)))
        await asyncio.wait_for(backend.arrived.wait(), 30)
        await engine.pause()
        assert len(await engine.checkpoint(tmp_path)) == 1  # t1's second sample
        consumer.cancel()
        await asyncio.wait({consumer})
        left = engine.take_undelivered()
    assert sorted((t.task_id, t.sample_index) for t in got) == [("t0", 0), ("t0", 1)]
    assert [(t.task_id, t.sample_index) for t in left] == [("t1", 0)]

    [cp] = load_checkpoints(tmp_path)
    fresh = MockBackend(SCRIPT, tokenizer=tok, record=True, **chunks)
    async with RolloutEngine(fresh, GroupTools(), cfg) as engine:
        again = [t async for t in engine.run(tasks[2:], checkpoints=[cp], finished=left)]
    assert sorted((t.task_id, t.sample_index) for t in again) == [
        ("t1", 0), ("t1", 1), ("t2", 0), ("t2", 1)
    ]  # fmt: skip
    # t1's first sample was not run again: only its second sample's turn and t2's samples
    assert len(fresh.requests) == 1 + 2 * 2
    for t in got + again:
        ref = reference[(t.task_id, t.sample_index)]
        assert same_trajectory(ref, t) and t.rewards == ref.rewards, (t.task_id, t.sample_index)


async def test_a_stop_hands_back_the_samples_of_a_started_group_nobody_ran(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    """One worker and a consumer busy with the group's first sample: the next two wait in
    run()'s queue, the fourth in the worker's put, and the fifth never starts.  A stop hands
    back the three (take_undelivered) and the fifth as an unstarted job (take_unstarted);
    the next run(unstarted=...) runs only that one, and the group is the one an
    uninterrupted run makes.  Without it the group would wait forever for its fifth."""
    task = Task(id="t0", data={"prompt": "0 + 3?"})
    cfg = RolloutConfig(progress="off", concurrency=1, samples_per_task=5)
    async with RolloutEngine(MockBackend(SCRIPT, tokenizer=tok), Tools(), cfg) as engine:
        reference = {t.sample_index: t async for t in engine.run([task])}

    got: list[Trajectory] = []
    hold = asyncio.Event()

    async def busy_consumer(trajectories: AsyncIterator[Trajectory]) -> None:
        async for t in trajectories:
            got.append(t)
            await hold.wait()

    async with RolloutEngine(MockBackend(SCRIPT, tokenizer=tok), Tools(), cfg) as engine:
        consumer = asyncio.create_task(busy_consumer(engine.run([task])))
        async with asyncio.timeout(30):
            while engine.stats["episodes"] < 4:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the worker is held in its put: the fifth never starts
        assert engine.stats["episodes"] == 4 and not engine._live
        await engine.pause()
        assert await engine.checkpoint(tmp_path) == []
        consumer.cancel()
        await asyncio.wait({consumer})
        left, jobs = engine.take_undelivered(), engine.take_unstarted()
        assert engine.take_unstarted() == []
    assert [t.sample_index for t in got] == [0]
    assert sorted(t.sample_index for t in left) == [1, 2, 3]
    assert [(j.task.id, j.sample_index, j.group_id) for j in jobs] == [("t0", 4, got[0].group_id)]

    save_jobs(tmp_path / "unstarted.msgpack", jobs)  # through the on-disk form
    jobs = load_jobs(tmp_path / "unstarted.msgpack")
    fresh = MockBackend(SCRIPT, tokenizer=tok, record=True)
    async with RolloutEngine(fresh, Tools(), cfg) as engine:
        again = [t async for t in engine.run([], finished=left, unstarted=jobs)]
    assert sorted(t.sample_index for t in again) == [1, 2, 3, 4]
    [fifth] = [t for t in again if t.sample_index == 4]
    assert fresh.requests and {r.episode_id for r in fresh.requests} == {fifth.id}
    assert {t.group_id for t in got + again} == {got[0].group_id}
    for t in got + again:
        assert same_trajectory(reference[t.sample_index], t), t.sample_index


async def test_a_sample_started_after_the_stops_checkpoint_is_handed_back(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    """A group admitted while the engine is paused for a stop, after its checkpoint was
    written: its first sample starts (and waits at the turn gate), the checkpoint does not
    have it, and leaving the loop cancels it.  Both samples are handed back as unstarted,
    and a restart with admission control does not admit them a second time."""
    cfg = RolloutConfig(progress="off", concurrency=1, samples_per_task=2)
    admitted = asyncio.Event()
    release = asyncio.Event()

    async def admit(n: int) -> None:
        await release.wait()
        admitted.set()

    async def consume(trajectories: AsyncIterator[Trajectory]) -> None:
        async for _ in trajectories:
            raise AssertionError("nothing can finish while paused")

    task = Task(id="t0", data={"prompt": "0 + 3?"})
    async with RolloutEngine(MockBackend(SCRIPT, tokenizer=tok), Tools(), cfg) as engine:
        consumer = asyncio.create_task(consume(engine.run([task], admit=admit)))
        await engine.pause()
        assert await engine.checkpoint(tmp_path) == []
        release.set()
        await asyncio.wait_for(admitted.wait(), 30)
        await asyncio.sleep(0.05)
        assert len(engine._live) == 1  # started after the checkpoint, held at the gate
        consumer.cancel()
        await asyncio.wait({consumer})
        assert engine.take_undelivered() == []
        jobs = engine.take_unstarted()
    assert sorted(j.sample_index for j in jobs) == [0, 1]

    calls: list[int] = []

    async def counting(n: int) -> None:
        calls.append(n)

    async with RolloutEngine(MockBackend(SCRIPT, tokenizer=tok), Tools(), cfg) as engine:
        got = [t async for t in engine.run([], unstarted=jobs, admit=counting)]
    assert sorted(t.sample_index for t in got) == [0, 1] and calls == []
    assert {t.group_id for t in got} == {jobs[0].group_id}


class SandboxedTools(Tools):
    sandbox_config = SandboxConfig(timeout=5.0)


async def test_an_episode_closing_its_sandbox_at_a_stop_is_handed_back_finished(
    tok: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An episode that has finished and is closing its sandbox is neither at a quiescent
    point nor handed over yet: the stop's checkpoint waits for the close, so the episode
    reaches the consumer or take_undelivered instead of being cancelled in its close (which
    lost it, and stranded the rest of its group)."""
    closing, let_go = asyncio.Event(), asyncio.Event()
    real_open = rollout_module.open_sandbox

    def slow_close(config: SandboxConfig, **kwargs: Any) -> Any:
        sandbox = real_open(config, **kwargs)
        real_close = sandbox.close

        async def close() -> None:
            closing.set()
            await let_go.wait()
            await real_close()

        sandbox.close = close  # type: ignore[method-assign]
        return sandbox

    monkeypatch.setattr(rollout_module, "open_sandbox", slow_close)
    got: list[Trajectory] = []

    async def consume(trajectories: AsyncIterator[Trajectory]) -> None:
        async for t in trajectories:
            got.append(t)

    task = Task(id="t0", data={"prompt": "0 + 3?"})
    cfg = RolloutConfig(progress="off", concurrency=1)
    async with RolloutEngine(MockBackend(SCRIPT, tokenizer=tok), SandboxedTools(), cfg) as engine:
        consumer = asyncio.create_task(consume(engine.run([task])))
        await asyncio.wait_for(closing.wait(), 30)

        async def stop() -> list[Path]:
            await engine.pause()
            return await engine.checkpoint(tmp_path)

        stopping = asyncio.create_task(stop())
        await asyncio.sleep(0.1)
        waited = not stopping.done()  # for the close
        let_go.set()
        assert waited, "the checkpoint did not wait for the episode closing its sandbox"
        assert await asyncio.wait_for(stopping, 30) == []
        consumer.cancel()
        await asyncio.wait({consumer})
        left = engine.take_undelivered()
        assert engine.take_unstarted() == []
    assert [t.task_id for t in got + left] == ["t0"] and (got + left)[0].status == "ok"


def test_unstarted_jobs_that_cannot_be_read_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "unstarted.msgpack"
    path.write_bytes(b"\x91\x01")  # an unframed list (what older versions wrote)
    with pytest.raises(CheckpointError, match=r"unstarted\.msgpack is refused: .*no checkpoint"):
        load_jobs(path)


async def test_a_checkpoint_of_another_environment_fails_its_episode(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    cp = msgspec.structs.replace(synthetic("turn"), env_name="someone_else")
    async with RolloutEngine(
        MockBackend(["x"], tokenizer=tok), Tools(), RolloutConfig(progress="off")
    ) as engine:
        [t] = [t async for t in engine.run([], checkpoints=[cp])]
    assert t.status == "failed" and "environment 'someone_else'" in (t.error or "")


async def test_a_turn_cut_by_the_token_budget_keeps_its_stop_reason_across_a_restore(
    tiny_model: Path, tmp_path: Path
) -> None:
    class Budget(Environment):
        max_turns = 2
        max_total_tokens = 60  # the first turn is cut by this budget, not by max_tokens

    cfg = RolloutConfig(progress="off", sampling=SamplingParams(max_tokens=64))
    task = Task(id="t", data={"prompt": "hello"})

    async def run(tasks: list[Task], checkpoints: list[EpisodeCheckpoint]) -> Trajectory:
        backend = ProbeBackend(tiny_model, batch_invariant=True)
        async with backend, RolloutEngine(backend, Budget(), cfg) as engine:
            [traj] = [t async for t in engine.run(tasks, checkpoints=checkpoints)]
        return traj

    ref = await run([task], [])
    assert ref.stop_reason == "token_budget" and ref.num_tokens == 60

    backend = ProbeBackend(tiny_model, batch_invariant=True)
    paused = asyncio.Event()

    async def on_chunk(request: GenerationRequest, n: int) -> None:
        if n >= 5 and not paused.is_set():
            await engine.pause()
            paused.set()

    backend.on_chunk = on_chunk
    async with backend, RolloutEngine(backend, Budget(), cfg) as engine:
        consumer = asyncio.create_task(first(engine.run([task])))
        await paused.wait()
        await engine.checkpoint(tmp_path)
        consumer.cancel()
        await asyncio.wait({consumer})
    [cp] = load_checkpoints(tmp_path)
    assert cp.phase == "generating"
    assert same_trajectory(ref, await run([], [cp]))
