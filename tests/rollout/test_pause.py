"""Engine-level pause (agentroll.rollout.pause): the pure pieces, then the rollout engine paused in
the middle of real runs -- trajectories unchanged, tool calls finish and are kept, nothing
new starts while paused, deadlines exclude paused time, per-episode resume policies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from agentroll.backends.base import GenerationChunk, GenerationRequest, SamplingParams
from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment, EpisodeState, tool
from agentroll.errors import ConfigError
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.rollout.pause import (
    EpisodeView,
    PauseController,
    PauseGate,
    fixed_policy,
    freeze_deadlines,
    staleness_policy,
    thaw_deadlines,
)
from agentroll.types import Message, Task, Trajectory
from agentroll.validate.checkpoint import STOP_IDS, ProbeBackend, same_trajectory, turn_lengths
from agentroll.weights.exporter import WeightExporter


def view(**kw: Any) -> EpisodeView:
    base: dict[str, Any] = dict(
        episode_id="e",
        request_id="e-0",
        turn=0,
        tokens_generated=5,
        min_policy_version=0,
        min_kv_version=0,
        policy_version=0,
    )
    return EpisodeView(**{**base, **kw})


# -- pure pieces ---------------------------------------------------------------------------------


async def test_gate_counts_pauses_and_paused_time() -> None:
    gate = PauseGate()
    assert gate.is_open and gate.open(5.0) == 0.0
    await gate.wait()  # open: returns at once
    gate.close(10.0)
    gate.close(11.0)  # closing a closed gate changes nothing
    assert not gate.is_open and gate.pauses == 1 and gate.closed_at == 10.0
    waiter = asyncio.create_task(gate.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    assert gate.open(12.5) == 2.5
    await waiter
    gate.close(20.0)
    assert gate.open(21.0) == 1.0
    assert gate.paused_seconds == 3.5 and gate.pauses == 2


def test_fixed_and_staleness_policies() -> None:
    assert fixed_policy("recompute")(view()) == "recompute"
    with pytest.raises(ValueError, match="keep, recompute or restart"):
        fixed_policy("later")  # type: ignore[arg-type]
    choose = staleness_policy(1)
    # the lag is target (or current) version minus the oldest KV the episode would keep
    assert choose(view(min_kv_version=2, policy_version=3)) == "keep"
    assert choose(view(min_kv_version=1, policy_version=3)) == "recompute"
    assert choose(view(min_kv_version=2, policy_version=2, target_version=4)) == "recompute"
    assert choose(view(min_kv_version=None, policy_version=9)) == "keep"  # nothing sampled yet
    assert staleness_policy(0, after="restart")(view(policy_version=1)) == "restart"
    with pytest.raises(ValueError, match=">= 0"):
        staleness_policy(-1)
    with pytest.raises(ValueError, match="unknown resume policy"):
        staleness_policy(1, after="drop")  # type: ignore[arg-type]


async def test_frozen_deadlines_do_not_fire_and_keep_their_remaining_time() -> None:
    loop = asyncio.get_running_loop()
    fired: list[str] = []

    async def sleeper(name: str) -> None:
        try:
            async with asyncio.timeout(0.05) as t:
                timeouts[name] = t
                await asyncio.sleep(10)
        except TimeoutError:
            fired.append(name)

    timeouts: dict[str, asyncio.Timeout] = {}
    task = asyncio.create_task(sleeper("a"))
    await asyncio.sleep(0)
    frozen = freeze_deadlines(timeouts.values(), loop.time())
    left = frozen[timeouts["a"]]
    assert 0 < left <= 0.05 and timeouts["a"].when() is None
    await asyncio.sleep(0.15)  # well past the original deadline
    assert not fired and not task.done()
    thawed_at = loop.time()
    thaw_deadlines(frozen, thawed_at)
    assert timeouts["a"].when() == pytest.approx(thawed_at + left)
    await task
    assert fired == ["a"] and loop.time() - thawed_at >= left - 0.01
    assert freeze_deadlines(timeouts.values(), loop.time()) == {}  # expired: left alone


async def test_controller_pause_resume_with_the_mock_backend() -> None:
    now = [100.0]
    backend = MockBackend(["x"])
    views = [view(episode_id="a", request_id="a-0"), view(episode_id="b", request_id="b-3")]
    ctl = PauseController(backend, lambda: views, clock=lambda: now[0])
    assert await ctl.resume() == 0.0 and backend.events == []  # not paused: nothing to do

    def choose(v: EpisodeView) -> Any:
        return "keep" if v.episode_id == "a" else "restart"

    await ctl.pause(choose)
    await ctl.pause(choose)  # idempotent: the backend is paused once
    assert ctl.paused and backend.events == [("pause", "keep")]
    assert ctl.policies(target_version=7) == {"a-0": "keep", "b-3": "restart"}
    now[0] = 102.5
    assert await ctl.resume() == 2.5
    assert backend.events[-1] == ("resume", {"a-0": "keep", "b-3": "restart"})
    assert ctl.last_policies == {"a-0": "keep", "b-3": "restart"} and ctl.durations == [2.5]
    assert not ctl.paused and ctl.gate.pauses == 1

    await ctl.pause("recompute")
    await ctl.resume({"a-0": "keep"})  # explicit policies win over the policy function
    assert backend.events[-1] == ("resume", {"a-0": "keep"})

    class Refusing(MockBackend):
        async def pause(self, policy: Any = "keep") -> None:
            raise NotImplementedError("cannot pause")

    ctl = PauseController(Refusing(["x"]))
    with pytest.raises(NotImplementedError):
        await ctl.pause()
    assert not ctl.paused  # a failed pause leaves the gate open


# -- the rollout engine on the tiny model ------------------------------------------------------------


class Chat(Environment):
    """Multi-turn without tool calls: the environment answers every turn."""

    max_turns = 3

    async def env_response(self, messages: list[Message], state: EpisodeState) -> list[Message]:
        return [Message(role="user", content=f"go on ({state.turn})")]


CHAT_CFG = RolloutConfig(
    concurrency=4,
    progress="off",
    sampling=SamplingParams(temperature=1.0, max_tokens=48, stop_token_ids=STOP_IDS),
)
CHAT_TASKS = [Task(id=f"c{i}", data={"prompt": f"tell me about {i}"}) for i in range(4)]


async def run_chat(backend: Any, env: Environment | None = None) -> list[Trajectory]:
    async with backend, RolloutEngine(backend, env or Chat(), CHAT_CFG) as engine:
        return [t async for t in engine.run(CHAT_TASKS)]


def by_task(trajs: list[Trajectory]) -> dict[str, Trajectory]:
    return {t.task_id: t for t in trajs}


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, Trajectory]:
    """Uninterrupted runs of the chat tasks (computed once for this module)."""
    return by_task(asyncio.run(run_chat(ProbeBackend(tiny_model, batch_invariant=True))))


async def test_pause_mid_run_changes_no_trajectory_and_starts_nothing(
    tiny_model: Path, reference: dict[str, Trajectory]
) -> None:
    lengths = turn_lengths(list(reference.values()))
    backend = ProbeBackend(tiny_model, batch_invariant=True)
    requests: list[str] = []
    seen: dict[str, Any] = {}

    start = backend.generate

    def generate(request: GenerationRequest) -> Any:  # records every generation started
        requests.append(request.request_id)
        return start(request)

    backend.generate = generate  # type: ignore[method-assign]

    async def on_chunk(request: GenerationRequest, n: int) -> None:
        seed = request.sampling.seed
        if not seen and seed is not None and n >= 3 and lengths[seed] - n >= 8:
            seen["request"] = request.request_id
            await engine.pause("keep")  # from inside a generation, at a token boundary
            await engine.quiesce()  # every episode at the gate or paused in the backend
            before = (backend.steps, len(requests), dict(backend.inflight()))
            for _ in range(20):  # a while paused: no step, no new request, no token
                await asyncio.sleep(0.005)
            seen["before"] = before
            seen["after"] = (backend.steps, len(requests), dict(backend.inflight()))
            seen["paused_for"] = await engine.resume()

    backend.on_chunk = on_chunk
    async with backend, RolloutEngine(backend, Chat(), CHAT_CFG) as engine:
        got = by_task([t async for t in engine.run(CHAT_TASKS)])
    assert seen["before"] == seen["after"] and seen["paused_for"] >= 0.09
    inflight = seen["before"][2]
    assert len(inflight) >= 2 and inflight[seen["request"]] >= 3  # paused mid-generation
    assert got.keys() == reference.keys()
    for task_id, ref in reference.items():
        assert same_trajectory(ref, got[task_id]), task_id
        assert (got[task_id].policy_version[got[task_id].loss_mask == 1] == 0).all()


class SlowTool(Environment):
    max_turns = 3

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.calls: list[int] = []

    @tool
    async def work(self, x: int) -> str:
        """Slow work."""
        self.started.set()
        await self.release.wait()
        self.calls.append(x)
        return f"worked on {x}"


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


async def test_a_running_tool_call_finishes_during_the_pause_and_is_kept(
    tok: ChatTokenizer,
) -> None:
    env = SlowTool()
    backend = MockBackend([call("work", '{"x": 7}'), "all done"], tokenizer=tok, record=True)
    async with RolloutEngine(backend, env, RolloutConfig(progress="off"), tokenizer=tok) as engine:
        consumer = asyncio.create_task(_collect(engine.run([Task(id="t", data={"prompt": "go"})])))
        await env.started.wait()
        await engine.pause()
        env.release.set()  # the tool finishes while the engine is paused
        await engine.quiesce()  # returns once its result is in and the episode is at the gate
        assert env.calls == [7] and len(backend.requests) == 1  # no new turn started
        await asyncio.sleep(0.05)
        assert len(backend.requests) == 1 and not consumer.done()
        await engine.resume()
        [traj] = await consumer
    assert traj.status == "ok" and env.calls == [7]  # run once, not again after the pause
    assert [r.content for r in traj.turns[0].tool_results] == ["worked on 7"]
    assert traj.messages[-2].content == "worked on 7" and len(traj.turns) == 2
    second = backend.requests[1].prompt_ids
    assert traj.token_ids[: len(second)].tolist() == list(second)
    assert "worked on 7" in tok.decode(list(second))


async def test_deadlines_shorter_than_the_pause_do_not_fire(tok: ChatTokenizer) -> None:
    # budgets that the unpaused work fits in on a loaded machine (a fresh-clone run saw the
    # first episode spend 0.15 s before the pause, waiting for the second one to start)
    cfg = RolloutConfig(progress="off", generation_timeout=0.5, episode_timeout=0.75)
    backend = Gated(["a b c d"], tokenizer=tok, chunk_size=1, expect=2)
    async with RolloutEngine(backend, SlowTool(), cfg, tokenizer=tok) as engine:
        consumer = asyncio.create_task(_collect(engine.run(go_tasks(2))))
        await backend.arrived.wait()  # both episodes have started generating
        await engine.pause()
        backend.proceed.set()  # their streams are now held by the paused backend
        await asyncio.sleep(1.6)  # more than twice as long as both timeouts
        assert not consumer.done()
        paused_for = await engine.resume()
        trajs = await consumer
    assert paused_for >= 1.6
    assert [t.status for t in trajs] == ["ok", "ok"], [t.error for t in trajs]


async def _collect(agen: Any) -> list[Trajectory]:
    return [t async for t in agen]


class Gated(MockBackend):
    """After the first chunk of a turn-0 request: count it (``arrived`` is set once
    ``expect`` requests got there), then wait for ``proceed``."""

    def __init__(self, *args: Any, expect: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expect, self.count = expect, 0
        self.arrived, self.proceed = asyncio.Event(), asyncio.Event()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        first = True
        async for chunk in super().generate(request):
            yield chunk
            if first and request.turn_index == 0:
                first = False
                self.count += 1
                if self.count == self.expect:
                    self.arrived.set()
                await self.proceed.wait()


def go_tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", data={"prompt": "go"}) for i in range(n)]


async def test_policy_function_sees_each_episode_and_its_choice_reaches_the_backend(
    tok: ChatTokenizer,
) -> None:
    backend = Gated(["one two three four five six"], tokenizer=tok, chunk_size=2, expect=3)
    seen: list[EpisodeView] = []
    order = ["keep", "recompute", "restart"]

    def choose(v: EpisodeView) -> Any:
        seen.append(v)
        return order[len(seen) - 1]

    cfg = RolloutConfig(progress="off")
    async with RolloutEngine(backend, SlowTool(), cfg, tokenizer=tok) as engine:
        consumer = asyncio.create_task(_collect(engine.run(go_tasks(3))))
        await backend.arrived.wait()
        await engine.pause(choose)
        backend.proceed.set()
        await engine.quiesce()
        await engine.resume()
        trajs = await consumer
    assert len(seen) == 3 and all(t.status == "ok" for t in trajs)
    episodes = {t.id for t in trajs}
    for v in seen:
        assert v.episode_id in episodes and v.request_id == f"{v.episode_id}-0"
        assert (v.turn, v.tokens_generated, v.min_policy_version, v.min_kv_version) == (0, 2, 0, 0)
        assert v.policy_version == 0
    expected = {v.request_id: order[i] for i, v in enumerate(seen)}
    assert backend.events == [("pause", "keep"), ("resume", expected)]


async def test_sync_with_a_staleness_policy_on_the_mock_backend(tok: ChatTokenizer) -> None:
    class Update:
        version = 1

    backend = Gated(["x y z"], tokenizer=tok, chunk_size=1, expect=1)
    cfg = RolloutConfig(progress="off")
    async with RolloutEngine(backend, SlowTool(), cfg, tokenizer=tok) as engine:
        consumer = asyncio.create_task(_collect(engine.run(go_tasks(1))))
        await backend.arrived.wait()  # one token sampled under version 0
        await engine.sync(Update(), policy=staleness_policy(0))
        backend.proceed.set()
        [traj] = await consumer
    [(_, policies)] = [e for e in backend.events if e[0] == "resume"]
    assert backend.events[:2] == [("pause", "keep"), ("apply", 1)]
    assert list(policies.values()) == ["recompute"]  # KV one version behind, budget 0
    gen = traj.policy_version[traj.loss_mask == 1].tolist()
    assert gen[0] == 0 and set(gen[1:]) == {1}


async def test_sync_on_a_fleet_asks_the_policy_when_each_replica_pauses(
    tok: ChatTokenizer,
) -> None:
    """``engine.sync`` is the one entry point on a fleet too: the fleet updates its
    replicas with the strategy given, and each in-flight request resumes under what the
    policy function chose for it (its KV one version behind, budget 0: recompute)."""
    from agentroll.fleet import FleetBackend, LocalReplica

    class Update:
        version = 1

    backend = Gated(["x y z"], tokenizer=tok, chunk_size=1, expect=1)
    fleet = FleetBackend([LocalReplica(backend, name="r0")])
    cfg = RolloutConfig(progress="off")
    async with fleet, RolloutEngine(fleet, SlowTool(), cfg, tokenizer=tok) as engine:
        consumer = asyncio.create_task(_collect(engine.run(go_tasks(1))))
        await backend.arrived.wait()
        report = await engine.sync(Update(), policy=staleness_policy(0), strategy="pause")  # type: ignore[arg-type]
        backend.proceed.set()
        [traj] = await consumer
    assert report.strategy == "pause" and report.version == 1 and not report.failed
    [(_, policies)] = [e for e in backend.events if e[0] == "resume"]
    assert ("apply", 1) in backend.events
    assert list(policies.values()) == ["recompute"]
    gen = traj.policy_version[traj.loss_mask == 1].tolist()
    assert gen[0] == 0 and set(gen[1:]) == {1}


async def test_sync_on_one_backend_refuses_a_fleet_strategy(tok: ChatTokenizer) -> None:
    backend = MockBackend(["x"], tokenizer=tok)
    async with RolloutEngine(
        backend, SlowTool(), RolloutConfig(progress="off"), tokenizer=tok
    ) as engine:
        with pytest.raises(ConfigError, match="needs a fleet"):
            await engine.sync(object(), strategy="rolling")  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["keep", "recompute"])
async def test_sync_with_a_real_update_versions_every_token(
    tiny_model: Path, reference: dict[str, Trajectory], policy: str
) -> None:
    lengths = turn_lengths(list(reference.values()))
    backend = ProbeBackend(tiny_model, batch_invariant=True)
    synced: dict[str, Any] = {}

    async def on_chunk(request: GenerationRequest, n: int) -> None:
        seed = request.sampling.seed
        if not synced and seed is not None and n >= 4 and lengths[seed] - n >= 8:
            synced.update(episode=request.episode_id, turn=request.turn_index, at=n)
            await engine.sync(update, policy=policy)  # type: ignore[arg-type]

    backend.on_chunk = on_chunk
    async with backend, RolloutEngine(backend, Chat(), CHAT_CFG) as engine:
        state = {k: v.clone() for k, v in backend.engine.runner.state_dict().items()}
        exporter = WeightExporter(lambda: state)
        g = torch.Generator().manual_seed(0)
        for v in state.values():
            v.add_(0.01 * torch.randn(v.shape, generator=g))
        update = exporter.export()
        trajs = [t async for t in engine.run(CHAT_TASKS)]
        assert backend.policy_version == 1
        assert engine.pauses.last_policies and set(engine.pauses.last_policies.values()) == {policy}
    [traj] = [t for t in trajs if t.id == synced["episode"]]
    turn = traj.turns[synced["turn"]]
    pol = traj.policy_version[turn.gen_start : turn.gen_end]
    kv = traj.kv_version[turn.gen_start : turn.gen_end]
    cut = int(np.argmax(pol == 1))
    assert cut >= synced["at"] and (pol[:cut] == 0).all() and (pol[cut:] == 1).all()
    assert (kv[:cut] == 0).all()
    # keep: the turn goes on attending to KV of version 0; recompute: re-prefilled under 1
    assert (kv[cut:] == (0 if policy == "keep" else 1)).all()
    for later in traj.turns[synced["turn"] + 1 :]:  # a new request: new weights, new KV
        span = slice(later.gen_start, later.gen_end)
        assert (traj.policy_version[span] == 1).all() and (traj.kv_version[span] == 1).all()
    ref = reference[traj.task_id]
    same = slice(0, turn.gen_start + cut)
    assert traj.token_ids[same].tolist() == ref.token_ids[same].tolist()  # same until the sync
