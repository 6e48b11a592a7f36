"""DockerSandbox against a real docker engine (marker ``docker``).

The daemon is the one of ``$AGENTROLL_DOCKER_HOST`` (``make test`` starts a private one with
``scripts/dockerd.sh`` and sets it); without it these tests skip, or fail under
``AGENTROLL_REQUIRE=docker``.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agentroll.errors import SandboxError
from agentroll.sandbox import open_sandbox
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
if _WHY is not None:
    pytestmark = [pytest.mark.docker, pytest.mark.skip(reason=_WHY)]
else:
    from agentroll.sandbox import docker as dsb
    from agentroll.sandbox import docker_daemon, docker_options, docker_pool


def config(**options: Any) -> SandboxConfig:
    opts = {"docker_host": HOST, "pool_size": 0, **options}
    return SandboxConfig(backend="docker", timeout=10.0, memory_mb=256, options=opts)


@pytest.fixture(autouse=True)
async def no_leaks() -> AsyncIterator[None]:
    yield
    await docker_pool.close_pools()
    left = await asyncio.to_thread(docker_daemon.list_containers, HOST, owner="self")
    assert left == [], f"containers left behind: {left}"


@pytest.fixture
async def sb() -> AsyncIterator[Any]:
    sandbox = open_sandbox(config(), episode_id="test-episode")
    await sandbox.start()
    yield sandbox
    await sandbox.close()


def inspect(cid: str) -> dict[str, Any]:
    client = docker_daemon._daemon(docker_options.DockerOptions(docker_host=HOST)).client
    return client.inspect_container(cid)  # type: ignore[no-any-return]


async def test_container_has_the_safe_defaults(sb: Any) -> None:
    info = await asyncio.to_thread(inspect, sb.container_id)
    hc = info["HostConfig"]
    assert hc["NetworkMode"] == "none"
    assert hc["Memory"] == 256 * 1024 * 1024 and hc["MemorySwap"] == hc["Memory"]
    assert hc["NanoCpus"] == 1_000_000_000 and hc["PidsLimit"] == 256
    assert hc["CapDrop"] == ["ALL"] and "no-new-privileges" in hc["SecurityOpt"]
    assert sorted(hc["CapAdd"]) == ["KILL", "SETGID", "SETUID"]  # the agent's, not commands'
    assert hc["Init"] is True and hc["ReadonlyRootfs"] is True
    assert "size=1024m" in hc["Tmpfs"]["/workspace"] and "size=256m" in hc["Tmpfs"]["/tmp"]
    labels = info["Config"]["Labels"]
    assert labels["agentroll.episode"] == "test-episode"
    assert float(labels["agentroll.ttl"]) == 3600
    assert abs(float(labels["agentroll.created_at"]) - time.time()) < 60
    res = await sb.exec("cat /proc/1/cmdline | tr '\\0' ' '; cat /proc/self/status | grep CapEff")
    assert "docker-init" in res.stdout  # tini is PID 1
    assert "CapEff:\t0000000000000000" in res.stdout


async def test_exec_contract_matches_the_local_sandbox(sb: Any) -> None:
    res = await sb.exec("echo out; echo err >&2; pwd; echo $HOME $FOO; exit 4", env={"FOO": "x"})
    assert (res.exit_code, res.stderr) == (4, "err\n")
    assert res.stdout == "out\n/workspace\n/workspace x\n"
    res = await sb.exec(["cat"], stdin="piped")
    assert res.stdout == "piped" and res.ok
    assert (await sb.exec(["no-such-binary"])).exit_code == 127
    await sb.exec("mkdir -p sub/dir")
    assert (await sb.exec("pwd", cwd="sub/dir")).stdout == "/workspace/sub/dir\n"
    with pytest.raises(ValueError, match="outside"):
        await sb.exec("pwd", cwd="../..")
    with pytest.raises(FileNotFoundError):
        await sb.exec("pwd", cwd="missing")
    res = await sb.exec("head -c 300000 /dev/zero | tr '\\0' y", max_output=1000)
    assert res.truncated and res.elided_bytes == 299_000 and "elided" in res.stdout


async def test_no_network_from_inside(sb: Any) -> None:
    probe = textwrap.dedent(
        """
        import socket
        for addr in [("127.0.0.1", 22), ("1.1.1.1", 80), ("8.8.8.8", 53)]:
            try:
                socket.create_connection(addr, timeout=2).close()
                print("CONNECTED", addr)
            except OSError as exc:
                print("refused", addr, exc.errno)
        print([l.split()[0] for l in open("/proc/net/dev").read().splitlines()[2:]])
        """
    )
    res = await sb.exec(["python3", "-c", probe])
    assert res.exit_code == 0, res.stderr
    assert "CONNECTED" not in res.stdout
    assert res.stdout.count("refused") == 3
    assert "['lo:']" in res.stdout  # no interface but loopback


async def test_memory_hog_is_killed_and_reported_and_the_episode_goes_on(sb: Any) -> None:
    res = await sb.exec(["python3", "-c", "x = bytearray(1024 * 1024 * 1024)"])
    assert res.exit_code == -signal.SIGKILL and not res.timed_out
    assert "out-of-memory" in res.stderr and "256 MiB" in res.stderr
    assert (await sb.exec("echo alive")).stdout == "alive\n"


async def test_fork_bomb_is_contained_by_the_pids_limit(sb: Any) -> None:
    started = time.monotonic()
    res = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout=3)
    # either the shell got to `sleep 30` and the timeout killed the group, or the bomb had
    # already used up the pids limit and the shell's own fork of `sleep` was refused (it
    # exits at once, and its group dies with it): both are the limit at work
    refused = not res.timed_out and res.exit_code != 0 and "fork" in res.stderr.lower()
    assert res.timed_out or refused, res
    assert time.monotonic() - started < 4.5
    # cgroup v2 or v1: a count must be read (no fallback that would pass without one)
    after = await sb.exec(
        "cat /sys/fs/cgroup/pids.current 2>/dev/null || cat /sys/fs/cgroup/pids/pids.current"
    )
    assert after.ok, after
    # tini, the agent, sh and cat: the bomb is gone
    assert 1 <= int(after.stdout) <= 8, after.stdout


async def test_sigterm_ignoring_command_is_gone_within_its_timeout(sb: Any) -> None:
    started = time.monotonic()
    res = await sb.exec("trap '' TERM; sleep 100 & trap '' TERM; sleep 100", timeout=1.0)
    elapsed = time.monotonic() - started
    assert res.timed_out and res.exit_code == -signal.SIGKILL
    assert elapsed < 2.0
    ps = await sb.exec("for p in /proc/[0-9]*; do cat $p/comm; done")
    assert "sleep" not in ps.stdout


async def test_cancelled_exec_kills_the_command(sb: Any) -> None:
    task = asyncio.ensure_future(sb.exec("sleep 100; echo never"))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.3)
    ps = await sb.exec("for p in /proc/[0-9]*; do cat $p/comm; done")
    assert "sleep" not in ps.stdout


async def test_a_hung_agent_is_timed_out_from_outside_and_the_sandbox_marked_broken(
    sb: Any,
) -> None:
    reply = await sb._live().channel.request({"op": "ping"}, timeout=5)
    # The host stops the agent during a call (a command cannot: tests/security): only the
    # outside timeout can end the call.
    client = docker_daemon._daemon(docker_options.DockerOptions(docker_host=HOST)).client
    stop = client.exec_create(sb.container_id, ["kill", "-STOP", str(reply["pid"])], user="0")
    call = asyncio.ensure_future(sb.exec("sleep 0.3", timeout=0.5))
    await asyncio.to_thread(client.exec_start, stop)
    res = await call
    assert res.timed_out and "no answer" in res.stderr
    with pytest.raises(SandboxError, match="broken"):
        await sb.exec("true")


async def test_files_through_the_archive_api(sb: Any) -> None:
    await sb.write_file("a/b/c.txt", "hello")
    await sb.write_file("bin.dat", bytes(range(256)))
    assert await sb.read_file("a/b/c.txt") == b"hello"
    assert await sb.read_file("bin.dat") == bytes(range(256))
    assert (await sb.exec("cat a/b/c.txt")).stdout == "hello"
    await sb.exec("ln -s a/b/c.txt link")
    assert await sb.read_file("link") == b"hello"
    with pytest.raises(FileNotFoundError):
        await sb.read_file("missing.txt")
    with pytest.raises(IsADirectoryError):
        await sb.read_file("a")
    for bad in ("/etc/passwd", "../x", "a/../../x"):
        with pytest.raises(ValueError):
            await sb.read_file(bad)
        with pytest.raises(ValueError):
            await sb.write_file(bad, "x")


async def test_snapshot_restore_round_trip_and_across_backends(sb: Any) -> None:
    await sb.exec("mkdir -p d/e && echo 1 > d/e/f && echo 2 > g && chmod 755 g && ln -s g h")
    blob = await sb.snapshot()
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        names = sorted(tar.getnames())
    assert names == ["d", "d/e", "d/e/f", "g", "h"]
    await sb.exec("rm -rf d && echo changed > g && touch new")
    await sb.restore(blob)
    res = await sb.exec("find . | sort; cat g; test -x g && echo exec; readlink h")
    assert res.stdout == ".\n./d\n./d/e\n./d/e/f\n./g\n./h\n2\nexec\ng\n"
    # A snapshot of the docker sandbox restores in the local one, and back.
    local = open_sandbox(SandboxConfig(backend="local", use_bwrap=False))
    async with local:
        await local.restore(blob)
        assert await local.read_file("d/e/f") == b"1\n"
        await local.write_file("from-local", "L")
        await sb.restore(await local.snapshot())
    assert await sb.read_file("from-local") == b"L"


async def test_restore_refuses_bad_blobs_without_changing_anything(sb: Any) -> None:
    await sb.write_file("keep", "k")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        tar.addfile(info, io.BytesIO(b""))
    for blob in (b"not a tar", buf.getvalue()):
        with pytest.raises(ValueError):
            await sb.restore(blob)
    assert await sb.read_file("keep") == b"k"


async def test_config_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="network"):
        open_sandbox(SandboxConfig(backend="docker", network=True))
    with pytest.raises(ValueError, match="sandbox options"):
        open_sandbox(config(nonsense=1))
    with pytest.raises(ValueError, match="workdir"):
        open_sandbox(config(workdir="relative"))
    missing = open_sandbox(
        SandboxConfig(
            backend="docker", image="agentroll/absent:none", options={"docker_host": HOST}
        )
    )
    with pytest.raises(SandboxError, match="docker pull"):
        await missing.start()
    await missing.close()
    nodaemon = open_sandbox(config(docker_host="unix:///nonexistent/docker.sock"))
    with pytest.raises(SandboxError, match=r"dockerd\.sh"):
        await nodaemon.start()


async def test_warm_pool_hands_out_healthy_containers_fast() -> None:
    cfg = config(pool_size=2)
    assert await dsb.prewarm(cfg) == 2
    # Kill one warm container behind the pool's back: the health check must skip it.
    pool = next(iter(docker_pool._pools[asyncio.get_running_loop()].values()))
    victim = pool.warm[0].id
    client = docker_daemon._daemon(docker_options.DockerOptions(docker_host=HOST)).client
    await asyncio.to_thread(client.kill, victim)
    await asyncio.sleep(0.3)
    sandbox = open_sandbox(cfg)
    started = time.monotonic()
    await sandbox.start()
    took = time.monotonic() - started
    cid = sandbox.container_id  # type: ignore[attr-defined]
    assert cid != victim
    assert (await sandbox.exec("echo ok")).stdout == "ok\n"
    await sandbox.close()
    assert took < 1.0
    # a fresh container per episode: the closed one is removed, not put back
    assert cid not in await asyncio.to_thread(docker_daemon.list_containers, HOST, owner="self")


async def test_reuse_only_after_a_verified_reset() -> None:
    cfg = config(pool_size=1, reuse=True)
    await dsb.prewarm(cfg)
    first = open_sandbox(cfg)
    await first.start()
    cid = first.container_id  # type: ignore[attr-defined]
    await first.exec("echo secret > notes; echo t > /tmp/t; (sleep 100 &) ; true")
    await first.close()
    second = open_sandbox(cfg)
    await second.start()
    assert second.container_id == cid  # type: ignore[attr-defined]
    assert (await second.exec("ls -A . /tmp")).stdout == ".:\n\n/tmp:\n"
    ps = await second.exec("for p in /proc/[0-9]*; do cat $p/comm; done")
    assert "sleep" not in ps.stdout
    await second.close()


async def test_ttl_ends_a_container_and_the_reaper_removes_it() -> None:
    sandbox = open_sandbox(config(ttl=2))
    await sandbox.start()
    cid = sandbox.container_id  # type: ignore[attr-defined]
    await asyncio.sleep(3.0)
    state = (await asyncio.to_thread(inspect, cid))["State"]
    assert not state["Running"]
    with pytest.raises(SandboxError):
        await sandbox.exec("true")
    assert await asyncio.to_thread(docker_daemon.reap, HOST) >= 1
    assert cid not in await asyncio.to_thread(docker_daemon.list_containers, HOST)
    await sandbox.close()  # already gone: still fine


_WORKER = """
import asyncio, sys
from agentroll.sandbox import open_sandbox
from agentroll.sandbox.base import SandboxConfig

async def main():
    cfg = SandboxConfig(backend="docker", options={"docker_host": sys.argv[1], "pool_size": 0})
    boxes = [open_sandbox(cfg, episode_id=f"doomed-{i}") for i in range(3)]
    await asyncio.gather(*(b.start() for b in boxes))
    print("ready", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""

_REAPER = """
import sys
from agentroll.sandbox import docker_daemon
print(docker_daemon.reap(sys.argv[1]))
"""


def start_worker() -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, HOST], stdout=subprocess.PIPE, text=True
    )


async def test_containers_of_a_killed_worker_are_reaped_at_the_next_start(tmp_path: Path) -> None:
    worker = start_worker()
    try:
        assert worker.stdout is not None
        line = await asyncio.to_thread(worker.stdout.readline)
        assert line.strip() == "ready"
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    owner_prefix = f"{docker_daemon._HOST}:{worker.pid}:"

    def theirs() -> list[str]:
        client = docker_daemon._daemon(docker_options.DockerOptions(docker_host=HOST)).client
        found = client.containers(all=True, filters={"label": "agentroll.sandbox"})
        return [c["Id"] for c in found if c["Labels"]["agentroll.owner"].startswith(owner_prefix)]

    before = await asyncio.to_thread(theirs)
    assert len(before) == 3  # kill -9 left them behind
    # A new process's first use of the daemon runs the reaper.
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _REAPER, HOST],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "removed 3 leftover" in done.stderr
    assert await asyncio.to_thread(theirs) == []


async def test_sigterm_removes_the_containers_of_a_plain_script() -> None:
    worker = start_worker()
    assert worker.stdout is not None
    line = await asyncio.to_thread(worker.stdout.readline)
    assert line.strip() == "ready"
    worker.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(worker.wait, 30) == -signal.SIGTERM
    owner_prefix = f"{docker_daemon._HOST}:{worker.pid}:"
    client = docker_daemon._daemon(docker_options.DockerOptions(docker_host=HOST)).client
    found = await asyncio.to_thread(
        client.containers, all=True, filters={"label": "agentroll.sandbox"}
    )
    assert not [c for c in found if c["Labels"]["agentroll.owner"].startswith(owner_prefix)]


async def test_64_concurrent_calculator_episodes_finish_without_leaks() -> None:
    from agentroll.backends.base import GenerationRequest
    from agentroll.backends.mock import MockBackend
    from agentroll.env import load_environment
    from agentroll.environments.calculator import demonstration
    from agentroll.model.tokenizer import tiny_chat_tokenizer
    from agentroll.rollout.engine import RolloutConfig, RolloutEngine

    tok = tiny_chat_tokenizer()
    env = load_environment("calculator", num_tasks=64, seed=5)
    object.__setattr__(
        env,
        "sandbox_config",
        msgspec.structs.replace(config(pool_size=8), timeout=20.0),
    )

    def script(request: GenerationRequest) -> str:
        return demonstration(
            tok.decode(request.prompt_ids, skip_special_tokens=False), request.turn_index
        )

    cfg = RolloutConfig(progress="off", concurrency=64)
    started = time.monotonic()
    async with RolloutEngine(MockBackend(script, tokenizer=tok), env, cfg, tokenizer=tok) as engine:
        trajs = [t async for t in engine.run(env.tasks())]
    assert len(trajs) == 64
    assert all(t.status == "ok" for t in trajs), [t.error for t in trajs if t.status != "ok"][:3]
    assert all(t.reward == 1.0 for t in trajs)
    assert time.monotonic() - started < 120
    # no_leaks (autouse) checks that nothing is left once the pools are closed


async def test_an_image_without_python_says_what_the_agent_needs() -> None:
    bare = open_sandbox(config(host_mounts=False))  # the empty base image, nothing mounted
    with pytest.raises(SandboxError, match=r"python >= 3\.8"):
        await bare.start()
    await bare.close()


async def test_cli_lists_and_reaps(sb: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from agentroll.cli import main

    assert await asyncio.to_thread(main, ["sandbox", "ls", "--docker-host", HOST]) in (0, None)
    listed = capsys.readouterr().out
    assert f"{sb.container_id[:12]} state=running" in listed and "episode=test-episode" in listed
    assert await asyncio.to_thread(main, ["sandbox", "reap", "--docker-host", HOST]) in (0, None)
    assert capsys.readouterr().out.startswith("reaped=")
    assert (await sb.exec("echo still here")).ok  # a live owner's container is kept
