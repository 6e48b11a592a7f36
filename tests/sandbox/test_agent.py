"""The in-container agent and its channel, without docker: the agent runs as a subprocess
of the test (same protocol, pipes instead of an attach connection)."""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import hmac
import os
import signal
import struct
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentroll.errors import SandboxError
from agentroll.sandbox._channel import AgentChannel, capture_from
from agentroll.sandbox.docker_pool import _agent_source

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


class Agent:
    def __init__(self, proc: asyncio.subprocess.Process, channel: AgentChannel, workdir: Path):
        self.proc = proc
        self.channel = channel
        self.workdir = workdir

    async def exec(self, cmd: str | list[str], **fields: Any) -> dict[str, Any]:
        msg = {
            "op": "exec",
            "argv": ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd,
            "cwd": str(self.workdir),
            "env": ENV,
            "timeout": 10.0,
            "max_output": 4096,
            "stdin": None,
            **fields,
        }
        return await self.channel.request(msg, req_id=fields.pop("req_id", None), timeout=30)


async def start_agent(workdir: Path, ttl: float = 0) -> Agent:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _agent_source(),
        str(ttl),
        str(workdir),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdin is not None
    channel = AgentChannel(proc.stdout, proc.stdin, multiplexed=False, name="test agent")  # type: ignore[arg-type]
    hello = await channel.start(10)
    assert hello["pid"] == proc.pid
    return Agent(proc, channel, workdir)


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    a = await start_agent(tmp_path / "work")
    yield a
    await a.channel.close()
    if a.proc.returncode is None:
        a.proc.kill()
    await a.proc.wait()


def out(reply: dict[str, Any], stream: str = "stdout") -> str:
    return capture_from(reply[stream], 4096).text()


async def test_exec_returns_output_exit_code_and_duration(agent: Agent) -> None:
    reply = await agent.exec("echo hi; echo err >&2; pwd; exit 3")
    assert reply["exit_code"] == 3
    assert out(reply) == f"hi\n{agent.workdir}\n"
    assert out(reply, "stderr") == "err\n"
    assert not reply["timed_out"] and reply["duration"] > 0


async def test_stdin_env_and_missing_command(agent: Agent) -> None:
    data = base64.b64encode(b"abc" * 100_000).decode()
    reply = await agent.exec("wc -c; echo $FOO", stdin=data, env={**ENV, "FOO": "bar"})
    assert out(reply).split() == ["300000", "bar"]
    reply = await agent.exec(["no-such-command-xyz"])
    assert reply["exit_code"] == 127
    reply = await agent.exec("true", cwd=str(agent.workdir / "missing"))
    assert reply["error"] == "cwd"


async def test_output_is_bounded_head_and_tail(agent: Agent) -> None:
    reply = await agent.exec(
        "printf START; head -c 5000000 /dev/zero | tr '\\0' x; printf END", max_output=1000
    )
    cap = capture_from(reply["stdout"], 1000)
    assert cap.total == 5_000_008
    text = cap.text()
    assert text.startswith("START") and text.endswith("END") and "elided" in text
    assert len(text) < 1100


async def test_timeout_kills_the_group_even_if_sigterm_is_ignored(agent: Agent) -> None:
    started = time.monotonic()
    reply = await agent.exec(
        "trap '' TERM; (trap '' TERM; sleep 100) & sleep 100; echo never", timeout=0.5
    )
    assert reply["timed_out"] and reply["exit_code"] == -signal.SIGKILL
    assert time.monotonic() - started < 1.5
    await asyncio.sleep(0.1)
    assert await live_children(agent) == []


async def live_children(agent: Agent) -> list[str]:
    return await asyncio.to_thread(_live_children, agent)


def _live_children(agent: Agent) -> list[str]:
    """Non-zombie processes working in the agent's directory, other than the agent."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/cwd").resolve()
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) != agent.proc.pid and env == agent.workdir and stat[0] != "Z":
            found.append(entry)
    return found


async def test_background_children_die_with_the_command(agent: Agent) -> None:
    reply = await agent.exec("sleep 100 & echo started")
    assert reply["exit_code"] == 0 and out(reply) == "started\n"
    await asyncio.sleep(0.1)
    assert await live_children(agent) == []


async def test_kill_cancels_a_running_exec(agent: Agent) -> None:
    req_id = agent.channel.new_id()
    task = asyncio.ensure_future(agent.exec("sleep 100", req_id=req_id))
    await asyncio.sleep(0.3)
    agent.channel.post({"op": "kill", "target": req_id, "id": 0})
    reply = await asyncio.wait_for(task, 5)
    assert reply["cancelled"] and reply["exit_code"] == -signal.SIGKILL


async def test_concurrent_execs_are_answered_by_id(agent: Agent) -> None:
    replies = await asyncio.gather(*(agent.exec(f"sleep 0.{9 - i}; echo {i}") for i in range(8)))
    assert [out(r) for r in replies] == [f"{i}\n" for i in range(8)]


async def test_reset_kills_everything_and_empties_directories(agent: Agent) -> None:
    (agent.workdir / "sub").mkdir()
    (agent.workdir / "sub" / "f").write_text("x")
    (agent.workdir / "locked").mkdir()
    (agent.workdir / "locked" / "g").write_text("y")
    os.chmod(agent.workdir / "locked", 0o500)
    reply = await agent.channel.request(
        {"op": "reset", "dirs": [str(agent.workdir)], "kill": False}, timeout=10
    )
    assert reply["ok"], reply
    assert os.listdir(agent.workdir) == []


async def test_ping_and_unknown_ops(agent: Agent) -> None:
    reply = await agent.channel.request({"op": "ping"}, timeout=5)
    assert reply["ok"] and reply["pid"] == agent.proc.pid
    reply = await agent.channel.request({"op": "nope"}, timeout=5)
    assert "unknown op" in reply["error"]


async def test_the_agent_exits_on_eof_and_pending_requests_fail(agent: Agent) -> None:
    task = asyncio.ensure_future(agent.exec("sleep 100"))
    await asyncio.sleep(0.2)
    agent.proc.kill()  # the container dying looks like this to the channel
    with pytest.raises(SandboxError, match="stream ended"):
        await task
    with pytest.raises(SandboxError):
        await agent.exec("true")


async def test_stdin_eof_ends_the_agent(agent: Agent) -> None:
    assert agent.proc.stdin is not None
    agent.proc.stdin.close()
    assert await asyncio.wait_for(agent.proc.wait(), 5) == 0


async def test_ttl_ends_the_agent(tmp_path: Path) -> None:
    a = await start_agent(tmp_path / "w", ttl=1)
    try:
        code = await asyncio.wait_for(a.proc.wait(), 5)
        assert code == -signal.SIGALRM
    finally:
        await a.channel.close()


async def test_channel_demultiplexes_docker_frames() -> None:
    """Docker's 8-byte headers split stdout and stderr; frames may be cut anywhere."""
    import json

    reader = asyncio.StreamReader()
    channel = AgentChannel(reader, _NullWriter(), multiplexed=True, name="mux")  # type: ignore[arg-type]

    def docker_frame(kind: int, data: bytes) -> bytes:
        return struct.pack(">BxxxI", kind, len(data)) + data

    def agent_frame(msg: dict[str, Any]) -> bytes:
        return signed(channel, json.dumps(msg).encode())

    stream = agent_frame({"hello": 1, "pid": 7}) + agent_frame({"id": "1", "ok": True})
    reader.feed_data(docker_frame(1, stream[:5]))
    reader.feed_data(docker_frame(2, b"a warning\n"))
    reader.feed_data(docker_frame(1, stream[5:]))
    hello = await channel.start(5)
    assert hello["pid"] == 7
    assert "a warning" in channel.stderr_tail
    reader.feed_eof()
    await asyncio.sleep(0.05)
    assert not channel.alive
    with pytest.raises(SandboxError, match="a warning"):
        await channel.request({"op": "ping"})


@pytest.mark.parametrize("body", [b"[1, 2]", b'"hello"', b"7", b"[" * 100_000, b"\xff{"])
async def test_a_frame_that_is_not_a_json_object_fails_the_channel(body: bytes) -> None:
    """What the container sends is not trusted: a frame that is valid JSON but no object
    (or too deep for the parser, or not UTF-8) fails every request with SandboxError; it
    used to end the reader with an AttributeError or a RecursionError and leave requests
    waiting."""
    reader = asyncio.StreamReader()
    channel = AgentChannel(reader, _NullWriter(), multiplexed=False, name="odd")  # type: ignore[arg-type]
    reader.feed_data(signed(channel, b'{"hello": 1, "pid": 7}'))
    await channel.start(5)
    pending = asyncio.ensure_future(channel.request({"op": "ping"}))
    await asyncio.sleep(0)
    reader.feed_data(signed(channel, body))
    with pytest.raises(SandboxError, match="malformed frame"):
        await asyncio.wait_for(pending, 5)
    assert not channel.alive


def signed(channel: AgentChannel, body: bytes) -> bytes:
    """A reply frame as the agent sends it: length, HMAC under the channel's key, body."""
    mac = hmac.new(channel._key, body, hashlib.sha256).digest()
    return struct.pack(">I", len(mac) + len(body)) + mac + body


async def file_op(agent: Agent, **msg: Any) -> dict[str, Any]:
    return await agent.channel.request(msg, timeout=10)


async def test_files_move_through_the_agent_inside_the_working_directory(
    agent: Agent, tmp_path: Path
) -> None:
    data = base64.b64encode(bytes(range(256))).decode()
    assert (await file_op(agent, op="write", path="a/b/c.bin", data=data))["ok"]
    assert (agent.workdir / "a/b/c.bin").read_bytes() == bytes(range(256))
    reply = await file_op(agent, op="read", path="a/b/c.bin")
    assert base64.b64decode(reply["data"]) == bytes(range(256))
    (agent.workdir / "inside").symlink_to("a/b/c.bin")
    reply = await file_op(agent, op="read", path="inside")
    assert base64.b64decode(reply["data"]) == bytes(range(256))
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    (agent.workdir / "out").symlink_to(secret)
    (agent.workdir / "outdir").symlink_to(tmp_path)
    for path in ("out", "outdir/secret"):
        reply = await file_op(agent, op="read", path=path)
        assert reply["error"] == "outside" and "data" not in reply
        reply = await file_op(agent, op="write", path=path, data="eA==")
        assert path == "out" or reply["error"] == "outside"
    assert secret.read_text() == "host secret"  # "out" was replaced, not written through
    assert not (agent.workdir / "out").is_symlink()
    assert (await file_op(agent, op="read", path="a"))["errno"] == errno.EISDIR
    assert (await file_op(agent, op="read", path="nope"))["errno"] == errno.ENOENT


async def test_snapshot_and_restore_through_the_agent(agent: Agent) -> None:
    (agent.workdir / "d").mkdir()
    (agent.workdir / "d" / "f").write_text("1")
    (agent.workdir / "g").write_text("2")
    os.chmod(agent.workdir / "g", 0o755)
    (agent.workdir / "h").symlink_to("g")
    blob = (await file_op(agent, op="snapshot"))["data"]
    (agent.workdir / "g").write_text("changed")
    (agent.workdir / "new").write_text("x")
    assert (await file_op(agent, op="restore", data=blob))["ok"]
    assert sorted(os.listdir(agent.workdir)) == ["d", "g", "h"]
    assert (agent.workdir / "g").read_text() == "2" and os.access(agent.workdir / "g", os.X_OK)
    assert os.readlink(agent.workdir / "h") == "g"


class _NullWriter:
    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass
