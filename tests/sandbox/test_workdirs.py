"""Working directories left by a process that died before it cleaned up: named after their
owner, and removed by the sweep a later process runs, never while the owner lives."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentroll.sandbox import _files, local
from agentroll.sandbox._files import _make_workdir, reap_workdirs, workdir_owner
from agentroll.sandbox._owner import me, owner_alive, start_ticks
from agentroll.sandbox.base import SandboxConfig
from agentroll.sandbox.local import LocalSandbox, bwrap_available

TAG = _files._HOST_TAG


def test_owner_is_read_back_from_the_names_this_process_makes(tmp_path: Path) -> None:
    made = _make_workdir(make_tmp=False)
    try:
        assert workdir_owner(made.name) == me()
    finally:
        made.rmdir()
    assert workdir_owner(f"agentroll-sb-{TAG}.123.456-abcd") == (123, "456")
    assert workdir_owner(f".agentroll-restore-{TAG}.7.8-x") == (7, "8")
    for name in (
        "agentroll-sb-0ad6bma8",  # made by an older version: no owner in the name
        f"agentroll-sb-{'0' * 8}.123.456-abcd",  # another host (or pid namespace)
        f"agentroll-sb-{TAG}.12x.456-abcd",
        f"agentroll-sb-{TAG}.123-abcd",
        f"agentroll-sb-{TAG}.123.456",  # no random part
        f"other-{TAG}.123.456-abcd",
    ):
        assert workdir_owner(name) is None, name


def test_sweep_removes_only_dirs_whose_owner_is_gone(tmp_path: Path) -> None:
    dead = tmp_path / f"agentroll-sb-{TAG}.111.5-a"
    staging = tmp_path / f".agentroll-restore-{TAG}.111.5-b"
    live = tmp_path / f"agentroll-sb-{TAG}.222.5-c"
    old = tmp_path / "agentroll-sb-0ad6bma8"
    other_host = tmp_path / "agentroll-sb-00000000.111.5-d"
    for d in (dead, staging, live, old, other_host):
        d.mkdir()
    (dead / "sub").mkdir()
    (dead / "sub" / "f.txt").write_text("x")
    (dead / "sub").chmod(0)  # a command may leave a directory we cannot enter
    not_a_dir = tmp_path / f"agentroll-sb-{TAG}.111.5-e"
    not_a_dir.write_text("a file that happens to look like a workdir")

    removed = reap_workdirs(tmp_path, alive=lambda pid, ticks: pid == 222)

    assert sorted(removed) == sorted([dead, staging])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (live, old, other_host, not_a_dir)
    )
    assert reap_workdirs(tmp_path / "missing") == []


def test_a_reused_pid_does_not_keep_a_dead_owner_alive() -> None:
    pid, ticks = me()
    assert owner_alive(pid, ticks)
    assert not owner_alive(pid, str(int(ticks) + 1))  # same pid, started at another time
    assert start_ticks(2**22 + 12345) == ""


_CHILD = """
import asyncio, sys
from agentroll.sandbox.local import LocalSandbox, bwrap_available
from agentroll.sandbox.base import SandboxConfig

async def main():
    sb = LocalSandbox(SandboxConfig(use_bwrap=False))
    await sb.start()
    await sb.write_file("notes.txt", "work in progress")
    print(sb.workdir, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_a_killed_worker_leaves_a_dir_that_the_next_sweep_removes(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None
        workdir = Path(child.stdout.readline().strip())
        # the sandbox's directory holds the working directory ("work") and its /etc files
        assert workdir.parent.parent == tmp_path and (workdir / "notes.txt").exists()
        assert reap_workdirs(tmp_path) == []  # its owner runs: kept
        assert workdir.exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert workdir.exists()  # no chance to clean up
    assert reap_workdirs(tmp_path) == [workdir.parent]
    assert not workdir.parent.exists()


@pytest.mark.bwrap
@pytest.mark.skipif(not bwrap_available(), reason="bubblewrap missing: apt-get install bubblewrap")
def test_a_worker_in_another_pid_namespace_is_not_taken_for_dead(tmp_path: Path) -> None:
    # two containers of one pod: one host name, one /tmp volume, two pid namespaces.  The
    # other worker is pid 1 or 2 in its namespace; here those pids are other processes.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = ["bwrap", "--unshare-pid", "--die-with-parent", "--dev-bind", "/", "/", "--proc", "/proc"]
    child = subprocess.Popen(
        [*cmd, sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None
        workdir = Path(child.stdout.readline().strip())
        # its files are on a tmpfs mounted in the other namespace; the directory is shared
        assert workdir.parent.parent == tmp_path and workdir.parent.is_dir()
        assert workdir_owner(workdir.parent.name) is None  # not a process of this pid namespace
        assert reap_workdirs(tmp_path) == []
        assert workdir.parent.is_dir()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)


async def test_the_first_sandbox_of_a_process_sweeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(local, "_reaped", None)
    pid, ticks = me()
    stale = tmp_path / f"agentroll-sb-{TAG}.{pid}.{int(ticks) + 1}-old"  # pid reused since
    stale.mkdir()
    sandbox = LocalSandbox(SandboxConfig(use_bwrap=False))
    try:
        await sandbox.start()
        assert not stale.exists()
        assert sandbox.workdir.parent.parent == await asyncio.to_thread(tmp_path.resolve)
        stale.mkdir()  # made after the sweep: the next sandbox of this process leaves it
        second = LocalSandbox(SandboxConfig(use_bwrap=False))
        await second.start()
        assert stale.exists()
        await second.close()
    finally:
        await sandbox.close()
