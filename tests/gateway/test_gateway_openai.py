"""The gateway driven by the real openai client (sync and async, streamed and not): every
published trajectory holds exactly the tokens the backend sampled, with their logprobs and
versions, the tool results the agent sent, and the reward it posted; sessions by path or by
API key, n > 1, the Completions API, forks, idle sessions and groups."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from gateway_helpers import (
    ANSWER,
    CALL_ADD,
    TOOL_OUTPUT,
    TOOLS,
    PacedMock,
    Recorder,
    add_script,
    aend_session,
    aopen_session,
    check_session,
    end_session,
    env_text,
    forbid_internet,
    gateway_on_loop,
    message_of,
    mock_logprob,
    open_session,
    script_ids,
    served_gateway,
)

from agentroll.backends.base import GenerationRequest
from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.gateway import GatewayConfig
from agentroll.types import Trajectory


@pytest.fixture(autouse=True)
def _no_internet(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_internet(monkeypatch)


def reply_of(reply: Any) -> tuple[dict[str, Any], str | None, list[float]]:
    choice = reply.choices[0]
    entries = choice.logprobs.content if choice.logprobs is not None else None
    return (
        choice.message.model_dump(exclude_none=True),
        choice.finish_reason,
        [e.logprob for e in entries or []],
    )


def call_sync(
    client: openai.OpenAI, messages: list[dict[str, Any]], *, stream: bool, logprobs: bool
) -> tuple[dict[str, Any], str | None, list[float]]:
    kwargs: dict[str, Any] = {"model": "m", "messages": messages, "tools": TOOLS}
    if logprobs:
        kwargs["logprobs"] = True
    if stream:
        return message_of(list(client.chat.completions.create(stream=True, **kwargs)))
    return reply_of(client.chat.completions.create(**kwargs))


async def call_async(
    client: openai.AsyncOpenAI, messages: list[dict[str, Any]], *, stream: bool, logprobs: bool
) -> tuple[dict[str, Any], str | None, list[float]]:
    kwargs: dict[str, Any] = {"model": "m", "messages": messages, "tools": TOOLS}
    if logprobs:
        kwargs["logprobs"] = True
    if stream:
        events = await client.chat.completions.create(stream=True, **kwargs)
        return message_of([c async for c in events])
    return reply_of(await client.chat.completions.create(**kwargs))


def first_messages() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2+3?"}]


def after_tool_call(messages: list[dict[str, Any]], reply: dict[str, Any]) -> None:
    """Check the model's tool call and append it and the tool's result, as an agent does."""
    (call,) = reply["tool_calls"]
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    messages += [reply, {"role": "tool", "tool_call_id": call["id"], "content": TOOL_OUTPUT}]


def check_tool_episode(
    tok: ChatTokenizer,
    traj: Trajectory,
    recorder: Recorder,
    *,
    reward: float,
    logprobs: list[list[float]] | None = None,
) -> None:
    """The trajectory of a ``first_messages`` episode: tool call, result, answer."""
    assert traj.status == "ok" and not traj.forks
    check_session([traj], recorder.generations, logprob_of=mock_logprob)
    assert len(traj.turns) == 2
    for turn, text in zip(traj.turns, (CALL_ADD, ANSWER), strict=True):
        assert traj.token_ids[turn.gen_start : turn.gen_end].tolist() == script_ids(tok, text)
    assert [(c.name, c.arguments) for c in traj.turns[0].tool_calls] == [("add", {"a": 2, "b": 3})]
    assert TOOL_OUTPUT in env_text(tok, traj, 0)
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert traj.messages[3].content == TOOL_OUTPUT and traj.messages[4].content == ANSWER
    assert traj.reward == reward and traj.rewards == {"reward": reward}
    if logprobs is not None:  # what the client was told equals what the trajectory holds
        for turn, lps in zip(traj.turns, logprobs, strict=True):
            want = traj.logprobs[turn.gen_start : turn.gen_end]
            np.testing.assert_array_equal(np.array(lps, dtype=np.float32), want)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("by", ["path", "api_key"])
def test_sync_client_runs_a_tool_episode(tok: ChatTokenizer, stream: bool, by: str) -> None:
    recorder = Recorder()
    make = lambda: recorder.attach(MockBackend(add_script, tokenizer=tok, chunk_size=3))  # noqa: E731
    with served_gateway(make) as served:
        sid = open_session(served.url, task_id="add")
        if by == "path":
            client = openai.OpenAI(base_url=f"{served.url}/sessions/{sid}/v1", api_key="x")
        else:
            client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=sid)
        messages = first_messages()
        reply, finish, lps0 = call_sync(client, messages, stream=stream, logprobs=True)
        assert finish == "tool_calls" and not reply.get("content")
        after_tool_call(messages, reply)
        reply, finish, lps1 = call_sync(client, messages, stream=stream, logprobs=True)
        assert finish == "stop" and reply["content"] == ANSWER
        end_session(served.url, sid, reward=0.5)
        assert served.gateway is not None
        (traj,) = served.gateway.finished
    assert traj.id == sid and traj.task_id == "add"
    check_tool_episode(tok, traj, recorder, reward=0.5, logprobs=[lps0, lps1])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("by", ["path", "api_key"])
async def test_async_client_runs_a_tool_episode(tok: ChatTokenizer, stream: bool, by: str) -> None:
    recorder = Recorder()
    backend = recorder.attach(MockBackend(add_script, tokenizer=tok, chunk_size=2))
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url, task_id="add")
        base = f"{url}/sessions/{sid}/v1" if by == "path" else f"{url}/v1"
        client = openai.AsyncOpenAI(base_url=base, api_key="x" if by == "path" else sid)
        messages = first_messages()
        reply, finish, lps0 = await call_async(client, messages, stream=stream, logprobs=True)
        assert finish == "tool_calls"
        after_tool_call(messages, reply)
        reply, finish, lps1 = await call_async(client, messages, stream=stream, logprobs=True)
        assert finish == "stop" and reply["content"] == ANSWER
        await aend_session(url, sid, reward=1.0)
        (traj,) = gw.finished
    check_tool_episode(tok, traj, recorder, reward=1.0, logprobs=[lps0, lps1])


async def test_logprob_entries_name_the_sampled_tokens(tok: ChatTokenizer) -> None:
    recorder = Recorder()
    backend = recorder.attach(MockBackend(["Hi there, friend."], tokenizer=tok))
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid)
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello"}], logprobs=True
        )
        await aend_session(url, sid)
        (traj,) = gw.finished
    entries = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    turn = traj.turns[0]
    ids = traj.token_ids[turn.gen_start : turn.gen_end].tolist()
    assert ids == script_ids(tok, "Hi there, friend.")
    assert entries is not None and len(entries) == len(ids)
    for entry, tid, lp in zip(entries, ids, traj.logprobs[turn.gen_start :], strict=True):
        assert entry.token == tok.decode([tid], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
        assert np.float32(entry.logprob) == lp
    extra = reply.choices[0].model_extra or {}
    assert extra["token_ids"] == ids
    assert (reply.model_extra or {})["prompt_token_ids"] == traj.token_ids[
        : turn.gen_start
    ].tolist()


async def test_n_choices_fork_samples(tok: ChatTokenizer) -> None:
    recorder = Recorder()
    backend = recorder.attach(MockBackend(["Four.", "Five."], tokenizer=tok, chunk_size=1))
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url)
        client = openai.AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="x")
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "2+2?"}], n=2
        )
        assert [c.index for c in reply.choices] == [0, 1]
        assert [c.message.content for c in reply.choices] == ["Four.", "Four."]
        await aend_session(url, sid, reward=0.25)
        trajs = sorted(gw.finished, key=lambda t: t.id)
    assert [t.id for t in trajs] == [sid, f"{sid}-1"]
    first, second = trajs
    assert not first.forks and first.stop_reason == "ended"  # a choice supersedes nothing
    (fork,) = second.forks
    assert (fork.reason, fork.from_sample, fork.at_call) == ("n", 0, 0)
    assert (
        fork.common_tokens == first.prompt_len == second.prompt_len and not fork.mismatched_tokens
    )
    check_session(trajs, recorder.generations, logprob_of=mock_logprob)
    for traj in trajs:
        assert traj.token_ids[traj.prompt_len :].tolist() == script_ids(tok, "Four.")
        assert traj.reward == 0.25
    seeds = {g.request.sampling.seed for g in recorder.generations}
    assert len(recorder.generations) == 2 and len(seeds) == 2  # two samples, not one copied


def reply_script(request: GenerationRequest) -> str:
    return f"reply {request.turn_index}"


async def test_completions_with_token_ids_extend_the_sample(tok: ChatTokenizer) -> None:
    recorder = Recorder()
    backend = recorder.attach(MockBackend(reply_script, tokenizer=tok))
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid)
        prompt = tok.encode("Question one?")
        first = await client.completions.create(model="m", prompt=prompt)
        sampled = (first.choices[0].model_extra or {})["token_ids"]
        assert sampled == script_ids(tok, "reply 0") and first.choices[0].text == "reply 0"
        more = tok.encode(" Question two?")
        prompt2 = prompt + sampled + more
        second = await client.completions.create(model="m", prompt=prompt2)
        assert second.choices[0].text == "reply 1"
        assert (second.model_extra or {})["prompt_token_ids"] == prompt2
        await aend_session(url, sid, reward=2.0)
        (traj,) = gw.finished
    assert traj.token_ids.tolist() == prompt2 + script_ids(tok, "reply 1")
    assert traj.prompt_len == len(prompt) and not traj.forks and len(traj.turns) == 2
    assert env_text(tok, traj, 0) == " Question two?"
    check_session([traj], recorder.generations, logprob_of=mock_logprob)
    assert traj.reward == 2.0


async def test_completions_with_text_prompts(tok: ChatTokenizer) -> None:
    recorder = Recorder()
    backend = recorder.attach(MockBackend(reply_script, tokenizer=tok, chunk_size=2))
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url)
        client = openai.AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="x")
        first = await client.completions.create(model="m", prompt="Hello there")
        assert (first.model_extra or {})["prompt_token_ids"] == tok.encode("Hello there")
        assert first.choices[0].text == "reply 0"
        # a text that is not the sample's tokens plus more: a new sample, recorded
        await client.completions.create(model="m", prompt="Goodbye")
        await aend_session(url, sid)
        trajs = sorted(gw.finished, key=lambda t: t.id)
    assert [t.token_ids.tolist() for t in trajs] == [
        tok.encode("Hello there") + script_ids(tok, "reply 0"),
        tok.encode("Goodbye") + script_ids(tok, "reply 1"),
    ]
    (fork,) = trajs[1].forks
    assert fork.reason == "history_edited" and fork.mismatched_tokens > 0
    assert trajs[0].stop_reason == "forked"
    check_session(trajs, recorder.generations, logprob_of=mock_logprob)


@pytest.mark.parametrize("edit", ["edit_user", "drop_assistant"])
async def test_edited_history_forks_and_never_drifts(tok: ChatTokenizer, edit: str) -> None:
    recorder = Recorder()
    backend = recorder.attach(MockBackend(add_script, tokenizer=tok, chunk_size=4))
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid)
        messages = first_messages()
        reply, _, _ = await call_async(client, messages, stream=False, logprobs=False)
        after_tool_call(messages, reply)
        reply, _, _ = await call_async(client, messages, stream=True, logprobs=False)
        assert reply["content"] == ANSWER
        if edit == "edit_user":
            messages[1] = {"role": "user", "content": "2+3, please?"}
        # drop_assistant: the last answer is left out, the call is asked again
        reply, _, _ = await call_async(client, messages, stream=False, logprobs=False)
        assert reply["content"] == ANSWER
        async with httpx.AsyncClient() as http:
            described = (await http.get(f"{url}/sessions/{sid}")).json()
        await aend_session(url, sid, reward=1.0)
        trajs = sorted(gw.finished, key=lambda t: t.id)
    assert len(trajs) == 2
    original, forked = trajs
    (fork,) = forked.forks
    assert (fork.reason, fork.from_sample, fork.at_call) == ("history_edited", 0, 2)
    assert fork.mismatched_tokens > 0
    assert fork.common_tokens + fork.mismatched_tokens == original.num_tokens
    assert described["forks"] == 1 and described["mismatched_tokens"] == fork.mismatched_tokens
    assert original.stop_reason == "forked" and not original.forks
    check_session(trajs, recorder.generations, logprob_of=mock_logprob)
    gens = recorder.generations
    assert len(gens) == 3
    # the first sample is what the first two calls made, untouched by the fork
    assert original.token_ids.tolist() == gens[1].prompt + gens[1].ids
    # the fork is a fresh rendering of the edited conversation, sharing only a prefix
    assert forked.token_ids.tolist() == gens[2].prompt + script_ids(tok, ANSWER)
    common = fork.common_tokens
    a, b = original.token_ids.tolist(), forked.token_ids.tolist()
    assert a[:common] == b[:common] and a[common] != b[common]
    assert len(forked.turns) == 1 and forked.prompt_len == len(gens[2].prompt)
    assert [m.role for m in forked.messages] == ["system", "user", "assistant", "tool", "assistant"]


async def test_refused_fork_keeps_the_session(tok: ChatTokenizer) -> None:
    recorder = Recorder()
    backend = recorder.attach(MockBackend(add_script, tokenizer=tok))
    config = GatewayConfig(fork_policy="refuse")
    async with gateway_on_loop(backend, config) as (gw, url):
        sid = await aopen_session(url)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
        messages = first_messages()
        reply, _, _ = await call_async(client, messages, stream=False, logprobs=False)
        after_tool_call(messages, reply)
        edited = [messages[0], {"role": "user", "content": "edited"}, *messages[2:]]
        with pytest.raises(openai.ConflictError) as err:
            await call_async(client, edited, stream=False, logprobs=False)
        assert err.value.code == "history_rewritten"
        assert "send the messages as returned" in err.value.message
        reply, _, _ = await call_async(client, messages, stream=False, logprobs=False)
        assert reply["content"] == ANSWER
        await aend_session(url, sid)
        (traj,) = gw.finished
    assert not traj.forks and len(traj.turns) == 2
    check_session([traj], recorder.generations, logprob_of=mock_logprob)


async def test_idle_session_is_published_abandoned(tok: ChatTokenizer) -> None:
    published: list[list[Trajectory]] = []
    arrived = asyncio.Event()

    async def publish(trajs: list[Trajectory]) -> None:
        published.append(trajs)
        arrived.set()

    recorder = Recorder()
    backend = recorder.attach(MockBackend(add_script, tokenizer=tok))
    config = GatewayConfig(idle_timeout=0.2)
    async with gateway_on_loop(backend, config, publish=publish) as (_gw, url):
        sid = await aopen_session(url, task_id="idle")
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
        reply, _, _ = await call_async(client, first_messages(), stream=False, logprobs=False)
        assert reply["tool_calls"]
        await asyncio.wait_for(arrived.wait(), 10)
        with pytest.raises(openai.ConflictError) as err:  # the agent comes back too late
            await call_async(client, first_messages(), stream=False, logprobs=False)
        assert err.value.code == "session_ended"
    ((traj,),) = published
    assert traj.id == sid and traj.status == "abandoned" and traj.stop_reason == "idle_timeout"
    assert len(traj.turns) == 1
    check_session([traj], recorder.generations, logprob_of=mock_logprob)


async def test_group_is_published_together(tok: ChatTokenizer) -> None:
    published: list[list[Trajectory]] = []

    async def publish(trajs: list[Trajectory]) -> None:
        published.append(trajs)

    recorder = Recorder()
    backend = recorder.attach(MockBackend(add_script, tokenizer=tok, chunk_size=5))
    async with gateway_on_loop(backend, publish=publish) as (_gw, url):
        sids = [await aopen_session(url, task_id="t", group_id="g", group_size=3) for _ in range(3)]
        async with httpx.AsyncClient() as http:
            full = await http.post(f"{url}/sessions", json={"group_id": "g", "group_size": 3})
        assert full.status_code == 409 and "new group id" in full.json()["error"]["message"]

        async def episode(sid: str) -> None:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid)
            messages = first_messages()
            reply, _, _ = await call_async(client, messages, stream=True, logprobs=False)
            after_tool_call(messages, reply)
            await call_async(client, messages, stream=False, logprobs=False)

        await asyncio.gather(*(episode(sid) for sid in sids))
        for k, sid in enumerate(sids):
            await aend_session(url, sid, reward=float(k))
            assert len(published) == (1 if k == 2 else 0)
    (group,) = published
    assert sorted(t.id for t in group) == sorted(sids)
    assert {t.group_id for t in group} == {"g"} and {t.task_id for t in group} == {"t"}
    assert sorted(t.sample_index for t in group) == [0, 1, 2]
    for traj in group:
        check_tool_episode(tok, traj, recorder, reward=float(sids.index(traj.id)))


@pytest.mark.slow
async def test_engine_episode_keeps_the_sampled_tokens(tiny_model: Path) -> None:
    """The built-in engine with the tiny model (random text): the token invariants hold
    over whole, streamed and n=1 calls, and the client's logprobs are the trajectory's."""
    from agentroll.backends.torch import TorchBackend

    recorder = Recorder()
    backend = recorder.attach(TorchBackend(tiny_model))
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url, task_id="engine")
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
        told: list[list[float]] = []
        for k in range(3):
            kwargs: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 8}
            if k == 1:
                events = await client.chat.completions.create(stream=True, logprobs=True, **kwargs)
                reply, _, lps = message_of([c async for c in events])
            else:
                reply, _, lps = reply_of(
                    await client.chat.completions.create(logprobs=True, **kwargs)
                )
            told.append(lps)
            messages += [reply, {"role": "user", "content": f"go on {k}"}]
        await aend_session(url, sid, reward=0.5)
        (traj,) = gw.finished
    assert not traj.forks and len(traj.turns) == 3 and traj.reward == 0.5
    check_session([traj], recorder.generations)
    assert len(recorder.generations) == 3
    for turn, lps in zip(traj.turns, told, strict=True):
        assert 1 <= turn.gen_end - turn.gen_start <= 8
        want = traj.logprobs[turn.gen_start : turn.gen_end]
        np.testing.assert_array_equal(np.array(lps, dtype=np.float32), want)
    sampled = traj.loss_mask == 1
    assert (traj.policy_version[sampled] == 0).all() and (traj.kv_version[sampled] == 0).all()
    assert (traj.logprobs[sampled] <= 0).all()


async def test_streamed_text_arrives_while_it_is_sampled(tok: ChatTokenizer) -> None:
    """Text goes out as it decodes, with the ids, versions and logprobs of the tokens it came
    from; each token is carried by exactly one event."""
    text = " ".join(f"word{k}" for k in range(10))
    backend = PacedMock([text], tokenizer=tok, chunk_size=1, pace=0.01)
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
        events = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "talk"}], stream=True, logprobs=True
        )
        deltas: list[str] = []
        running: list[bool] = []
        ids: list[int] = []
        versions: list[int] = []
        lps: list[float] = []
        async for chunk in events:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.delta.content:
                deltas.append(choice.delta.content)
                running.append(set(backend.outcomes.values()) == {"running"})
            extra = choice.model_extra or {}
            ids += extra.get("token_ids") or []  # each event: the tokens it newly covers
            versions += extra.get("policy_version") or []
            if choice.logprobs is not None and choice.logprobs.content:
                lps += [e.logprob for e in choice.logprobs.content]
        await aend_session(url, sid)
        (traj,) = gw.finished
    assert "".join(deltas) == text
    assert len(deltas) > 1 and running[0]  # text came while the backend still sampled
    turn = traj.turns[0]
    sampled = traj.token_ids[turn.gen_start : turn.gen_end].tolist()
    assert ids == sampled  # joined over the events: the turn, the end-of-turn token too
    assert versions == traj.policy_version[turn.gen_start : turn.gen_end].tolist()
    np.testing.assert_array_equal(
        np.array(lps, dtype=np.float32), traj.logprobs[turn.gen_start : turn.gen_end]
    )
