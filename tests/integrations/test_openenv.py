"""OpenEnv integration against the installed openenv: its servers driven by the engine, an
agentroll environment driven by OpenEnv's own clients, and a server that misbehaves.

Servers run on 127.0.0.1 (ephemeral ports) in threads the tests start and stop
(``serve_app``); readiness is polled with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agentroll import GenerationRequest, MockBackend, RolloutConfig, RolloutEngine, Task
from agentroll.chat import ChatTokenizer

# a missing or broken [openenv] extra skips each test with why (a failure under
# AGENTROLL_REQUIRE=openenv), never a collection error that stops the whole suite
_WHY: str | None = None
try:
    from agentroll.integrations.openenv import OpenEnvEnvironment
    from agentroll.integrations.openenv_example import (
        SessionStats,
        create_example_app,
        question,
    )
    from agentroll.integrations.openenv_server import create_app, serve_app
except ImportError as exc:
    _WHY = f"openenv is not usable here: {exc}"

pytestmark = [pytest.mark.openenv, *([pytest.mark.skip(reason=_WHY)] if _WHY else [])]

CONFIG = RolloutConfig(concurrency=4, progress="off")


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def example() -> Iterator[tuple[str, SessionStats]]:
    stats = SessionStats()
    with serve_app(create_example_app(stats=stats)) as url:
        yield url, stats


def solver(tok: ChatTokenizer) -> Any:
    """Calls ``calc`` on the question, then ``submit`` with the result (wrong on odd
    tasks, so rewards differ)."""

    def policy(request: GenerationRequest) -> str:
        text = tok.decode(request.prompt_ids, skip_special_tokens=False)
        if request.turn_index == 0:
            return call("calc", expression=re.findall(r"What is (.+?)\?", text)[-1])
        value = float(re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)[-1])
        odd = int(re.findall(r"task (\d+)", text)[0]) % 2
        return call("submit", answer=value + odd)

    return policy


async def test_engine_drives_the_example_server(
    example: tuple[str, SessionStats], tok: ChatTokenizer
) -> None:
    url, stats = example
    opened = stats.opened
    tasks = [Task(id=f"t{i}", data={"prompt": f"task {i}", "reset": {}}) for i in range(4)]
    backend = MockBackend(solver(tok), tokenizer=tok, record=True)
    async with OpenEnvEnvironment(url, tasks=tasks, timeout=10) as env:
        specs = {s.name: s for s in env.tool_specs}
        assert set(specs) == {"calc", "submit"}
        assert specs["submit"].parameters["properties"]["answer"]["type"] == "number"
        assert '"name": "submit"' in tok.decode(
            await _first_prompt(env, tok), skip_special_tokens=False
        )
        async with RolloutEngine(backend, env, CONFIG, tokenizer=tok) as engine:
            trajs = {t.task_id: t async for t in engine.run(tasks)}
    for i, task in enumerate(tasks):
        t = trajs[task.id]
        assert t.status == "ok" and t.stop_reason == "env_done", (t.status, t.error)
        q, answer = question(t.seed % 2**32)
        assert t.messages[0].content == f"task {i}" and t.messages[1].content == q
        tool_msgs = [m for m in t.messages if m.role == "tool"]
        assert tool_msgs[0].content == str(answer) and tool_msgs[1].content == "submitted"
        assert t.reward == (1.0 if i % 2 == 0 else 0.0)
    # one session to list the tools + one for the prompt check + one per episode; all closed
    assert stats.opened - opened == 2 + len(tasks)
    assert await _eventually(lambda: stats.live == 0)


async def _first_prompt(env: OpenEnvEnvironment, tok: ChatTokenizer) -> Any:
    """The prompt of one one-turn episode (its tools rendered into the system prompt)."""
    probe = MockBackend(["no tools today"], tokenizer=tok, record=True)
    async with RolloutEngine(probe, env, CONFIG, tokenizer=tok) as engine:
        [t] = [t async for t in engine.run([Task(id="probe")])]
    assert t.status == "ok" and t.stop_reason == "no_tool_call", t.error
    return probe.requests[0].prompt_ids


async def _eventually(check: Any, timeout: float = 10.0) -> bool:
    """Poll ``check`` until it holds or ``timeout`` passes (server-side closes finish
    after the client's close returns)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_agentroll_env_served_to_openenv_clients() -> None:
    from openenv.core.generic_client import GenericEnvClient
    from openenv.core.mcp_client import MCPToolClient

    async def drive(url: str) -> None:
        async with MCPToolClient(base_url=url) as client:
            tools = await client.list_tools()
            assert [t.name for t in tools] == ["calc"]
            assert tools[0].input_schema["required"] == ["expression"]
            reset = await client.reset(task_index=1)
            assert reset.observation.task_id == "calc-0-1"
            assert await client.call_tool("calc", expression="6 * 7") == {"result": "42"}
        async with GenericEnvClient(base_url=url) as env:
            first = await env.reset(task_index=0)
            prompt = first.observation["messages"][-1]["content"]
            expression = re.findall(r"What is (.+?)\?", prompt)[0]
            step = await env.step(
                {"type": "call_tool", "tool_name": "calc", "arguments": {"expression": expression}}
            )
            assert step.done is False and step.reward is None
            value = step.observation["result"]["structured_content"]["result"]
            final = await env.step({"content": f"Answer: {value}"})
            assert final.done is True and final.reward == 1.0
            state = await env.state()
            assert state["task_id"] == "calc-0-0" and state["step_count"] == 2
            assert state["done"] is True and state["reward"] == 1.0

    with serve_app(create_app("calculator", num_tasks=2)) as url:
        asyncio.run(drive(url))


async def test_engine_round_trip_through_serve_env(tok: ChatTokenizer) -> None:
    """An agentroll env served, then used through OpenEnvEnvironment: MCP tool + a text
    action (the declared format), reward computed by the served env's rubric."""

    def policy(request: GenerationRequest) -> str:
        text = tok.decode(request.prompt_ids, skip_special_tokens=False)
        if request.turn_index == 0:
            return call("calc", expression=re.findall(r"What is (.+?)\?", text)[-1])
        result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)[-1]
        return f"Answer: {result}"

    tasks = [Task(id=f"t{i}", data={"reset": {"task_index": i}}) for i in range(2)]
    with serve_app(create_app("calculator", num_tasks=2)) as url:
        async with OpenEnvEnvironment(url, tasks=tasks, text_action="content") as env:
            backend = MockBackend(policy, tokenizer=tok)
            async with RolloutEngine(backend, env, CONFIG, tokenizer=tok) as engine:
                trajs = [t async for t in engine.run(tasks)]
    assert [(t.status, t.reward) for t in trajs] == [("ok", 1.0), ("ok", 1.0)], trajs[0].error


# -- bad input -----------------------------------------------------------------------------


def fake_app(mode: str) -> Any:
    """A raw WebSocket server speaking OpenEnv's frames, misbehaving as ``mode`` says:
    ``slow`` (reset answers after 3 s), ``malformed`` (a reward that is no number),
    ``ghost`` (lists a tool it then calls unknown)."""
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute
    from starlette.websockets import WebSocket, WebSocketDisconnect

    def obs(data: dict[str, Any], reward: Any = None, done: Any = False) -> str:
        payload = {"observation": data, "reward": reward, "done": done}
        return json.dumps({"type": "observation", "data": payload})

    async def ws(socket: WebSocket) -> None:
        await socket.accept()
        try:
            while True:
                msg = json.loads(await socket.receive_text())
                if msg["type"] == "close":
                    break
                if msg["type"] == "reset" and mode == "slow":
                    await asyncio.sleep(3)
                if msg["type"] == "reset":
                    await socket.send_text(obs({"text": "go"}))
                elif msg["data"].get("type") == "list_tools":
                    tool = {"name": "probe", "description": "", "input_schema": {}}
                    await socket.send_text(obs({"tools": [tool]}))
                elif mode == "malformed":
                    await socket.send_text(obs({"tool_name": "probe"}, reward="lots"))
                else:
                    error = {"error_type": "tool_not_found", "message": "Unknown tool: 'probe'"}
                    await socket.send_text(obs({"tool_name": "probe", "error": error}))
        except WebSocketDisconnect:
            pass

    return Starlette(routes=[WebSocketRoute(f"/{m}/ws", ws) for m in (mode,)])


async def test_bad_servers_fail_episodes_as_data(
    example: tuple[str, SessionStats], tok: ChatTokenizer
) -> None:
    dead = _dead_port()
    probe = call("probe")
    results: dict[str, Any] = {}
    with (
        serve_app(fake_app("slow")) as slow,
        serve_app(fake_app("malformed")) as malformed,
        serve_app(fake_app("ghost")) as ghost,
    ):
        servers = {
            "down": (f"http://127.0.0.1:{dead}", False),
            "slow": (f"{slow}/slow", False),
            "malformed": (f"{malformed}/malformed", True),
            "ghost": (f"{ghost}/ghost", True),
        }
        started = time.monotonic()
        for name, (url, mcp) in servers.items():
            env = OpenEnvEnvironment(url, mcp=mcp, timeout=0.5)
            async with env:
                backend = MockBackend([probe], tokenizer=tok)
                async with RolloutEngine(backend, env, CONFIG, tokenizer=tok) as engine:
                    [results[name]] = [t async for t in engine.run([Task(id=name)])]
        elapsed = time.monotonic() - started
    assert elapsed < 15, elapsed  # every call has a deadline: nothing hangs
    for name, why in {
        "down": "cannot reach the OpenEnv server",
        "slow": "no reply from the OpenEnv server",
        "malformed": "reward 'lots' is not a finite number",
        "ghost": "failed the call (tool_not_found)",
    }.items():
        t = results[name]
        assert t.status == "failed" and "OpenEnvError" in (t.error or ""), (name, t.error)
        assert why in t.error, (name, t.error)

    # an unknown tool from the model is the model's mistake, shown to it; a sibling on the
    # healthy server is unaffected
    url, _ = example
    tasks = [Task(id="unknown"), Task(id="sibling", data={"prompt": "task 0"})]
    scripts = {"unknown": call("nope"), "sibling": None}

    def policy(request: GenerationRequest) -> str:
        text = tok.decode(request.prompt_ids, skip_special_tokens=False)
        if "task 0" not in text:
            return scripts["unknown"] or ""
        return solver(tok)(request)

    async with OpenEnvEnvironment(url, timeout=10) as env:
        env.max_format_errors = 1
        async with RolloutEngine(
            MockBackend(policy, tokenizer=tok), env, CONFIG, tokenizer=tok
        ) as engine:
            trajs = {t.task_id: t async for t in engine.run(tasks)}
    bad = trajs["unknown"]
    assert bad.stop_reason == "format_errors"
    assert "unknown tool 'nope'; available tools: calc, submit" in (bad.turns[0].format_error or "")
    assert trajs["sibling"].status == "ok" and trajs["sibling"].reward == 1.0


def _dead_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_env_command_serves_until_stopped() -> None:
    """``agentroll serve-env calculator --port 0``: one ready line, then OpenEnv's client
    resets an episode on it; the test stops the process by its handle."""
    import signal
    import subprocess
    import sys

    from openenv.core.generic_client import GenericEnvClient

    argv = [sys.executable, "-m", "agentroll.cli", "serve-env", "calculator", "--port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())  # printed once it listens
        assert ready["pid"] == proc.pid and ready["url"].startswith("http://127.0.0.1:")
        assert "token" not in ready  # loopback: no token needed

        async def reset() -> str:
            async with GenericEnvClient(base_url=ready["url"]) as env:
                result = await env.reset(task_id="calc-0-3")
                return str(result.observation["task_id"])

        assert asyncio.run(reset()) == "calc-0-3"
    finally:
        proc.terminate()
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


async def test_a_failed_generation_closes_its_session(
    example: tuple[str, SessionStats], tok: ChatTokenizer
) -> None:
    """An episode that fails outside the environment's calls (here the backend, mid-episode)
    still has its session closed, while the environment is still open."""
    from agentroll.errors import BackendError

    url, stats = example
    solve = solver(tok)

    def policy(request: GenerationRequest) -> str:
        if request.turn_index == 1 and "task 1" in tok.decode(request.prompt_ids):
            raise BackendError("the model server went away")
        return str(solve(request))

    tasks = [Task(id=f"t{i}", data={"prompt": f"task {i}"}) for i in range(2)]
    async with OpenEnvEnvironment(url, timeout=10) as env:
        async with RolloutEngine(
            MockBackend(policy, tokenizer=tok), env, CONFIG, tokenizer=tok
        ) as engine:
            trajs = {t.task_id: t async for t in engine.run(tasks)}
        assert trajs["t0"].status == "ok" and trajs["t0"].reward == 1.0
        assert trajs["t1"].status == "failed" and "went away" in (trajs["t1"].error or "")
        assert not env._open, "a session outlived its episode"
        assert await _eventually(lambda: stats.live == 0)
