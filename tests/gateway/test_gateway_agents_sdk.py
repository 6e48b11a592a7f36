"""The gateway driven by the OpenAI Agents SDK (``agents.Runner`` over a Chat Completions
model): the SDK runs the tool with the arguments the backend sampled, and the published
trajectory holds the sampled tokens, the tool's output and the reward."""

from __future__ import annotations

import asyncio
import json

import agents
import openai
import pytest
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
from gateway_helpers import (
    ANSWER,
    CALL_ADD,
    Recorder,
    aend_session,
    aopen_session,
    check_session,
    env_text,
    forbid_internet,
    gateway_on_loop,
    mock_logprob,
    script_ids,
)

from agentroll.backends.base import GenerationRequest
from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer

agents.set_tracing_disabled(True)  # the SDK would upload traces to OpenAI


@pytest.fixture(autouse=True)
def _no_internet(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_internet(monkeypatch)


def multiply_script(request: GenerationRequest) -> str:
    if request.turn_index == 0:
        return '<tool_call>{"name": "multiply", "arguments": {"x": 6, "y": 7}}</tool_call>'
    return "It is 42."


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_agent_runs_its_tool_through_the_gateway(tok: ChatTokenizer, streamed: bool) -> None:
    executed: list[tuple[int, int]] = []

    @function_tool
    def multiply(x: int, y: int) -> str:
        """Multiply two integers."""
        executed.append((x, y))
        return f"product={x * y}"

    recorder = Recorder()
    backend = recorder.attach(MockBackend(multiply_script, tokenizer=tok, chunk_size=3))
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url, task_id="multiply")
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
        agent = Agent(
            name="calculator",
            instructions="Use the multiply tool.",
            tools=[multiply],
            model=OpenAIChatCompletionsModel(model="m", openai_client=client),
        )
        if streamed:
            run = Runner.run_streamed(agent, "What is 6 times 7?")
            async for _event in run.stream_events():
                pass
            final = run.final_output
        else:
            final = (await Runner.run(agent, "What is 6 times 7?")).final_output
        await aend_session(url, sid, reward=1.0)
        (traj,) = gw.finished
    assert final == "It is 42."
    assert executed == [(6, 7)]  # the SDK ran the call the backend sampled, with its arguments
    assert traj.status == "ok" and not traj.forks and len(traj.turns) == 2
    check_session([traj], recorder.generations, logprob_of=mock_logprob)
    first, second = traj.turns
    sampled = traj.token_ids[first.gen_start : first.gen_end].tolist()
    assert sampled == script_ids(tok, multiply_script(recorder.generations[0].request))
    assert traj.token_ids[second.gen_start :].tolist() == script_ids(tok, "It is 42.")
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("multiply", {"x": 6, "y": 7})]
    assert "product=42" in env_text(tok, traj, 0)
    roles = [m.role for m in traj.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    tool_msg = traj.messages[3]
    assert tool_msg.content == "product=42" and tool_msg.tool_call_id == first.tool_calls[0].id
    assert traj.messages[0].content == "Use the multiply tool."
    assert traj.reward == 1.0


async def test_agent_with_two_sessions_keeps_them_apart(tok: ChatTokenizer) -> None:
    """Two agents at once, one session each (by API key): each trajectory holds only its
    own calls."""

    @function_tool
    def add(a: int, b: int) -> str:
        """Add two integers."""
        return json.dumps({"sum": a + b})

    def script(request: GenerationRequest) -> str:
        return CALL_ADD if request.turn_index == 0 else ANSWER

    recorder = Recorder()
    backend = recorder.attach(MockBackend(script, tokenizer=tok, chunk_size=1))
    async with gateway_on_loop(backend) as (gw, url):
        sids = [await aopen_session(url, task_id=f"t{k}") for k in range(2)]

        async def run(sid: str, question: str) -> str:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
            agent = Agent(
                name="adder",
                tools=[add],
                model=OpenAIChatCompletionsModel(model="m", openai_client=client),
            )
            return str((await Runner.run(agent, question)).final_output)

        finals = await asyncio.gather(run(sids[0], "2+3?"), run(sids[1], "two plus three?"))
        for k, sid in enumerate(sids):
            await aend_session(url, sid, reward=float(k))
        trajs = {t.id: t for t in gw.finished}
    assert finals == [ANSWER, ANSWER]
    for k, sid in enumerate(sids):
        traj = trajs[sid]
        assert traj.task_id == f"t{k}" and traj.reward == float(k) and len(traj.turns) == 2
        check_session([traj], recorder.of(sid), logprob_of=mock_logprob)
        assert '{"sum": 5}' in env_text(tok, traj, 0)
    assert len(recorder.generations) == 4
