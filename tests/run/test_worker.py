"""The rollout worker (agentroll.run.worker, ``agentroll worker``): its output file, SIGTERM
checkpointing in-flight episodes, a restart continuing them, and the
``episode_checkpoint_parity`` check end to end across processes."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from agentroll.backends.base import GenerationChunk, GenerationRequest, ResumePolicy
from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment, EpisodeState, tool
from agentroll.errors import ConfigError
from agentroll.rollout.checkpoint import EpisodeCheckpoint, load_checkpoints
from agentroll.rollout.engine import RolloutConfig
from agentroll.run.worker import TrajectoryWriter, read_trajectories, run_worker
from agentroll.types import Task, Trajectory
from agentroll.validate.checkpoint import check_episode_checkpoint_parity, same_trajectory

# -- the output file -------------------------------------------------------------------------------


def traj(i: int) -> Trajectory:
    return Trajectory(
        id=f"e{i}", task_id=f"t{i}", group_id="g", token_ids=np.array([1, 2, i]),
        logprobs=np.array([0.0, -1.0, -2.0]), loss_mask=np.array([0, 1, 1]),
        policy_version=np.array([-1, 0, 0]), kv_version=np.array([-1, 0, 0]),
    )  # fmt: skip


@pytest.mark.parametrize("name", ["out.jsonl", "out.msgpack"])
def test_output_survives_a_record_cut_short(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    writer = TrajectoryWriter(path)
    writer.open()
    for i in range(2):
        writer.write(traj(i))
    writer.close()
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # a crash in the middle of the second record
    assert [t.id for t in read_trajectories(path)] == ["e0"]
    writer.open()  # drops the cut record before appending
    writer.write(traj(2))
    writer.close()
    got = read_trajectories(path)
    assert [t.id for t in got] == ["e0", "e2"] and got[1].token_ids.tolist() == [1, 2, 2]
    if name.endswith(".jsonl"):
        path.write_bytes(path.read_bytes() + b"{not json}\n")
        with pytest.raises(ValueError, match="record 3 is not a trajectory"):
            read_trajectories(path)


# -- stopping and continuing -------------------------------------------------------------------------


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


SCRIPT = [call("work", '{"x": 1}'), "finished after the tool"]


class Paced(MockBackend):
    """The second turn-0 request stops after its first chunk until the backend is paused,
    so it is mid-generation when the worker stops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, chunk_size=2, **kwargs)
        self.paused_event = asyncio.Event()
        self.turn0 = 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        hold = False
        if request.turn_index == 0:
            self.turn0 += 1
            hold = self.turn0 == 2
        async for chunk in super().generate(request):
            yield chunk
            if hold:
                hold = False
                await self.paused_event.wait()

    async def pause(self, policy: ResumePolicy = "keep") -> None:
        await super().pause(policy)
        self.paused_event.set()


class Stoppable(Environment):
    """The first ``work`` call of a run sends SIGTERM to this process, then holds until the
    backend is paused: it is mid-tool-call when the worker stops."""

    max_turns = 3

    def __init__(self, backend: Paced | None = None) -> None:
        self.backend = backend
        self.calls: list[str] = []  # shared by every episode's copy
        # whatever an earlier test left (ray.init installs its own): the worker's differs
        self.handler_before = signal.getsignal(signal.SIGTERM)

    @tool
    async def work(self, x: int, state: EpisodeState) -> str:
        """Work on x."""
        self.calls.append(state.task.id)
        if self.backend is not None and len(self.calls) == 1:
            # a handler is installed by the worker: the signal cannot kill the test run
            assert signal.getsignal(signal.SIGTERM) not in (self.handler_before, None)
            os.kill(os.getpid(), signal.SIGTERM)
            await self.backend.paused_event.wait()
        return f"worked on {x} for {state.task.id}"


TASKS = [Task(id=f"t{i}", data={"prompt": f"task {i}"}) for i in range(5)]
CFG = RolloutConfig(concurrency=3, progress="off")


async def test_sigterm_checkpoints_in_flight_episodes_and_a_restart_finishes_them(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    ref_env = Stoppable()
    await run_worker(
        ref_env,
        MockBackend(SCRIPT, tokenizer=tok),
        out=tmp_path / "ref.jsonl",
        checkpoint_dir=tmp_path / "ref-cp",
        tasks=TASKS,
        config=CFG,
        stop_signals=(),
    )
    reference = {t.task_id: t for t in read_trajectories(tmp_path / "ref.jsonl")}
    assert len(reference) == 5 and all(t.status == "ok" for t in reference.values())

    out, cp_dir = tmp_path / "out.msgpack", tmp_path / "cp"
    backend = Paced(SCRIPT, tokenizer=tok)
    env = Stoppable(backend)
    first = await run_worker(env, backend, out=out, checkpoint_dir=cp_dir, tasks=TASKS, config=CFG)
    assert signal.getsignal(signal.SIGTERM) is env.handler_before  # the handler is gone again
    assert first.stopped and first.checkpointed == 2
    assert "status=stopped checkpointed=2" in first.line()
    cps = {cp.task.id: cp for cp in load_checkpoints(cp_dir)}
    held = env.calls[0]
    assert cps[held].phase == "turn" and cps[held].turns[0].tool_results  # result kept
    [mid_gen] = [cp for task_id, cp in cps.items() if task_id != held]
    assert mid_gen.dropped_generation  # the mock cannot snapshot: its turn is redone
    written = read_trajectories(out)
    assert first.written == len(written) and len(written) + len(cps) <= len(TASKS)

    again = await run_worker(
        Stoppable(), MockBackend(SCRIPT, tokenizer=tok), out=out, checkpoint_dir=cp_dir,
        tasks=TASKS, config=CFG,
    )  # fmt: skip
    assert not again.stopped and again.resumed == 2 and again.skipped == len(written)
    assert list(cp_dir.iterdir()) == []  # every checkpoint was written, then deleted
    got = read_trajectories(out)
    assert sorted(t.task_id for t in got) == sorted(reference)  # each task exactly once
    for t in got:
        assert same_trajectory(reference[t.task_id], t), t.task_id
    # the held tool call ran once: its result was checkpointed, not recomputed
    assert Counter(env.calls)[held] == 1


async def test_a_checkpoint_already_in_the_output_is_dropped(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    """A worker killed after writing a continued episode but before deleting its
    checkpoint: the next worker must not run that episode again."""
    out, cp_dir = tmp_path / "out.jsonl", tmp_path / "cp"
    backend = Paced(SCRIPT, tokenizer=tok)
    await run_worker(
        Stoppable(backend), backend, out=out, checkpoint_dir=cp_dir, tasks=TASKS, config=CFG
    )
    cps = load_checkpoints(cp_dir)
    done = {t.task_id for t in read_trajectories(out)}
    # pretend the trajectory of one checkpointed episode was written before a crash
    fake = msgspec.structs.replace(traj(0), id=cps[0].episode_id, task_id=cps[0].task.id)
    writer = TrajectoryWriter(out)
    writer.open()
    writer.write(fake)
    writer.close()
    again = await run_worker(
        Stoppable(), MockBackend(SCRIPT, tokenizer=tok), out=out, checkpoint_dir=cp_dir,
        tasks=TASKS, config=CFG, stop_signals=(),
    )  # fmt: skip
    assert again.resumed == len(cps) - 1 and list(cp_dir.iterdir()) == []
    got = [t.task_id for t in read_trajectories(out)]
    assert sorted(got) == sorted(t.id for t in TASKS) and len(done) + len(cps) < len(TASKS) + 1


async def test_the_worker_refuses_what_it_cannot_continue(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    def run(**kw: Any) -> Any:
        args: dict[str, Any] = dict(
            out=tmp_path / "out.jsonl", checkpoint_dir=tmp_path / "cp", tasks=TASKS,
            config=CFG, stop_signals=(),
        )  # fmt: skip
        args.update(kw)
        return run_worker(Stoppable(), MockBackend(SCRIPT, tokenizer=tok), **args)

    with pytest.raises(ConfigError, match="unique ids"):
        await run(tasks=[TASKS[0], TASKS[0]])
    with pytest.raises(ConfigError, match="one sample per task"):
        await run(config=RolloutConfig(samples_per_task=2))
    cp_dir = tmp_path / "cp"
    minimal_cp("someone_else").save(cp_dir / "e1")
    with pytest.raises(ConfigError, match="checkpoint of environment 'someone_else'"):
        await run()
    shutil.rmtree(cp_dir / "e1")
    (tmp_path / "out.jsonl").write_bytes(b"{not a trajectory}\n")
    with pytest.raises(ConfigError, match=r"cannot continue: .*out\.jsonl: record 1"):
        await run()
    assert (tmp_path / "out.jsonl").read_bytes() == b"{not a trajectory}\n"  # refused first


def minimal_cp(env_name: str) -> EpisodeCheckpoint:
    return EpisodeCheckpoint(
        task=TASKS[0], episode_id="e1", group_id="g", sample_index=0, seed=1,
        env_name=env_name, env_version="0", phase="turn", next_turn=0, prompt_len=0,
        started_at=0.0, token_ids=b"", logprobs=b"", loss_mask=b"", policy_version=b"",
        kv_version=b"",
    )  # fmt: skip


# -- across processes ----------------------------------------------------------------------------------


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def test_cli_worker_stops_on_sigterm_and_a_restart_finishes(tmp_path: Path) -> None:
    out, cp_dir = tmp_path / "out.jsonl", tmp_path / "cp"
    cmd = [
        sys.executable, "-m", "agentroll.cli", "worker", "--env", "calculator", "--backend",
        "mock", "--mock-latency", "0.15", "--tasks", "8", "--concurrency", "2", "--seed", "3",
        "--out", str(out), "--checkpoint-dir", str(cp_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while _lines(out) < 1:  # the worker is running episodes: stop it in the middle
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    [line] = stdout.splitlines()
    fields = dict(f.split("=", 1) for f in line.split()[1:])
    assert fields["status"] == "stopped" and int(fields["checkpointed"]) >= 1
    assert int(fields["written"]) == _lines(out) < 8
    assert len(load_checkpoints(cp_dir)) == int(fields["checkpointed"])

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    fields = dict(f.split("=", 1) for f in done.stdout.split()[1:])
    assert fields["status"] == "done" and fields["checkpointed"] == "0"
    trajs = read_trajectories(out)
    assert sorted(t.task_id for t in trajs) == [f"calc-0-{i}" for i in range(8)]
    assert all(t.status == "ok" for t in trajs) and list(cp_dir.iterdir()) == []


@pytest.mark.slow
def test_check_episode_checkpoint_parity(tiny_model: Path) -> None:
    r = check_episode_checkpoint_parity(tiny_model)
    assert r.passed, r.line()
    assert r.figures["mid_generation"] >= 1 and r.figures["mid_tool_call"] >= 1
