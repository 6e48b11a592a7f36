"""Checkpoint integrity (issue 30): every checkpoint file is framed with an xxh3-128
checksum, so a flipped bit, a cut or an unframed (older) file anywhere in a checkpoint is
refused with that file named, never loaded as other token ids, logprobs or versions; a
resume restarts exactly the episode whose checkpoint was refused, from its task and under
its id, and continues the others from their checkpoints unchanged."""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from agentroll.backends.base import SamplingParams
from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.engine.snapshot import RequestSnapshot
from agentroll.env import Environment, EpisodeState, tool
from agentroll.errors import CheckpointError, ConfigError
from agentroll.rollout.builder import TrajectoryBuilder
from agentroll.rollout.checkpoint import (
    EpisodeCheckpoint,
    EpisodeJob,
    load_checkpoints,
    load_finished,
    load_jobs,
    save_finished,
    save_jobs,
    scan_checkpoints,
    unframe,
)
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.run.recipe import parse_recipe
from agentroll.run.service import UNSTARTED, RolloutService
from agentroll.run.worker import read_trajectories, run_worker
from agentroll.types import Task, Trajectory
from agentroll.validate.checkpoint import same_trajectory

# -- every file of a checkpoint -------------------------------------------------------------------


def small_checkpoint() -> EpisodeCheckpoint:
    """A checkpoint mid-generation with a sandbox snapshot and a pending request (KV too):
    every kind of file a checkpoint directory holds, each a few hundred bytes."""
    b = TrajectoryBuilder()
    b.add_context([1, 2, 3])
    b.add_sampled([4, 5], [-0.5, -0.25], 2, 1)
    params = SamplingParams(max_tokens=9, seed=42)
    snap = RequestSnapshot(
        request_id="e-1", token_ids=[1, 2, 3, 4, 5], num_prompt_tokens=3,
        num_computed_tokens=4, kv_version=2, min_kv_version=1, params=params, seed=42,
        logprobs=[-0.5, -0.25], block_size=4, model_fingerprint="fp",
        k=torch.arange(4.0).reshape(1, 1, 1, 2, 2), v=-torch.arange(4.0).reshape(1, 1, 1, 2, 2),
    )  # fmt: skip
    return EpisodeCheckpoint(
        task=Task(id="t", data={"prompt": "p"}), episode_id="e", group_id="g", sample_index=1,
        seed=11, env_name="probe", env_version="2", phase="generating", next_turn=0,
        prompt_len=3, started_at=1.5, token_ids=b.token_ids.tobytes(),
        logprobs=b.logprobs.tobytes(), loss_mask=b.mask.tobytes(),
        policy_version=b.policy.tobytes(), kv_version=b.kv.tobytes(), request_id="e-1",
        gen_start=3, sampling=params, sandbox=b"a sandbox tar archive", pending=snap,
    )  # fmt: skip


def files_of(path: Path) -> list[Path]:
    return sorted(f for f in path.rglob("*") if f.is_file())


def damaged_copies(data: bytes, sample: int | None = None) -> list[tuple[str, bytes]]:
    """Every single-bit flip of ``data``, every cut and one appended byte; or, with
    ``sample``, that many flips and that many cuts (seeded, spread over the whole file)."""
    bits, cuts = range(len(data) * 8), range(len(data))
    if sample is not None:
        rng = random.Random(len(data))
        bits = sorted(rng.sample(bits, min(sample, len(bits))))
        cuts = sorted(rng.sample(cuts, min(sample, len(cuts))))
    out = []
    for bit in bits:
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        out.append((f"bit {bit} flipped", bytes(flipped)))
    out += [(f"cut to {n} bytes", data[:n]) for n in cuts]
    out.append(("a byte appended", data + b"\x00"))
    return out


def refusals(
    file: Path, load: Callable[[], Any], sample: int | None = None
) -> tuple[int, list[str]]:
    """Writes each damaged copy of ``file`` and calls ``load``: how many were refused with
    ``file`` named, and what was not (loaded silently, or refused naming another file)."""
    original = file.read_bytes()
    refused, wrong = 0, []
    try:
        for how, data in damaged_copies(original, sample):
            file.write_bytes(data)
            try:
                load()
            except CheckpointError as exc:
                if exc.path == file and str(file) in str(exc):
                    refused += 1
                else:
                    wrong.append(f"{how}: refused naming {exc.path}")
            else:
                wrong.append(f"{how}: loaded silently")
    finally:
        file.write_bytes(original)
    return refused, wrong


def test_every_bit_flip_and_cut_of_every_checkpoint_file_is_refused_by_name(
    tmp_path: Path,
) -> None:
    cp = small_checkpoint()
    path = cp.save(tmp_path / "e")
    files = files_of(path)
    names = [f.relative_to(path).as_posix() for f in files]
    assert names == [
        "episode.msgpack", "job.msgpack", "request/kv.safetensors", "request/meta.msgpack",
        "sandbox.tar",
    ]  # fmt: skip
    for file in files:
        # through the file system: a few hundred flips and cuts of each file (every one of
        # the small job.msgpack); every one of episode.msgpack is checked in memory below
        sample = None if file.name == "job.msgpack" else 250
        refused, wrong = refusals(file, lambda: EpisodeCheckpoint.load(path), sample)
        assert wrong == [], f"{file.name}: {len(wrong)} not refused, e.g. {wrong[:3]}"
        assert refused == len(damaged_copies(file.read_bytes(), sample))
    # every flip and cut of the record holding the token ids, logprobs and versions fails
    # the frame that EpisodeCheckpoint.load reads it through
    data = (path / "episode.msgpack").read_bytes()
    unframe(b"EPIS", data)
    passed = []
    for how, copy in damaged_copies(data):
        try:
            unframe(b"EPIS", copy)
            passed.append(how)
        except ValueError:
            pass
    assert passed == [] and len(data) > 500
    back = EpisodeCheckpoint.load(path)  # the intact directory still loads, exactly
    assert back.token_ids == cp.token_ids and back.sandbox == cp.sandbox
    assert back.pending is not None and torch.equal(back.pending.k, cp.pending.k)


def test_a_refused_checkpoint_names_the_sample_to_restart_whatever_file_is_damaged(
    tmp_path: Path,
) -> None:
    cp = small_checkpoint()
    path = cp.save(tmp_path / "e")
    want = EpisodeJob(task=cp.task, sample_index=1, group_id="g", episode_id="e")
    for file in files_of(path):
        original = file.read_bytes()
        for how, data in damaged_copies(original)[::97]:  # a sample: scans read every file
            file.write_bytes(data)
            [], [bad] = scan_checkpoints(tmp_path)
            assert bad.path == path and bad.error.path == file, how
            assert bad.job == want, f"{file.name}, {how}"
        file.write_bytes(original)
    # both files that name the sample damaged: refused, and the sample is unknown
    for name in ("episode.msgpack", "job.msgpack"):
        (path / name).write_bytes(b"")
    [], [bad] = scan_checkpoints(tmp_path)
    assert bad.job is None
    with pytest.raises(CheckpointError, match=r"episode\.msgpack is refused: it is empty"):
        load_checkpoints(tmp_path)


def test_an_unframed_checkpoint_of_an_older_version_is_refused_not_read(tmp_path: Path) -> None:
    cp = small_checkpoint()
    path = cp.save(tmp_path / "e")
    # what the previous format wrote: the bare msgpack record
    old = msgspec.structs.replace(cp, format=1, sandbox=None, pending=None)
    (path / "episode.msgpack").write_bytes(msgspec.msgpack.encode(old))
    with pytest.raises(CheckpointError, match="no checkpoint header") as refused:
        EpisodeCheckpoint.load(path)
    assert refused.value.path == path / "episode.msgpack"
    assert "restarts this episode from its task" in str(refused.value)


def test_what_a_stop_saves_beside_the_checkpoints_is_refused_by_name(tmp_path: Path) -> None:
    jobs = [EpisodeJob(task=Task(id="t"), sample_index=i, group_id="g") for i in range(2)]
    save_jobs(tmp_path / "unstarted.msgpack", jobs)
    assert load_jobs(tmp_path / "unstarted.msgpack") == jobs
    traj = Trajectory(
        id="e0", task_id="t", group_id="g", token_ids=np.array([1, 2, 3]),
        logprobs=np.array([0.0, -1.0, -2.0]), loss_mask=np.array([0, 1, 1]),
        policy_version=np.array([-1, 0, 0]), kv_version=np.array([-1, 0, 0]),
    )  # fmt: skip
    save_finished(tmp_path / "finished.msgpack", [traj])
    [back] = load_finished(tmp_path / "finished.msgpack")
    assert back.id == "e0" and back.logprobs.tolist() == [0.0, -1.0, -2.0]
    for file, load, flips in [
        (tmp_path / "unstarted.msgpack", load_jobs, None),
        (tmp_path / "finished.msgpack", load_finished, 300),
    ]:
        refused, wrong = refusals(file, functools.partial(load, file), flips)
        assert wrong == [], wrong[:3]
        assert refused == len(damaged_copies(file.read_bytes(), flips))
        file.write_bytes(msgspec.msgpack.encode([]))  # unframed, as older versions wrote
        with pytest.raises(CheckpointError, match="no checkpoint header"):
            load(file)


# -- a resume with one refused checkpoint among several -------------------------------------------


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


SCRIPT = [call("work", '{"x": 1}'), "finished after the tool"]
TASKS = [Task(id=f"t{i}", data={"prompt": f"task {i}"}) for i in range(3)]
CFG = RolloutConfig(concurrency=3, progress="off")


class Held(Environment):
    """A tool call per episode; with ``hold``, each waits for ``release`` once all three
    have started (so a stop finds every episode at the turn gate with its result kept)."""

    name = "held"
    max_turns = 3

    def __init__(self, *, hold: bool = False) -> None:
        self.hold = hold
        self.calls: list[str] = []  # shared by every episode's copy
        self.all_called = asyncio.Event()
        self.release = asyncio.Event()

    @tool
    async def work(self, x: int, state: EpisodeState) -> str:
        """Work on x."""
        self.calls.append(state.task.id)
        if self.hold:
            if len(self.calls) == len(TASKS):
                self.all_called.set()
            await self.release.wait()
        return f"worked on {x} for {state.task.id}"


async def checkpoint_all(tok: ChatTokenizer, cp_dir: Path) -> list[Path]:
    env = Held(hold=True)
    async with RolloutEngine(MockBackend(SCRIPT, tokenizer=tok), env, CFG) as engine:

        async def consume(trajs: AsyncIterator[Trajectory]) -> None:
            async for _ in trajs:
                raise AssertionError("no episode may finish before the stop")

        consumer = asyncio.create_task(consume(engine.run(TASKS)))
        await env.all_called.wait()
        await engine.pause()
        env.release.set()  # the tool calls finish while paused; their results are kept
        paths = await engine.checkpoint(cp_dir)
        consumer.cancel()
        await asyncio.wait({consumer})
    return sorted(paths)


async def test_a_resume_restarts_only_the_episode_whose_checkpoint_is_refused(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    ref_out = tmp_path / "ref.jsonl"
    await run_worker(
        Held(), MockBackend(SCRIPT, tokenizer=tok), out=ref_out, checkpoint_dir=tmp_path / "rcp",
        tasks=TASKS, config=CFG, stop_signals=(),
    )  # fmt: skip
    reference = {t.task_id: t for t in read_trajectories(ref_out)}

    cp_dir = tmp_path / "cp"
    paths = await checkpoint_all(tok, cp_dir)
    cps = {cp.episode_id: cp for cp in load_checkpoints(cp_dir)}
    assert len(paths) == 3 and all(c.phase == "turn" and c.turns for c in cps.values())
    damaged = paths[1]
    data = bytearray((damaged / "episode.msgpack").read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, in the middle of the payload
    (damaged / "episode.msgpack").write_bytes(bytes(data))

    env = Held()
    out = tmp_path / "out.jsonl"
    result = await run_worker(
        env, MockBackend(SCRIPT, tokenizer=tok), out=out, checkpoint_dir=cp_dir, tasks=TASKS,
        config=CFG, stop_signals=(),
    )  # fmt: skip
    assert result.checkpoints_corrupt == 1 and result.resumed == 2
    assert "checkpoints_corrupt=1" in result.line()
    got = {t.id: t for t in read_trajectories(out)}
    assert sorted(t.task_id for t in got.values()) == [t.id for t in TASKS]  # each once
    assert set(got) == set(cps)  # the restarted episode keeps its id
    restarted = got[damaged.name]
    assert restarted.metrics["restarted_turns"] == 1
    assert env.calls == [cps[damaged.name].task.id]  # only it ran its tool call again
    for episode_id, traj in got.items():
        assert same_trajectory(reference[traj.task_id], traj), episode_id
        if episode_id != damaged.name:  # continued from its checkpoint, nothing redone
            assert traj.metrics["restarted_turns"] == 0
    assert list(cp_dir.iterdir()) == []  # every checkpoint, the refused one too, is done


HEAD = """
[run]
seed = 3
[environment]
name = "calculator"
kwargs = { num_tasks = 8, max_operand = 20 }
[rollout]
samples_per_task = 2
"""


async def test_the_service_restarts_a_refused_checkpoint_as_an_unstarted_sample(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    service = RolloutService(parse_recipe(HEAD), model_dir=tmp_path, run_dir=tmp_path)
    paths = await checkpoint_all(tok, service.checkpoint_dir)
    cps = {cp.episode_id: cp for cp in load_checkpoints(service.checkpoint_dir)}
    damaged = paths[0]
    (damaged / "job.msgpack").write_bytes((damaged / "job.msgpack").read_bytes()[:-1])
    checkpoints, stopped, jobs = service._load_stopped()
    assert sorted(cp.episode_id for cp in checkpoints) == sorted(p.name for p in paths[1:])
    assert stopped == [] and jobs == [cps[damaged.name].job()]  # from intact episode.msgpack
    assert jobs[0].episode_id == damaged.name
    assert service.counters["checkpoints_corrupt"] == 1
    assert service._continued == set(cps)  # its directory goes once its group is published
    # a stop that saved the restart as unstarted before it ran: it is not run twice
    save_jobs(service.checkpoint_dir / UNSTARTED, jobs)
    _, _, again = service._load_stopped()
    assert again == jobs
    # both files naming the sample damaged: its group could never complete, so the start
    # is refused with the file named (one sample per task: dropped, nothing waits for it)
    (damaged / "episode.msgpack").write_bytes(b"")
    (service.checkpoint_dir / UNSTARTED).unlink()
    with pytest.raises(ConfigError, match=rf"{damaged.name}.*task is unknown.*move"):
        service._load_stopped()
    single = RolloutService(
        parse_recipe(HEAD.replace("samples_per_task = 2", "samples_per_task = 1")),
        model_dir=tmp_path, run_dir=tmp_path,
    )  # fmt: skip
    checkpoints, _, jobs = single._load_stopped()
    assert len(checkpoints) == 2 and jobs == [] and not damaged.exists()
    assert single.counters["checkpoints_corrupt"] == 1
