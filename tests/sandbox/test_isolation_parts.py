"""The pure parts of local isolation: the bubblewrap argv and cgroup bookkeeping (on a fake
cgroup tree, v1 and v2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentroll.sandbox import _cgroup
from agentroll.sandbox._bwrap import bwrap_argv, make_etc, passwd_lines


def _fake_host(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    (root / "usr" / "bin").mkdir(parents=True)
    os.symlink("usr/bin", root / "bin")
    (root / "lib64").mkdir()
    (root / "etc").mkdir()
    for name in ("ld.so.cache", "shadow", "hosts", "resolv.conf"):
        (root / "etc" / name).write_text("x")
    return root


@pytest.mark.parametrize("network", [False, True])
def test_bwrap_binds_only_system_dirs_and_non_secret_etc(tmp_path: Path, network: bool) -> None:
    host = _fake_host(tmp_path)
    work = tmp_path / "sb" / "work"
    argv = bwrap_argv(
        "bwrap",
        workdir=work,
        run_dir=work,
        etc_dir=tmp_path / "sb" / "etc",
        tmp_bytes=1 << 20,
        network=network,
        host_root=host,
    )
    joined = " ".join(argv)
    assert "--ro-bind / /" not in joined and "--bind / /" not in joined
    assert f"--ro-bind {host}/usr /usr" in joined and "--symlink usr/bin /bin" in joined
    assert f"--ro-bind {host}/lib64 /lib64" in joined
    assert f"--ro-bind {tmp_path}/sb/etc /etc" in joined
    assert ("--share-net" in argv) == network
    for flag in ("--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"):
        assert flag in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    at = argv.index("--tmpfs")
    assert argv[at - 4 : at + 2] == ["--size", str(1 << 20), "--perms", "1777", "--tmpfs", "/tmp"]
    assert argv[-3:] == ["--remount-ro", "/", "--"]  # the root is read-only, after all mounts


def test_passwd_names_only_root_and_the_sandbox_user() -> None:
    passwd, group = passwd_lines("/w")
    assert [ln.split(":")[0] for ln in passwd.splitlines()] == ["root", "sandbox"]
    assert "sandbox:x:1000:1000::/w:/bin/sh" in passwd and group.count("\n") == 2


def test_the_sandbox_etc_copies_no_secret(tmp_path: Path) -> None:
    host = _fake_host(tmp_path)
    os.symlink("/usr/bin/python3.11", host / "etc" / "python-link")  # not on the list
    (host / "etc" / "alternatives").mkdir()
    os.symlink("/usr/bin/mawk", host / "etc" / "alternatives" / "awk")
    etc = tmp_path / "etc"
    etc.mkdir()
    make_etc(etc, host_root=host)
    names = ["alternatives", "group", "hosts", "ld.so.cache", "passwd", "resolv.conf"]
    assert sorted(os.listdir(etc)) == names
    assert os.readlink(etc / "alternatives" / "awk") == "/usr/bin/mawk"
    assert (etc / "passwd").read_text() == passwd_lines()[0]


def test_cgroup_v1_writes_limits_and_joins(tmp_path: Path) -> None:
    for controller in ("memory", "pids", "cpu"):
        (tmp_path / controller).mkdir()
    cg = _cgroup.open_cgroups("o-1", memory_bytes=64 << 20, pids=32, cpus=0.5, root=tmp_path)
    assert cg is not None and cg.version == 1
    base = "agentroll/o-1"
    assert (tmp_path / "memory" / base / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (tmp_path / "pids" / base / "pids.max").read_text() == "32"
    assert (tmp_path / "cpu" / base / "cpu.cfs_quota_us").read_text() == "50000"
    group, joins = cg.exec_group(3)
    assert group == tmp_path / "pids" / base / "exec-3"
    assert sorted(str(j.relative_to(tmp_path)) for j in joins) == [
        f"cpu/{base}/cgroup.procs",
        f"memory/{base}/cgroup.procs",
        f"pids/{base}/exec-3/cgroup.procs",
    ]


def test_cgroup_v2_writes_limits_under_a_delegated_parent(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids")
    (tmp_path / "cgroup.subtree_control").write_text("")
    own = Path("/proc/self/cgroup").read_text()
    if "0::" not in own:
        pytest.skip("no unified hierarchy line in /proc/self/cgroup")
    line = next(ln for ln in own.splitlines() if ln.startswith("0::"))
    mine = tmp_path / line[3:].lstrip("/")
    parent = mine.parent if mine != tmp_path else tmp_path
    parent.mkdir(parents=True, exist_ok=True)
    (parent / "cgroup.subtree_control").write_text("")
    cg = _cgroup.open_cgroups("o-2", memory_bytes=1 << 30, pids=8, cpus=2, root=tmp_path)
    assert cg is not None and cg.version == 2
    d = parent / "agentroll" / "o-2"
    assert (d / "memory.max").read_text() == str(1 << 30)
    assert (d / "pids.max").read_text() == "8"
    assert (d / "cpu.max").read_text() == "200000 100000"
    _, joins = cg.exec_group(0)
    assert joins == [d / "exec-0" / "cgroup.procs"]


def test_no_usable_cgroups_is_none(tmp_path: Path) -> None:
    assert _cgroup.open_cgroups("x", memory_bytes=1, pids=8, cpus=1, root=tmp_path) is None


def test_kill_members_kills_until_the_group_is_empty(tmp_path: Path) -> None:
    procs = tmp_path / "cgroup.procs"
    procs.write_text("11\n12\n")
    killed: list[int] = []

    def kill(pid: int, sig: int) -> None:
        killed.append(pid)
        if len(killed) == 2:  # the first round forked one more before dying
            procs.write_text("13\n")
        elif len(killed) == 3:
            procs.write_text("")

    assert _cgroup.kill_members(tmp_path, kill=kill)
    assert killed == [11, 12, 13]
    procs.write_text("14\n")
    assert not _cgroup.kill_members(tmp_path, kill=lambda p, s: None, rounds=3)
