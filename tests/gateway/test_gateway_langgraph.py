"""The gateway driven by a LangGraph ReAct agent over langchain-openai's ``ChatOpenAI``: the
graph runs the tool the backend called, and the published trajectory holds the sampled
tokens, the tool's output and the reward (a transcript of it is printed: run with -s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gateway_helpers import (
    ANSWER,
    CALL_ADD,
    TOOL_OUTPUT,
    Recorder,
    add_script,
    aend_session,
    aopen_session,
    check_session,
    end_session,
    env_text,
    forbid_internet,
    gateway_on_loop,
    mock_logprob,
    open_session,
    script_ids,
    served_gateway,
    transcript,
)
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer

# langgraph 1.x points to langchain.agents.create_agent; the prebuilt one is what the task uses
pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")


@pytest.fixture(autouse=True)
def _no_internet(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_internet(monkeypatch)


def make_add_tool(calls: list[tuple[int, int]]) -> Any:
    @tool
    def add(a: int, b: int) -> str:
        """Add two integers."""
        calls.append((a, b))
        return f"sum={a + b}"

    return add


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_react_agent_episode(tok: ChatTokenizer, streaming: bool) -> None:
    calls: list[tuple[int, int]] = []
    recorder = Recorder()
    make = lambda: recorder.attach(MockBackend(add_script, tokenizer=tok, chunk_size=4))  # noqa: E731
    with served_gateway(make) as served:
        sid = open_session(served.url, task_id="langgraph-add")
        llm = ChatOpenAI(
            base_url=f"{served.url}/v1",
            api_key=sid,  # type: ignore[arg-type]
            model="m",
            max_retries=0,
            streaming=streaming,
        )
        agent = create_react_agent(llm, tools=[make_add_tool(calls)])
        out = agent.invoke({"messages": [("user", "add 2 and 3")]})
        end_session(served.url, sid, reward=1.0)
        assert served.gateway is not None
        (traj,) = served.gateway.finished
    messages = out["messages"]
    assert calls == [(2, 3)]
    assert isinstance(messages[1], AIMessage) and messages[1].tool_calls[0]["args"] == {
        "a": 2,
        "b": 3,
    }
    assert isinstance(messages[2], ToolMessage) and messages[2].content == TOOL_OUTPUT
    assert messages[-1].content == ANSWER
    print(f"\nLangGraph episode ({'streamed' if streaming else 'whole'} calls):")
    print(transcript(tok, traj))
    assert traj.status == "ok" and not traj.forks and len(traj.turns) == 2
    check_session([traj], recorder.generations, logprob_of=mock_logprob)
    for turn, text in zip(traj.turns, (CALL_ADD, ANSWER), strict=True):
        assert traj.token_ids[turn.gen_start : turn.gen_end].tolist() == script_ids(tok, text)
    assert TOOL_OUTPUT in env_text(tok, traj, 0)
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[2].content == TOOL_OUTPUT
    assert traj.messages[2].tool_call_id == traj.turns[0].tool_calls[0].id
    assert traj.reward == 1.0 and traj.rewards == {"reward": 1.0}


async def test_react_agent_on_the_engine(tiny_model: Path) -> None:
    """The built-in engine with the tiny model: random text, so no tool call; the token
    invariants hold on what it sampled."""
    from agentroll.backends.torch import TorchBackend

    calls: list[tuple[int, int]] = []
    recorder = Recorder()
    backend = recorder.attach(TorchBackend(tiny_model))
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url, task_id="langgraph-engine")
        llm = ChatOpenAI(
            base_url=f"{url}/v1",
            api_key=sid,  # type: ignore[arg-type]
            model="m",
            max_retries=0,
            max_tokens=12,  # type: ignore[call-arg]
        )
        agent = create_react_agent(llm, tools=[make_add_tool(calls)])
        out = await agent.ainvoke({"messages": [("user", "add 2 and 3")]})
        await aend_session(url, sid, reward=0.0)
        (traj,) = gw.finished
    print("\nLangGraph episode on the tiny engine:")
    print(transcript(tok=backend.tokenizer, traj=traj))
    assert isinstance(out["messages"][-1], AIMessage)
    assert traj.status == "ok" and not traj.forks and traj.turns
    check_session([traj], recorder.generations)
    assert len(traj.turns) == len(recorder.generations)
    for turn in traj.turns:
        assert 1 <= turn.gen_end - turn.gen_start <= 12
    sampled = traj.loss_mask == 1
    assert (traj.policy_version[sampled] == 0).all() and (traj.kv_version[sampled] == 0).all()
