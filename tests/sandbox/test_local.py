"""LocalSandbox: process-group kills, bounded output, clean env, paths, snapshots, bubblewrap."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import socket
import tarfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentroll.errors import SandboxError
from agentroll.sandbox import local
from agentroll.sandbox._process import _Capture
from agentroll.sandbox.base import SandboxConfig
from agentroll.sandbox.local import LocalSandbox, bwrap_available

BWRAP_SKIP = pytest.mark.skipif(
    not bwrap_available(), reason="bubblewrap missing or not working: apt-get install bubblewrap"
)
MODES = ["plain", pytest.param("bwrap", marks=[pytest.mark.bwrap, BWRAP_SKIP])]


def make(mode: str, **overrides: object) -> LocalSandbox:
    return LocalSandbox(SandboxConfig(use_bwrap=mode == "bwrap", **overrides))  # type: ignore[arg-type]


@pytest.fixture(params=MODES)
async def sb(request: pytest.FixtureRequest) -> AsyncIterator[LocalSandbox]:
    sandbox = make(request.param)
    await sandbox.start()
    assert sandbox.is_isolated == (request.param == "bwrap")
    yield sandbox
    await sandbox.close()


@pytest.fixture
async def plain() -> AsyncIterator[LocalSandbox]:
    async with make("plain") as sandbox:
        assert isinstance(sandbox, LocalSandbox)
        yield sandbox


def live_pids(*, token: str | None = None, pgid: int | None = None) -> list[int]:
    """Non-zombie processes whose command line holds ``token`` or whose group is ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if fields[0] == "Z":
            continue
        if (token is not None and token in cmdline) or (
            pgid is not None and int(fields[2]) == pgid
        ):
            found.append(int(entry))
    return found


async def assert_gone_within(seconds: float, *, token: str, pgid: int | None = None) -> None:
    deadline = time.monotonic() + seconds
    while live_pids(token=token, pgid=pgid):
        assert time.monotonic() < deadline, f"survivors: {live_pids(token=token, pgid=pgid)}"
        await asyncio.sleep(0.01)


def unique_sleep() -> str:
    """A ``sleep`` argument no other process on the machine uses (so /proc can find ours)."""
    return f"{1000 + uuid.uuid4().int % 10**6 / 1000:.3f}"


async def read_fifo(path: Path, timeout: float = 5.0) -> str:
    """The first line written into the FIFO ``path``, without blocking the event loop."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        async with asyncio.timeout(timeout):
            await ready
        return os.read(fd, 4096).decode()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


# -- output capture (pure) -----------------------------------------------------------------


def test_capture_keeps_head_and_tail_and_counts_the_rest() -> None:
    cap = _Capture(10)
    for chunk in (b"0123", b"456789abcdef", b"", b"ghij"):
        cap.feed(chunk)
    assert cap.total == 20 and cap.elided == 10
    assert cap.text() == "01234\n...[elided 10 bytes]...\nfghij"

    small = _Capture(10)
    small.feed(b"abc")
    small.feed(b"def")
    assert small.elided == 0 and small.text() == "abcdef"


def test_capture_cuts_on_utf8_character_boundaries() -> None:
    cap = _Capture(6)  # 3 head bytes and 3 tail bytes: each would split a 2-byte character
    cap.feed(("é" * 20).encode())
    assert cap.elided == 34
    assert cap.text() == "é\n...[elided 36 bytes]...\né"


# -- exec ------------------------------------------------------------------------------------


async def test_exec_shell_string_argv_and_exit_code(sb: LocalSandbox) -> None:
    r = await sb.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.ok) == (
        3,
        "out\n",
        "err\n",
        False,
        False,
    )
    assert 0 < r.duration < 5
    r = await sb.exec(["printf", "%s|", "a b", "$HOME", ";"])  # no shell: nothing expanded
    assert r.ok and r.stdout == "a b|$HOME|;|"
    assert (await sb.exec(["no-such-command-agentroll"])).exit_code == 127
    assert (await sb.exec("pwd")).stdout.strip() == str(sb.workdir)


async def test_timeout_kills_the_whole_group(sb: LocalSandbox) -> None:
    token = unique_sleep()
    started = time.monotonic()
    r = await sb.exec(f"echo $$; sleep {token} & sleep {token}", timeout=0.3)
    assert r.timed_out and not r.ok and r.exit_code == -9
    assert time.monotonic() - started < 2
    assert r.stdout.strip().isdigit()  # output produced before the timeout is kept
    # In plain mode $$ is the group id on the host; under bwrap it is a namespaced pid.
    pgid = None if sb.is_isolated else int(r.stdout)
    await assert_gone_within(1.0, token=token, pgid=pgid)


async def test_cancellation_kills_the_whole_group(sb: LocalSandbox) -> None:
    token = unique_sleep()
    os.mkfifo(sb.workdir / "ready")
    os.chmod(sb.workdir / "ready", 0o666)  # commands run as the sandbox's uid, not ours
    task = asyncio.create_task(sb.exec(f"sleep {token} & echo $$ > ready; sleep {token}"))
    pid = int(await read_fifo(sb.workdir / "ready"))
    assert live_pids(token=token)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_gone_within(1.0, token=token, pgid=None if sb.is_isolated else pid)


async def test_cancellation_while_starting_kills_the_group(sb: LocalSandbox) -> None:
    token = unique_sleep()
    task = asyncio.create_task(sb.exec(f"sleep {token} & sleep {token}"))
    for _ in range(3):  # let the spawn fork, but not finish connecting the pipes
        await asyncio.sleep(0)
    task.cancel()
    async with asyncio.timeout(5):
        with pytest.raises(asyncio.CancelledError):
            await task
    await assert_gone_within(1.0, token=token)


async def test_background_children_do_not_outlive_the_call(sb: LocalSandbox) -> None:
    token = unique_sleep()
    started = time.monotonic()
    r = await sb.exec(f"sleep {token} & echo started")  # the child holds stdout open
    assert r.ok and r.stdout == "started\n"
    assert time.monotonic() - started < 1
    await assert_gone_within(1.0, token=token)


def proc_status(key: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(key)


def reset_peak_rss() -> int:
    """Reset VmHWM if the kernel lets us; returns the baseline to measure the peak against."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return proc_status("VmRSS")
    except OSError:
        return proc_status("VmHWM")


def exists(path: str | Path) -> bool:
    return os.path.lexists(path)


async def test_huge_output_is_capped_in_bounded_memory(plain: LocalSandbox) -> None:
    baseline = reset_peak_rss()
    n = 100_000_000
    r = await plain.exec(f"head -c {n} /dev/zero | tr '\\0' a; echo done >&2", max_output=4096)
    assert r.ok and r.truncated and r.elided_bytes == n - 4096
    assert r.stdout == "a" * 2048 + f"\n...[elided {n - 4096} bytes]...\n" + "a" * 2048
    assert r.stderr == "done\n"
    assert proc_status("VmHWM") - baseline < 50 * 1024 * 1024


async def test_environment_is_not_inherited(
    sb: LocalSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTROLL_SECRET_TEST", "leaked")
    r = await sb.exec("env", env={"EXTRA": "1"})
    seen = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert "AGENTROLL_SECRET_TEST" not in seen and "leaked" not in r.stdout
    assert seen["EXTRA"] == "1" and seen["HOME"] == str(sb.workdir)
    assert seen["PATH"] == "/usr/local/bin:/usr/bin:/bin" and seen["LANG"] == "C.UTF-8"
    tmpdir = (await sb.exec('echo x > "$TMPDIR/f" && cat "$TMPDIR/f"')).stdout
    assert tmpdir == "x\n"


async def test_stdin(plain: LocalSandbox) -> None:
    assert (await plain.exec("cat", stdin="héllo")).stdout == "héllo"
    assert (await plain.exec(["wc", "-c"], stdin=b"\x00\x01\x02")).stdout.strip() == "3"
    big = b"x" * 1_000_000  # larger than a pipe buffer
    assert (await plain.exec(["wc", "-c"], stdin=big)).stdout.strip() == str(len(big))
    assert (await plain.exec("true", stdin=big)).ok  # unread stdin is no error
    r = await plain.exec("cat", timeout=5)  # no stdin: /dev/null, so cat sees EOF at once
    assert r.ok and r.stdout == ""


async def test_cwd_is_confined_to_the_workdir(plain: LocalSandbox) -> None:
    await plain.write_file("sub/deeper/f", "x")
    r = await plain.exec("pwd; ls", cwd="sub/deeper")
    assert r.stdout == f"{plain.workdir}/sub/deeper\nf\n"
    assert (await plain.exec("pwd", cwd=str(plain.workdir / "sub"))).ok  # absolute inside: fine
    os.symlink("/etc", plain.workdir / "escape")
    for bad in ("..", "sub/../..", "/etc", "escape"):
        with pytest.raises(ValueError, match="outside the working directory"):
            await plain.exec("pwd", cwd=bad)
    with pytest.raises(FileNotFoundError):
        await plain.exec("pwd", cwd="missing")


async def test_argument_checks(plain: LocalSandbox) -> None:
    with pytest.raises(ValueError, match="timeout"):
        await plain.exec("true", timeout=0)
    with pytest.raises(ValueError, match="max_output"):
        await plain.exec("true", max_output=0)
    with pytest.raises(ValueError, match="non-empty"):
        await plain.exec([])


async def test_read_and_write_files(sb: LocalSandbox) -> None:
    await sb.write_file("a/b/c.txt", "héllo")
    await sb.write_file("raw.bin", b"\x00\xff")
    assert await sb.read_file("a/b/c.txt") == "héllo".encode()
    assert await sb.read_file("./a/../raw.bin") == b"\x00\xff"
    assert (await sb.exec("cat a/b/c.txt")).stdout == "héllo"
    await sb.exec("echo from-cmd > made")
    assert await sb.read_file("made") == b"from-cmd\n"
    with pytest.raises(FileNotFoundError):
        await sb.read_file("missing")
    os.symlink("/etc/passwd", sb.workdir / "link")
    for bad in ("../x", "a/../../x", "/etc/passwd", "link"):
        with pytest.raises(ValueError):
            await sb.read_file(bad)
        with pytest.raises(ValueError):
            await sb.write_file(bad, "x")


async def test_snapshot_restore_round_trip(plain: LocalSandbox) -> None:
    await plain.write_file("keep.txt", "v1")
    await plain.write_file("dir/nested.bin", bytes(range(256)))
    await plain.exec("ln -s dir/nested.bin link && chmod +x keep.txt && mkdir empty")
    blob = await plain.snapshot()

    await plain.write_file("keep.txt", "v2")
    await plain.exec("rm -r dir empty && echo new > extra")
    await plain.restore(blob)
    assert await plain.read_file("keep.txt") == b"v1"
    assert await plain.read_file("link") == bytes(range(256))
    assert os.readlink(plain.workdir / "link") == "dir/nested.bin"
    assert os.access(plain.workdir / "keep.txt", os.X_OK)
    assert (plain.workdir / "empty").is_dir()
    assert not (plain.workdir / "extra").exists()
    assert (await plain.exec('touch "$TMPDIR/t"')).ok  # TMPDIR is back

    async with make("plain") as other:  # a snapshot moves to another sandbox
        await other.restore(blob)
        assert await other.read_file("dir/nested.bin") == bytes(range(256))


def tar_with(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = linkname
        tar.addfile(info, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


async def test_restore_rejects_unsafe_blobs_and_keeps_the_workdir(plain: LocalSandbox) -> None:
    await plain.write_file("precious", "data")
    bad_blobs = [
        tar_with("../evil"),
        tar_with("/abs/evil"),
        tar_with("a/../../evil"),
        tar_with("link", tarfile.SYMTYPE, "/etc"),
        tar_with("link", tarfile.SYMTYPE, "../../etc"),
        tar_with("hard", tarfile.LNKTYPE, "/etc/passwd"),
        tar_with("dev", tarfile.CHRTYPE),
        b"not a tar archive at all" * 40,
    ]
    for blob in bad_blobs:
        with pytest.raises(ValueError):
            await plain.restore(blob)
        assert sorted(os.listdir(plain.workdir)) == [".tmp", "precious"]
    assert not exists("/evil") and not exists(plain.workdir.parent / "evil")


async def test_close_is_idempotent_removes_the_dir_and_kills_commands() -> None:
    sandbox = make("plain")
    r = await sandbox.exec("mkdir -p ro/inner && touch ro/inner/f && chmod 0 ro/inner ro")
    assert r.ok  # exec before start() starts the sandbox
    workdir = sandbox.workdir
    token = unique_sleep()
    os.mkfifo(workdir / "ready")
    os.chmod(workdir / "ready", 0o666)  # commands run as the sandbox's uid, not ours
    running = asyncio.create_task(sandbox.exec(f"echo go > ready; sleep {token}", timeout=60))
    assert await read_fifo(workdir / "ready") == "go\n"
    await sandbox.close()
    await sandbox.close()
    assert not workdir.exists() and not workdir.parent.exists()
    r = await asyncio.wait_for(running, 2)
    assert r.exit_code == -9 and not r.timed_out
    with pytest.raises(SandboxError, match="closed"):
        await sandbox.exec("true")
    with pytest.raises(SandboxError, match="closed"):
        await sandbox.read_file("x")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preexec", [False, True], ids=["prlimit", "preexec_fn"])
async def test_file_size_limit(mode: str, preexec: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if preexec:
        monkeypatch.setattr(local, "_prlimit_exe", None)
    elif local._prlimit_exe is None:
        pytest.skip("util-linux prlimit is not installed")
    async with make(mode, file_size_mb=1) as sandbox:
        assert isinstance(sandbox, LocalSandbox)
        r = await sandbox.exec("head -c 3000000 /dev/zero > big")
        assert r.exit_code != 0
        assert (sandbox.workdir / "big").stat().st_size <= 1024 * 1024
        assert (await sandbox.exec("head -c 1000 /dev/zero > small")).ok


async def test_memory_and_open_file_limits() -> None:
    async with make("plain", memory_mb=200, open_files=32) as sandbox:
        r = await sandbox.exec(["python3", "-c", "b = bytearray(500 * 1024 * 1024)"])
        assert r.exit_code != 0 and "MemoryError" in r.stderr
        assert (await sandbox.exec("ulimit -n")).stdout.strip() == "32"


# -- bubblewrap --------------------------------------------------------------------------------


@pytest.mark.bwrap
@BWRAP_SKIP
async def test_bwrap_host_is_read_only() -> None:
    sandbox = make("bwrap")
    async with sandbox:
        for path in ("/etc/agentroll_x", "/root/agentroll_x", "/usr/agentroll_x"):
            r = await sandbox.exec(["touch", path])
            assert r.exit_code != 0, path
            assert not exists(path)
        assert (await sandbox.exec("touch inside && touch /tmp/private")).ok
        assert exists(sandbox.workdir / "inside")
        assert not exists("/tmp/private")  # /tmp is the sandbox's own tmpfs
        assert "docker.sock" not in (await sandbox.exec("ls /run /var/run")).stdout


@pytest.mark.bwrap
@BWRAP_SKIP
async def test_bwrap_has_no_network_unless_asked() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        probe = (
            "import socket, sys\n"
            "for addr in sys.argv[1:]:\n"
            "    host, port = addr.rsplit(':', 1)\n"
            "    try:\n"
            "        socket.create_connection((host, int(port)), timeout=2).close()\n"
            "        print(addr, 'ok')\n"
            "    except OSError as exc:\n"
            "        print(addr, 'fail', exc.errno)\n"
        )
        argv = ["python3", "-c", probe, f"127.0.0.1:{port}", "1.1.1.1:53"]
        async with make("bwrap") as sandbox:
            r = await sandbox.exec(argv)
            assert r.ok, r.stderr
            lines = r.stdout.splitlines()
            assert lines[0].startswith(f"127.0.0.1:{port} fail")
            assert lines[1].startswith("1.1.1.1:53 fail")
        async with make("bwrap", network=True) as sandbox:
            r = await sandbox.exec(argv[:4])
            assert r.stdout.startswith(f"127.0.0.1:{port} ok"), r


async def test_bwrap_required_but_missing_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "_bwrap_works", False)
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        await make("bwrap").start()


async def test_bwrap_missing_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(local, "_bwrap_works", False)
    monkeypatch.setattr(local, "_bwrap_warned", False)
    with caplog.at_level(logging.WARNING, logger="agentroll.sandbox"):
        for _ in range(2):
            async with LocalSandbox(SandboxConfig(use_bwrap=None)) as sandbox:
                assert isinstance(sandbox, LocalSandbox) and not sandbox.is_isolated
                assert (await sandbox.exec("echo ok")).stdout == "ok\n"
    warnings = [r for r in caplog.records if r.name == "agentroll.sandbox"]
    assert len(warnings) == 1 and "apt-get install bubblewrap" in warnings[0].getMessage()
