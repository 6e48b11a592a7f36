"""The local sandbox under bubblewrap holds against root inside it: every probe of
``agentroll sandbox audit`` is contained (escapes: capabilities, remounts, unmounting /tmp
and /proc, host secrets and sockets, network, survivors, foreign fds; limits: pids, memory,
/tmp, working directory, root filesystem, CPU as totals per sandbox)."""

from __future__ import annotations

import logging
import os

import msgspec
import pytest

from agentroll.sandbox import local
from agentroll.sandbox.audit import AUDIT_CONFIG, PROBES, audit
from agentroll.sandbox.base import SandboxConfig
from agentroll.sandbox.local import LocalSandbox, bwrap_available

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(
        not bwrap_available(), reason="bubblewrap missing: apt-get install bubblewrap"
    ),
]

# Per-sandbox totals need root here (cgroups, tmpfs mounts, a uid per sandbox); the
# escapes must be contained for any caller.
LIMITS = {"pids_total", "memory_total", "cpu_total", "workdir_size"}
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox totals need root here")


@pytest.mark.parametrize(
    "probe", [pytest.param(p, marks=[NEEDS_ROOT] if p in LIMITS else []) for p in PROBES]
)
async def test_probe_is_contained(probe: str) -> None:
    config = msgspec.structs.replace(AUDIT_CONFIG, use_bwrap=True)
    (finding,) = await audit("local", config=config, probes=[probe])
    assert finding.status == "contained", finding.line()


@NEEDS_ROOT
async def test_commands_run_as_the_sandboxes_own_uid() -> None:
    async with (
        LocalSandbox(SandboxConfig(use_bwrap=True)) as a,
        LocalSandbox(SandboxConfig(use_bwrap=True)) as b,
    ):
        await a.write_file("f.txt", "written by the host\n")
        r = await a.exec("echo more >> f.txt && cat f.txt && id -u")
        assert r.ok and r.stdout == "written by the host\nmore\n1000\n", r
        uid_a = os.stat(a.workdir / "f.txt").st_uid
        uid_b = os.stat(b.workdir).st_uid
        assert uid_a not in (0, uid_b) and uid_b != 0
        assert a.enforced["uid"] == "per sandbox"


async def test_a_limit_the_host_cannot_enforce_is_named_in_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(local, "_warned", set())
    monkeypatch.setattr(local._cgroup, "open_cgroups", lambda *a, **k: None)
    monkeypatch.setattr(local, "mount_tmpfs", _refuse_mount)
    with caplog.at_level(logging.WARNING, logger="agentroll.sandbox"):
        async with LocalSandbox(SandboxConfig(use_bwrap=True)) as sb:
            assert (await sb.exec("true")).ok
            enforced = sb.enforced
    assert enforced["memory_mb"].startswith("none") and enforced["disk_mb"].startswith("none")
    text = caplog.text
    for limit in ("memory_mb", "cpus", "disk_mb"):
        assert f"{limit} is not enforced" in text, text
    if os.geteuid() == 0:  # the sandbox uid's RLIMIT_NPROC still bounds the total
        assert enforced["pids"] == "RLIMIT_NPROC of the sandbox uid"


def _refuse_mount(*args: object, **kwargs: object) -> None:
    raise PermissionError(1, "mount: operation not permitted")
