"""The docker sandbox holds against the commands it runs (marker ``docker``): nothing a
command starts outlives its call, a command can neither reach the agent's file descriptors
nor signal it, a forged reply is refused, ``read_file`` stays inside the working directory,
storage is size-capped on a read-only root, and docker's errors arrive as ``SandboxError``.

The daemon is ``$AGENTROLL_DOCKER_HOST`` (``make test`` starts a private one); without it the
docker tests skip, or fail under ``AGENTROLL_REQUIRE=docker``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import struct
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from agentroll.errors import SandboxError
from agentroll.sandbox import open_sandbox
from agentroll.sandbox._channel import AgentChannel
from agentroll.sandbox.audit import AUDIT_CONFIG, PROBES, audit
from agentroll.sandbox.base import SandboxConfig

pytestmark = pytest.mark.docker

HOST = os.environ.get("AGENTROLL_DOCKER_HOST", "")


def _daemon_answers() -> str | None:
    if not HOST:
        return "AGENTROLL_DOCKER_HOST is not set (scripts/dockerd.sh start; make test sets it)"
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed (pip install 'agentroll[docker]')"
    try:
        docker.APIClient(base_url=HOST, timeout=5).ping()
    except Exception as exc:
        return f"no docker daemon answers at {HOST}: {exc}"
    return None


_WHY = _daemon_answers()
needs_docker = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
if _WHY is None:
    from agentroll.sandbox import docker_daemon, docker_options, docker_pool


def config(**fields: Any) -> SandboxConfig:
    opts = {"docker_host": HOST, "pool_size": 0}
    return SandboxConfig(backend="docker", timeout=20.0, memory_mb=256, options=opts, **fields)


@pytest.fixture
async def sb() -> AsyncIterator[Any]:
    sandbox = open_sandbox(config(disk_mb=64, tmp_mb=16, file_size_mb=512))
    await sandbox.start()
    try:
        yield sandbox
    finally:
        await sandbox.close()
        await docker_pool.close_pools()
        left = await asyncio.to_thread(docker_daemon.list_containers, HOST, owner="self")
        assert left == [], f"containers left behind: {left}"


async def processes(sandbox: Any) -> list[str]:
    """``comm`` of every live process in the container, from a fresh exec."""
    res = await sandbox.exec(
        "for p in /proc/[0-9]*; do s=$(cut -d' ' -f3 $p/stat 2>/dev/null); "
        '[ "$s" != Z ] && cat $p/comm 2>/dev/null; done; true'
    )
    return res.stdout.split()


@needs_docker
async def test_a_setsid_survivor_is_gone_before_the_next_call(sb: Any) -> None:
    res = await sb.exec("setsid sh -c 'sleep 30' >/dev/null 2>&1 & echo started")
    assert res.stdout == "started\n"
    code = "import subprocess; subprocess.Popen(['sleep', '31'], start_new_session=True)"
    assert (await sb.exec(["python3", "-c", code])).ok
    assert "sleep" not in await processes(sb)


@needs_docker
async def test_a_command_cannot_reach_the_agents_fds_nor_signal_it(sb: Any) -> None:
    pid = (await sb._live().channel.request({"op": "ping"}, timeout=5))["pid"]
    probe = textwrap.dedent(
        f"""
        import os, signal
        for what, attempt in [
            ("open", lambda: open("/proc/{pid}/fd/1", "wb")),
            ("list", lambda: os.listdir("/proc/{pid}/fd")),
            ("mem", lambda: open("/proc/{pid}/mem", "rb")),
            ("stop", lambda: os.kill({pid}, signal.SIGSTOP)),
            ("kill", lambda: os.kill({pid}, signal.SIGKILL)),
        ]:
            try:
                attempt()
                print(what, "ALLOWED")
            except PermissionError:
                print(what, "refused")
        print("uid", os.getuid(), os.geteuid())
        """
    )
    res = await sb.exec(["python3", "-c", probe])
    assert res.exit_code == 0, res.stderr
    assert "ALLOWED" not in res.stdout, res.stdout
    assert res.stdout.count("refused") == 5
    assert "uid 0" not in res.stdout  # commands never run as the agent's uid
    assert (await sb.exec("echo alive")).stdout == "alive\n"


async def test_a_forged_reply_frame_is_refused() -> None:
    """A frame on the agent's stdout that the agent did not sign (a survivor writing
    through ``/proc/<agent>/fd/1`` in the old design) fails the channel; it never answers
    a request, whatever id it guesses."""
    reader = asyncio.StreamReader()
    writer = _Recorder()
    channel = AgentChannel(reader, writer, multiplexed=False, name="forged")  # type: ignore[arg-type]
    starting = asyncio.ensure_future(channel.start(5))
    await asyncio.sleep(0)
    key = bytes.fromhex(writer.frames()[0]["key"])

    def signed(body: bytes, k: bytes = key) -> bytes:
        mac = hmac.new(k, body, hashlib.sha256).digest()
        return struct.pack(">I", len(mac) + len(body)) + mac + body

    reader.feed_data(signed(b'{"hello": 1, "pid": 7}'))
    await starting
    pending = asyncio.ensure_future(channel.request({"op": "exec"}, timeout=5))
    await asyncio.sleep(0)
    req_id = writer.frames()[-1]["id"]
    assert len(req_id) == 32  # 128 random bits: nothing to guess from earlier requests
    forged = json.dumps({"id": req_id, "exit_code": 0, "stdout": ["", "", 0]}).encode()
    reader.feed_data(signed(forged, b"\0" * 32))  # a well-formed frame under another key
    with pytest.raises(SandboxError, match="refused a reply"):
        await pending
    assert not channel.alive
    with pytest.raises(SandboxError):
        await channel.request({"op": "ping"})
    await channel.close()


@needs_docker
async def test_read_file_refuses_links_that_leave_the_working_directory(sb: Any) -> None:
    await sb.exec("ln -s /etc/passwd pw; ln -s /etc/hostname hn; ln -s /etc etc; ln -s hn ok")
    for path in ("pw", "hn", "etc/hostname", "ok"):
        with pytest.raises(ValueError, match="outside"):
            await sb.read_file(path)
    await sb.write_file("inside.txt", "x")
    await sb.exec("ln -s inside.txt link")
    assert await sb.read_file("link") == b"x"


@needs_docker
async def test_storage_is_capped_and_the_root_is_read_only(sb: Any) -> None:
    res = await sb.exec("head -c 300M /dev/zero > big; echo rc=$?; du -m big | cut -f1")
    assert "No space left on device" in res.stderr, res
    assert "rc=0" not in res.stdout and int(res.stdout.split()[-1]) <= 64
    res = await sb.exec("head -c 100M /dev/zero > /tmp/big; du -m /tmp/big | cut -f1")
    assert "No space left on device" in res.stderr and int(res.stdout.split()[-1]) <= 16
    for cmd in ("echo x > /rootfile", "echo x > /etc/newfile", "mkdir /newdir", "touch /usr/x"):
        res = await sb.exec(cmd)
        assert res.exit_code != 0 and "Read-only file system" in res.stderr, (cmd, res)
    with pytest.raises(OSError, match="No space left"):
        await sb.write_file("more", b"y" * (8 << 20))
    await sb.exec("rm -f big /tmp/big")
    # snapshots and restores work on the tmpfs working directory
    await sb.write_file("d/f", "1")
    blob = await sb.snapshot()
    await sb.exec("rm -rf d; touch other")
    await sb.restore(blob)
    assert (await sb.exec("find . | sort")).stdout == ".\n./d\n./d/f\n./more\n"


@needs_docker
async def test_docker_errors_surface_as_sandbox_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import docker.errors
    import requests.exceptions

    sandbox = open_sandbox(config())
    client = docker_daemon._daemon(docker_options.DockerOptions(docker_host=HOST)).client

    def gone(*args: object, **kwargs: object) -> None:
        raise requests.exceptions.ConnectionError("connection reset by the daemon")

    monkeypatch.setattr(client, "create_container", gone)
    with pytest.raises(SandboxError, match=r"docker create failed.*docker info"):
        await sandbox.start()
    await sandbox.close()

    def refused(*args: object, **kwargs: object) -> None:
        raise docker.errors.APIError("500 Server Error: the daemon is shutting down")

    monkeypatch.setattr(client, "containers", refused)
    with pytest.raises(SandboxError, match="listing containers failed"):
        await asyncio.to_thread(docker_daemon.list_containers, HOST)
    monkeypatch.undo()
    await docker_pool.close_pools()


_SURVIVOR = """\
import os, subprocess, sys
evil = 'import json, sys\\nr = json.loads(sys.stdin.read())\\nprint(r["nonce"], len(r["tests"]))\\n'
loop = '''
import os, sys, time
evil = sys.argv[1]
os.makedirs(".agentroll", exist_ok=True)
end = time.time() + 30
while time.time() < end:
    try:
        with open(".agentroll/check.py") as f:
            same = f.read() == evil
    except OSError:
        same = False
    if not same:
        with open(".agentroll/new.py", "w") as f:
            f.write(evil)
        os.replace(".agentroll/new.py", ".agentroll/check.py")
    time.sleep(0.0005)
'''
subprocess.Popen([sys.executable, "-c", loop, evil], start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("planted")
"""


@needs_docker
async def test_code_fix_reward_cannot_be_forged_by_an_earlier_tool_call() -> None:
    """The model plants a process that swaps the reward harness for one that reports every
    test passed, then answers with the unfixed function: it scores what the bug scores."""
    from agentroll.backends.base import SamplingParams
    from agentroll.backends.mock import MockBackend
    from agentroll.env import load_environment
    from agentroll.model.tokenizer import tiny_chat_tokenizer
    from agentroll.rollout.engine import RolloutConfig, RolloutEngine

    tok = tiny_chat_tokenizer()
    long_turns = SamplingParams(max_tokens=4096)
    env = load_environment("code_fix")
    object.__setattr__(env, "sandbox_config", config())
    task = next(iter(env.tasks()))  # mean: the bug passes none of its tests
    buggy = task.data["prompt"].split("```python\n", 1)[1]
    call = json.dumps({"name": "python_exec", "arguments": {"code": _SURVIVOR}})
    script = [f"<tool_call>\n{call}\n</tool_call>", f"Done:\n```python\n{buggy}"]
    backend = MockBackend(script, tokenizer=tok)
    try:
        async with RolloutEngine(
            backend, env, RolloutConfig(progress="off", sampling=long_turns), tokenizer=tok
        ) as engine:
            (traj,) = [t async for t in engine.run([task])]
    finally:
        await docker_pool.close_pools()
    assert traj.status == "ok", (traj.status, traj.error, traj.messages)
    assert "planted" in traj.turns[0].tool_results[0].content
    assert traj.reward == 0.0


class _Recorder:
    """A writer that keeps what the channel sends (the key frame, then requests)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def frames(self) -> list[dict[str, Any]]:
        out, buf = [], bytes(self.data)
        while buf:
            (size,) = struct.unpack_from(">I", buf)
            out.append(json.loads(buf[4 : 4 + size]))
            buf = buf[4 + size :]
        return out


def test_a_limit_the_container_does_not_show_is_named_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from agentroll.sandbox import docker as sandbox_docker
    from agentroll.sandbox import docker_pool

    spec = sandbox_docker.DockerSandbox(config(pids=99)).spec
    mib = 1 << 20
    seen = {"pids": None, "memory": 256 * mib, "cpus": 1.0, "disk": 1024 * mib, "tmp": 1}
    with caplog.at_level("WARNING", logger="agentroll.sandbox"):
        docker_pool._warn_unenforced(spec, seen)
        docker_pool._warn_unenforced(spec, seen)  # once per spec and limit
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert "sandbox.pids = 99 processes is not enforced" in warned[0]
    assert "sandbox.tmp_mb" in warned[1]


@needs_docker
@pytest.mark.parametrize("probe", sorted(PROBES))
async def test_audit_probe_is_contained(probe: str) -> None:
    cfg = msgspec.structs.replace(AUDIT_CONFIG, options={"docker_host": HOST, "pool_size": 0})
    (finding,) = await audit("docker", config=cfg, probes=[probe])
    assert finding.status == "contained", finding.line()
