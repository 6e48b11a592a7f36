"""AgentEnvironment: an OpenAI-SDK agent loop run by the rollout engine like a class env."""

from __future__ import annotations

import json

import numpy as np
import openai
from gateway_helpers import TOOLS

from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.gateway import AgentEnvironment
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.types import Task


def script(request):  # type: ignore[no-untyped-def]
    if request.turn_index == 0:
        return '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    return "The answer is 5."


async def agent(task: Task, base_url: str, api_key: str) -> float:
    """A plain OpenAI-SDK tool loop, as users write them."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": task.data["prompt"]}]
    for _ in range(4):
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return 1.0 if "5" in (msg.content or "") else 0.0
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
            )
    return 0.0


async def test_agent_environment_runs_groups_through_the_engine(tok: ChatTokenizer) -> None:
    backend = MockBackend(script, tokenizer=tok, record=True)
    tasks = [Task(id=f"t{i}", data={"prompt": f"add 2 and 3 ({i})"}) for i in range(3)]
    env = AgentEnvironment(agent, tasks=tasks)
    config = RolloutConfig(samples_per_task=2, concurrency=4, progress="off")
    async with backend, RolloutEngine(backend, env, config, tokenizer=tok) as engine:
        groups = [g async for g in engine.run_groups()]
        assert env.gateway is not None and env.gateway.finished == []  # nothing kept twice
    assert env.gateway is None  # closed with the engine
    assert sorted(len(g) for g in groups) == [2, 2, 2]
    prompts = {tuple(r.prompt_ids) for r in backend.requests}
    for group in groups:
        assert [t.sample_index for t in group] == [0, 1]
        assert len({t.task_id for t in group}) == 1
        for t in group:
            assert t.status == "ok" and t.reward == 1.0 and not t.forks
            assert len(t.turns) == 2
            ids = t.token_ids.tolist()
            # every request of this episode is a prefix of its tokens (token-in, token-out)
            mine = [p for p in prompts if list(p) == ids[: len(p)]]
            assert len(mine) == 2
            sampled = np.flatnonzero(t.loss_mask)
            assert len(sampled) == t.num_generated > 0
            assert not np.isnan(t.logprobs[sampled]).any()
            assert "5" in tok.decode(ids[t.turns[0].gen_end : t.turns[0].env_end])


async def test_a_failing_agent_is_data(tok: ChatTokenizer) -> None:
    """An agent that raises after its first call: the episode's sample is kept, failed,
    with the error; its sibling episodes are untouched."""

    async def flaky(task: Task, base_url: str, api_key: str) -> float:
        if task.id == "bad":
            client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
            messages = [{"role": "user", "content": "add"}]
            await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
            raise RuntimeError("the agent crashed")
        return await agent(task, base_url, api_key)

    backend = MockBackend(script, tokenizer=tok)
    tasks = [Task(id=i, data={"prompt": "add 2 and 3"}) for i in ("bad", "good")]
    config = RolloutConfig(concurrency=2, progress="off")
    async with backend, RolloutEngine(backend, AgentEnvironment(flaky), config, tokenizer=tok) as e:
        trajs = {t.task_id: t async for t in e.run(tasks)}
    bad, good = trajs["bad"], trajs["good"]
    assert bad.status == "failed" and "the agent crashed" in (bad.error or "")
    assert len(bad.turns) == 1 and bad.num_generated > 0
    assert good.status == "ok" and good.reward == 1.0 and good.error is None


async def test_an_agent_failing_before_its_first_call_says_why(tok: ChatTokenizer) -> None:
    """No model call means no tokens: the episode fails as data with the agent's own error
    (or, when it returned without calling, with that), never an engine internals error."""

    async def early(task: Task, base_url: str, api_key: str) -> float:
        if task.id == "raises":
            raise RuntimeError("no API key configured")
        return 1.0  # returns without a model call

    backend = MockBackend(script, tokenizer=tok)
    tasks = [Task(id=i, data={"prompt": "add"}) for i in ("raises", "silent")]
    config = RolloutConfig(concurrency=2, progress="off")
    async with backend, RolloutEngine(backend, AgentEnvironment(early), config, tokenizer=tok) as e:
        trajs = {t.task_id: t async for t in e.run(tasks)}
    assert trajs["raises"].status == "failed"
    assert "RuntimeError: no API key configured" in (trajs["raises"].error or "")
    assert trajs["silent"].status == "failed"
    assert "made no model call" in (trajs["silent"].error or "")
    assert all(t.num_tokens == 0 for t in trajs.values())
