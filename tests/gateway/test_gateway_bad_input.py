"""Bad input over real HTTP (httpx and raw sockets): every refusal is a 4xx with an
OpenAI-style JSON error whose message says what to change, oversized bodies and heads are
refused before they are read, a client that leaves mid-call aborts its generation, and the
gateway goes on serving: the same session and new ones still work afterwards."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from gateway_helpers import (
    ANSWER,
    TOOLS,
    PacedMock,
    Recorder,
    aend_session,
    aopen_session,
    check_session,
    forbid_internet,
    gateway_on_loop,
    message_of,
    mock_logprob,
    script_ids,
)

from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.gateway import Gateway, GatewayConfig
from agentroll.gateway.wire import ChatRequest

USER: Any = {"role": "user", "content": "hi"}
TOOL = TOOLS[0]


@pytest.fixture(autouse=True)
def _no_internet(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_internet(monkeypatch)


def check_error(reply: httpx.Response, status: int, hint: str) -> dict[str, Any]:
    """An OpenAI-style error body: exactly message, type, param, code; the message says
    what to change (``hint``)."""
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert hint in error["message"], error["message"]
    assert error["type"] in ("invalid_request_error", "rate_limit_error")
    return dict(error)


def banana(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# (body, the param named, words of the message that say what to change)
CHAT_CASES: dict[str, tuple[Any, str | None, str]] = {
    "not_json": (b'{"messages": [', None, "not valid JSON"),
    "not_an_object": (b"[1, 2]", None, "Expected `object`"),
    "messages_not_a_list": ({"messages": "hi"}, "messages", "Expected `array`"),
    "empty": ({"messages": []}, "messages", "send at least one message"),
    "unknown_role": (
        {"messages": [{"role": "wizard", "content": "x"}]},
        "messages[0].role",
        "use one of",
    ),
    "tool_without_call_id": (
        {"messages": [USER, {"role": "tool", "content": "5"}]},
        "messages[1]",
        "needs a string tool_call_id",
    ),
    "only_system": (
        {"messages": [{"role": "system", "content": "Be brief."}]},
        "messages",
        "add a user message",
    ),
    "schema_type_banana": (
        {"messages": [USER], "tools": [banana({"type": "banana"})]},
        "tools[0].function.parameters",
        "is not a JSON Schema type (use one of",
    ),
    "schema_nested_banana": (
        {
            "messages": [USER],
            "tools": [banana({"type": "object", "properties": {"a": {"type": "banana"}}})],
        },
        "tools[0].function.parameters.properties.a",
        "is not a JSON Schema type",
    ),
    "parameters_a_list": (
        {"messages": [USER], "tools": [banana([{"type": "object"}])]},
        "tools[0].function.parameters",
        "Expected `object`, got `array`",
    ),
    "not_a_function_tool": (
        {"messages": [USER], "tools": [{"type": "code_interpreter"}]},
        "tools[0].type",
        "only function tools are supported",
    ),
    "n_with_tools": ({"messages": [USER], "n": 2, "tools": [TOOL]}, "n", "one call per choice"),
    "n_with_stream": ({"messages": [USER], "n": 2, "stream": True}, "n", "make n calls"),
    "n_too_large": ({"messages": [USER], "n": 99}, "n", "use 1 to 16"),
    "image": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                    ],
                }
            ]
        },
        "messages[0].content",
        "only text parts are supported",
    ),
    "top_logprobs": (
        {"messages": [USER], "logprobs": True, "top_logprobs": 3},
        "top_logprobs",
        "set logprobs=true and top_logprobs=0",
    ),
    "tool_choice_required": (
        {"messages": [USER], "tools": [TOOL], "tool_choice": "required"},
        "tool_choice",
        "use 'auto'",
    ),
    "temperature": ({"messages": [USER], "temperature": 7}, "temperature", "use 0.0 to 2.0"),
    "max_tokens_over_limit": ({"messages": [USER], "max_tokens": 10**6}, "max_tokens", "fewer"),
    "penalty": ({"messages": [USER], "presence_penalty": 1.0}, "presence_penalty", "set it to 0"),
    "json_mode": (
        {"messages": [USER], "response_format": {"type": "json_object"}},
        "response_format",
        "leave it out",
    ),
    "bad_tool_call_arguments": (
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                },
            ]
        },
        "messages[1].tool_calls",
        "is not valid JSON",
    ),
}

COMPLETION_CASES: dict[str, tuple[Any, str | None, str]] = {
    "empty_prompt": ({"prompt": ""}, "prompt", "the prompt is empty"),
    "ids_out_of_vocab": ({"prompt": [1, 10**9]}, "prompt", "list of token ids in [0, "),
    "mixed_prompt": ({"prompt": [1, "a"]}, "prompt", "list of token ids"),
    "batch": ({"prompt": ["a", "b"]}, "prompt", "send a batch as several calls"),
    "stream": ({"prompt": "a", "stream": True}, "stream", "stream=false"),
    "no_prompt": ({"model": "m"}, None, "missing required field `prompt`"),
}


async def test_bad_requests_get_openai_errors_and_the_gateway_goes_on(tok: ChatTokenizer) -> None:
    recorder = Recorder()
    backend = recorder.attach(MockBackend([ANSWER], tokenizer=tok))
    async with gateway_on_loop(backend) as (gw, url), httpx.AsyncClient(timeout=10) as http:
        sid = await aopen_session(url)
        chat = f"{url}/sessions/{sid}/v1/chat/completions"
        for name, (body, param, hint) in CHAT_CASES.items():
            if isinstance(body, bytes):
                reply = await http.post(chat, content=body)
            else:
                reply = await http.post(chat, json=body)
            error = check_error(reply, 400, hint)
            assert error["param"] == param, (name, error)
        for name, (body, param, hint) in COMPLETION_CASES.items():
            reply = await http.post(f"{url}/v1/completions", json=body, headers=_key(sid))
            error = check_error(reply, 400, hint)
            assert error["param"] == param, (name, error)
        # naming a session that is not there
        unknown = await http.post(f"{url}/sessions/nope/v1/chat/completions", json={})
        assert check_error(unknown, 404, "create one with POST /sessions")["code"] == (
            "unknown_session"
        )
        keyless = await http.post(f"{url}/v1/chat/completions", json={"messages": [USER]})
        assert check_error(keyless, 401, "send the session id as the API key")["code"] == (
            "no_session"
        )
        check_error(await http.get(f"{url}/sessions/{sid}/v1/nowhere"), 404, "no route")
        check_error(await http.get(chat), 405, "use POST")
        no_reward = await http.post(f"{url}/sessions/{sid}/reward", json={"rewards": {}})
        check_error(no_reward, 400, "give a finite reward")
        check_error(
            await http.post(f"{url}/sessions", json={"group_size": -1}), 400, "must be >= 0"
        )
        # none of it touched the session: its first real call is its first turn
        assert not recorder.generations and not gw.session(sid).capture.samples
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
        answer = await client.chat.completions.create(model="m", messages=[USER])
        assert answer.choices[0].message.content == ANSWER
        await aend_session(url, sid, reward=1.0)
        ended = await http.post(chat, json={"messages": [USER]})
        assert check_error(ended, 409, "create a new one with POST /sessions")["code"] == (
            "session_ended"
        )
        # another session works as well
        other = await aopen_session(url)
        answer = await openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=other, max_retries=0
        ).chat.completions.create(model="m", messages=[USER])
        assert answer.choices[0].message.content == ANSWER
        await aend_session(url, other)
        trajs = {t.id: t for t in gw.finished}
    assert len(trajs[sid].turns) == 1 and trajs[sid].reward == 1.0 and not trajs[sid].forks
    check_session([trajs[sid]], recorder.generations, logprob_of=mock_logprob)
    check_session([trajs[other]], recorder.generations, logprob_of=mock_logprob)


def _key(sid: str) -> dict[str, str]:
    return {"authorization": f"Bearer {sid}"}


async def raw_exchange(url: str, data: bytes, timeout: float = 5.0) -> tuple[int, bytes, bytes]:
    """Send ``data`` on a new connection and read one response: its status, head and body
    (by its content-length)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            head = await reader.readuntil(b"\r\n\r\n")
            fields = dict(
                line.split(b": ", 1) for line in head.strip().split(b"\r\n")[1:] if b": " in line
            )
            body = await reader.readexactly(int(fields[b"content-length"]))
    finally:
        writer.close()
    return int(head.split(b" ", 2)[1]), head, body


def _post_head(path: str, *lines: str) -> bytes:
    return ("\r\n".join([f"POST {path} HTTP/1.1", "host: gateway", *lines]) + "\r\n\r\n").encode()


async def test_oversized_body_is_refused_before_it_is_read(tok: ChatTokenizer) -> None:
    backend = MockBackend([ANSWER], tokenizer=tok)
    config = GatewayConfig(max_body_bytes=4096)
    async with gateway_on_loop(backend, config) as (_gw, url):
        sid = await aopen_session(url)
        path = f"/sessions/{sid}/v1/chat/completions"
        # 100 MB declared, a few bytes sent: answered now, not after 100 MB (or a timeout)
        head = _post_head(path, "content-type: application/json", "content-length: 100000000")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        status, rhead, body = await raw_exchange(url, head + b'{"messages": [', timeout=3.0)
        assert loop.time() - t0 < 2.0
        assert status == 413 and b"application/json" in rhead
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "exceeds the 4096-byte limit" in error["message"]
        # a chunked body, undeclared, is cut off once it passes the limit
        chunk = b'{"messages": [' + b" " * 8000
        chunked = _post_head(path, "content-type: application/json", "transfer-encoding: chunked")
        data = chunked + b"%x\r\n%b\r\n0\r\n\r\n" % (len(chunk), chunk)
        status, rhead, body = await raw_exchange(url, data)
        assert (
            status == 413 and "exceeds the 4096-byte limit" in json.loads(body)["error"]["message"]
        )
        # the gateway goes on: the session answers a call of the right size
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
        reply = await client.chat.completions.create(model="m", messages=[USER])
        assert reply.choices[0].message.content == ANSWER


def _big_head(sid: str) -> bytes:
    return (
        _post_head(
            f"/sessions/{sid}/v1/chat/completions",
            "content-type: application/json",
            f"x-padding: {'a' * 70_000}",
            "content-length: 2",
        )
        + b"{}"
    )


async def test_oversized_head_is_refused(tok: ChatTokenizer) -> None:
    backend = MockBackend([ANSWER], tokenizer=tok)
    async with gateway_on_loop(backend) as (_gw, url):
        sid = await aopen_session(url)
        status, _head, body = await raw_exchange(url, _big_head(sid))
        assert status == 431 and body
        other = await aopen_session(url)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=other, max_retries=0)
        reply = await client.chat.completions.create(model="m", messages=[USER])
        assert reply.choices[0].message.content == ANSWER


async def test_oversized_head_gets_an_openai_error(tok: ChatTokenizer) -> None:
    backend = MockBackend([ANSWER], tokenizer=tok)
    async with gateway_on_loop(backend) as (_gw, url):
        sid = await aopen_session(url)
        status, head, body = await raw_exchange(url, _big_head(sid))
    assert status == 431
    assert b"application/json" in head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "send fewer or shorter headers" in error["message"]


LONG = " ".join(f"word{k}" for k in range(20))


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_client_leaving_mid_call_aborts_it(tok: ChatTokenizer, stream: bool) -> None:
    backend = PacedMock([LONG], tokenizer=tok, chunk_size=1, pace=0.02)
    recorder = Recorder()
    recorder.attach(backend)
    messages: list[Any] = [{"role": "system", "content": "Talk."}, USER]
    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url, task_id="leaver")
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps({"model": "m", "messages": messages, "stream": stream}).encode()
        head = _post_head(
            f"/sessions/{sid}/v1/chat/completions",
            "content-type: application/json",
            f"content-length: {len(body)}",
        )
        writer.write(head + body)
        await writer.drain()
        if stream:  # the first event (the role) comes before the first token
            async with asyncio.timeout(5):
                first = await reader.readuntil(b"\n\n")
            assert b"data: " in first and b'"role":"assistant"' in first
        await backend.wait_for(lambda: sum(backend.chunks.values()) >= 3)
        writer.close()  # the client leaves mid-generation
        await backend.wait_for(lambda: set(backend.outcomes.values()) == {"closed"})
        async with httpx.AsyncClient() as http:
            state = (await http.get(f"{url}/sessions/{sid}")).json()
        assert state["tokens"] == [] and gw.status()["calls_in_flight"] == 0
        # the agent retries the call: the session holds it as if the first try never was
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
        if stream:
            events = await client.chat.completions.create(
                model="m",
                messages=messages,
                stream=True,
            )
            reply, finish, _ = message_of([c async for c in events])
            content = reply["content"]
        else:
            whole = await client.chat.completions.create(model="m", messages=messages)
            content, finish = whole.choices[0].message.content, whole.choices[0].finish_reason
        assert (content, finish) == (LONG, "stop")
        await aend_session(url, sid, reward=1.0)
        (traj,) = gw.finished
    first_try, retry = recorder.generations
    assert first_try.outcome == "closed" and 3 <= len(first_try.chunks) < len(retry.chunks)
    assert retry.outcome == "finished" and first_try.prompt == retry.prompt
    assert len(traj.turns) == 1 and not traj.forks  # exactly one copy of the turn
    assert traj.token_ids.tolist() == retry.prompt + script_ids(tok, LONG)
    assert traj.num_generated == len(script_ids(tok, LONG))
    check_session([traj], recorder.generations, logprob_of=mock_logprob)
    assert [m.role for m in traj.messages] == ["system", "user", "assistant"]


async def test_a_stream_never_started_is_undone(tok: ChatTokenizer) -> None:
    """A client gone before its streamed response began: closing the unstarted events
    undoes the call, so the retry extends the session as if it had been the first."""
    backend = MockBackend([ANSWER], tokenizer=tok)
    async with backend, Gateway(backend) as gw:
        session = gw.open_session(task_id="early")
        request = ChatRequest(messages=[dict(USER)], stream=True)
        events = await gw.chat_stream(session, request)
        events.close()  # what the server does when the response is over
        assert [s.busy for s in session.capture.samples] == []
        retried = await gw.chat_stream(session, request)
        replies = [e async for e in retried]
        retried.close()  # iterated: settled by the events themselves
        await gw.end(session)
    assert replies[-1] == b"data: [DONE]\n\n"
    (traj,) = gw.finished
    assert not traj.forks and len(traj.turns) == 1


def test_resent_messages_are_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's memo checks only what a call adds to the messages of the one before;
    a changed message is checked again (and a bad one still refused)."""
    from agentroll.gateway import wire

    checked: list[int] = []
    real = wire.check_message
    monkeypatch.setattr(wire, "check_message", lambda m, i: (checked.append(i), real(m, i))[1])
    memo = wire.MessageMemo()
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    second = [*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    assert [m.content for m in wire.check_messages(first, memo)] == ["s", "u"]
    assert [m.content for m in wire.check_messages(second, memo)] == ["s", "u", "a", "v"]
    assert checked == [0, 1, 2, 3]
    edited = [second[0], {"role": "user", "content": "edited"}, *second[2:]]
    assert wire.check_messages(edited, memo)[1].content == "edited"
    assert checked[4:] == [1, 2, 3]
    with pytest.raises(wire.RequestError, match="role"):
        wire.check_messages([*edited, {"role": "robot", "content": "x"}], memo)


def test_the_memo_is_not_fooled_by_a_list_that_grows() -> None:
    """An in-process caller that appends to the same list for its next call."""
    from agentroll.gateway import wire

    memo = wire.MessageMemo()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "u"}]
    wire.check_messages(messages, memo)
    messages += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    assert [m.content for m in wire.check_messages(messages, memo)] == ["u", "a", "v"]
