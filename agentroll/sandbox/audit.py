"""``agentroll sandbox audit``: escape and limit probes run inside a real sandbox.

Each probe is a small Python program run through the ``Sandbox`` API under deliberately
small limits (``AUDIT_CONFIG``); what it prints and what the host sees decide
``contained``, ``escaped`` or ``unbounded``.  Invariant: the host side removes what it
plants for the probes (a marker process, a listening socket, a file in the host's /tmp).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from agentroll.sandbox import open_sandbox
from agentroll.sandbox.base import Sandbox, SandboxConfig

__all__ = ["AUDIT_CONFIG", "PROBES", "Finding", "audit", "main_audit"]

# Small limits, so a limit that holds is quick to hit and one that does not is visible.
AUDIT_CONFIG = SandboxConfig(
    timeout=60.0, memory_mb=256, pids=64, cpus=0.5, tmp_mb=32, disk_mb=64, file_size_mb=512
)
_MIB = 1 << 20


@dataclass(frozen=True)
class Finding:
    probe: str
    status: str  # "contained" | "escaped" | "unbounded"
    detail: str

    def line(self) -> str:
        return f"probe={self.probe} status={self.status} detail={json.dumps(self.detail)}"


@dataclass
class Host:
    """What the host plants for the probes to look for."""

    token: str
    marker_pid: int
    port: int
    tmp_marker: Path
    secrets: list[str]
    sockets: list[str]
    config: SandboxConfig


Probe = Callable[[Sandbox, Host], Awaitable[Finding]]


async def _py(sandbox: Sandbox, code: str, *args: str, timeout: float = 60.0) -> dict[str, object]:
    """Run ``code`` with python3 in the sandbox; it prints one JSON object last."""
    r = await sandbox.exec(["python3", "-c", code, *args], timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"exit {r.exit_code}: {(r.stderr or r.stdout)[-300:]}"}
    out: dict[str, object] = json.loads(lines[-1])
    return out


def _verdict(name: str, bad: bool, bad_status: str, detail: str) -> Finding:
    return Finding(name, bad_status if bad else "contained", detail)


async def probe_capabilities(sb: Sandbox, host: Host) -> Finding:
    code = """
import json
caps = {k: v for k, v in (l.split(":\\t") for l in open("/proc/self/status").read().splitlines() if l.startswith("Cap"))}
print(json.dumps({"eff": caps.get("CapEff", "?").strip(), "uid": __import__("os").getuid()}))
"""
    out = await _py(sb, code)
    eff = str(out.get("eff", "?"))
    bad = eff == "?" or int(eff, 16) != 0
    return _verdict("capabilities", bad, "escaped", f"CapEff={eff} uid={out.get('uid')}")


async def probe_remount_root(sb: Sandbox, host: Host) -> Finding:
    code = """
import json, subprocess, os
r = subprocess.run(["mount", "-o", "remount,rw,bind", "/"], capture_output=True)
wrote = []
for d in ("/", "/usr", "/etc", "/var", "/opt"):
    p = os.path.join(d, ".agentroll-audit-" + __import__("sys").argv[1])
    try:
        open(p, "w").write("x"); os.unlink(p); wrote.append(d)
    except OSError:
        pass
print(json.dumps({"remount": r.returncode, "wrote": wrote}))
"""
    out = await _py(sb, code, host.token)
    wrote = out.get("wrote") or []
    bad = out.get("remount") == 0 or bool(wrote) or "error" in out
    return _verdict("remount_root", bad, "escaped", f"remount={out.get('remount')} wrote={wrote}")


async def probe_unmount(sb: Sandbox, host: Host) -> Finding:
    code = """
import json, os, subprocess, sys
tmp = subprocess.run(["umount", "-l", "/tmp"], capture_output=True).returncode
proc = subprocess.run(["umount", "-l", "/proc"], capture_output=True).returncode
seen_tmp = os.path.exists(sys.argv[1])
seen_proc = False
marker = sys.argv[2][::-1].encode()  # given reversed, so our own argv does not match
for pid in os.listdir("/proc"):
    try:
        if marker in open(f"/proc/{pid}/cmdline", "rb").read():
            seen_proc = True
    except OSError:
        pass
print(json.dumps({"umount_tmp": tmp, "umount_proc": proc, "host_tmp": seen_tmp, "host_proc": seen_proc}))
"""
    out = await _py(sb, code, str(host.tmp_marker), host.token[::-1])
    bad = bool(out.get("host_tmp") or out.get("host_proc")) or "error" in out
    return _verdict("unmount_tmp_proc", bad, "escaped", json.dumps(out))


async def probe_host_processes(sb: Sandbox, host: Host) -> Finding:
    code = """
import json, os, sys
pids = [p for p in os.listdir("/proc") if p.isdigit()]
marker = sys.argv[1][::-1].encode()  # given reversed, so our own argv does not match
seen = any(marker in open(f"/proc/{p}/cmdline", "rb").read() for p in pids if os.path.exists(f"/proc/{p}/cmdline"))
print(json.dumps({"visible": len(pids), "marker": seen}))
"""
    out = await _py(sb, code, host.token[::-1])
    bad = bool(out.get("marker")) or "error" in out
    return _verdict("host_processes", bad, "escaped", json.dumps(out))


async def probe_host_secrets(sb: Sandbox, host: Host) -> Finding:
    code = """
import json, os, sys
readable = []
for p in sys.argv[1:]:
    try:
        if os.path.isdir(p):
            os.listdir(p)
        else:
            open(p, "rb").read(1)
        readable.append(p)
    except OSError:
        pass
print(json.dumps({"readable": readable}))
"""
    out = await _py(sb, code, *host.secrets)
    readable = out.get("readable") or []
    bad = bool(readable) or "error" in out
    return _verdict("host_secrets", bad, "escaped", f"readable={readable} of {len(host.secrets)}")


async def probe_host_sockets(sb: Sandbox, host: Host) -> Finding:
    code = """
import json, socket, subprocess, sys
for mount in ("/tmp", "/run", "/var/run"):  # sockets hidden only by a mount on top
    subprocess.run(["umount", "-l", mount], capture_output=True)
reached = []
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    try:
        s.connect(path); reached.append(path)
    except OSError:
        pass
    finally:
        s.close()
print(json.dumps({"reached": reached}))
"""
    out = await _py(sb, code, *host.sockets)
    reached = out.get("reached") or []
    bad = bool(reached) or "error" in out
    return _verdict(
        "host_unix_sockets", bad, "escaped", f"reached={reached} of {len(host.sockets)}"
    )


async def probe_network(sb: Sandbox, host: Host) -> Finding:
    code = """
import json, socket, sys
s = socket.socket(); s.settimeout(2)
try:
    s.connect(("127.0.0.1", int(sys.argv[1]))); ok = True
except OSError as e:
    ok = False
ifaces = [n for _, n in socket.if_nameindex()]
print(json.dumps({"loopback_port": ok, "interfaces": ifaces}))
"""
    out = await _py(sb, code, str(host.port))
    listed = out.get("interfaces")
    ifaces = [str(i) for i in listed if i != "lo"] if isinstance(listed, list) else []
    bad = bool(out.get("loopback_port")) or bool(ifaces) or "error" in out
    return _verdict("network", bad, "escaped", json.dumps(out))


async def probe_survivor(sb: Sandbox, host: Host) -> Finding:
    tag = f"agentroll-survivor-{host.token}"
    await sb.exec(
        f"setsid sh -c 'exec -a {tag} sleep 60' </dev/null >/dev/null 2>&1 & "
        f"(sh -c 'exec -a {tag} sleep 60' &) ; nohup sh -c 'exec -a {tag} sleep 60' "
        ">/dev/null 2>&1 & echo started",
        timeout=10,
    )
    left = await asyncio.to_thread(_host_pids, tag)
    inside = await sb.exec(f"ps -eo args 2>/dev/null | grep -c '^{tag}' || true", timeout=10)
    n_inside = int(inside.stdout.strip() or 0) if inside.stdout.strip().isdigit() else 0
    bad = bool(left) or n_inside > 0
    return _verdict("survivor", bad, "escaped", f"host_pids={left} seen_by_next_exec={n_inside}")


async def probe_foreign_fds(sb: Sandbox, host: Host) -> Finding:
    # A process whose stdout is not ours (the docker agent's channel, a harness's pipe) must
    # not be writable or signalable by a command.
    code = """
import json, os, signal
me = os.getpid()
mine = os.readlink("/proc/self/fd/1")
ancestors, p = set(), me
while p > 1:
    try:
        p = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]); ancestors.add(p)
    except OSError:
        break
opened, signalled = [], []
for pid in (int(x) for x in os.listdir("/proc") if x.isdigit()):
    if pid == me:
        continue
    for fd in (0, 1):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target == mine or target.startswith("/dev/null"):
            continue
        try:
            os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)); opened.append([pid, fd, target])
        except OSError:
            pass
    if pid not in ancestors and pid != 1:
        try:
            os.kill(pid, 0); signalled.append(pid)
        except OSError:
            pass
print(json.dumps({"opened": opened, "signalable_non_ancestors": signalled}))
"""
    out = await _py(sb, code)
    bad = bool(out.get("opened")) or "error" in out
    return _verdict("foreign_fds", bad, "escaped", json.dumps(out))


async def probe_pids(sb: Sandbox, host: Host) -> Finding:
    limit = host.config.pids
    code = """
import json, os, sys, time
want, kids = int(sys.argv[1]), []
for _ in range(want):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30); os._exit(0)
    kids.append(pid)
print(json.dumps({"forked": len(kids)}), flush=True)
for k in kids:
    os.kill(k, 9)
"""
    out = await _py(sb, code, str(limit * 3), timeout=60)
    forked = int(out.get("forked", -1))  # type: ignore[call-overload]
    bad = forked < 0 or forked >= limit
    return _verdict("pids_total", bad, "unbounded", f"forked={forked} limit={limit}")


async def probe_memory(sb: Sandbox, host: Host) -> Finding:
    limit = host.config.memory_mb
    each = max(16, limit * 3 // 10)
    code = """
import json, os, select, struct, sys, time
each, n = int(sys.argv[1]), 6
r, w = os.pipe()
alive = set()
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        b = bytearray(each << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        os.write(w, struct.pack("i", os.getpid()))
        time.sleep(30)
        os._exit(0)
    alive.add(pid)
os.close(w)
reported = set()
deadline = time.time() + 20
while time.time() < deadline and not alive <= reported:
    for k in list(alive):
        if os.waitpid(k, os.WNOHANG)[0]:
            alive.discard(k)
    if select.select([r], [], [], 0.1)[0]:
        data = os.read(r, 4096)
        reported.update(struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]))
time.sleep(0.3)  # the kernel's OOM killer acts on the last allocation
for k in list(alive):
    if os.waitpid(k, os.WNOHANG)[0]:
        alive.discard(k)
print(json.dumps({"held": len(reported & alive), "killed": n - len(alive), "each_mb": each}), flush=True)
for k in alive:
    os.kill(k, 9)
"""
    out = await _py(sb, code, str(each), timeout=60)
    total = int(out.get("held", 0)) * each  # type: ignore[call-overload]
    bad = "error" in out or total > limit * 1.1
    return _verdict(
        "memory_total", bad, "unbounded", f"held_mb={total} limit_mb={limit} ({json.dumps(out)})"
    )


def _fill_code() -> str:
    return """
import json, os, sys
path, want = sys.argv[1], int(sys.argv[2])
written, chunk = 0, b"\\0" * (1 << 20)
try:
    with open(path, "wb") as f:
        while written < want:
            f.write(chunk); f.flush(); written += len(chunk)
except OSError as e:
    err = e.strerror
else:
    err = None
try: os.unlink(path)
except OSError: pass
print(json.dumps({"written_mb": written >> 20, "error": err}))
"""


async def probe_tmp(sb: Sandbox, host: Host) -> Finding:
    limit = host.config.tmp_mb
    out = await _py(sb, _fill_code(), "/tmp/fill", str(limit * 3 * _MIB))
    written = int(out.get("written_mb", 10**9))  # type: ignore[call-overload]
    return _verdict(
        "tmp_size", written > limit * 1.05, "unbounded", f"written_mb={written} limit_mb={limit}"
    )


async def probe_disk(sb: Sandbox, host: Host) -> Finding:
    limit = host.config.disk_mb
    out = await _py(sb, _fill_code(), "fill.bin", str(limit * 3 * _MIB))
    written = int(out.get("written_mb", 10**9))  # type: ignore[call-overload]
    return _verdict(
        "workdir_size",
        written > limit * 1.05,
        "unbounded",
        f"written_mb={written} limit_mb={limit}",
    )


async def probe_rootfs(sb: Sandbox, host: Host) -> Finding:
    limit = host.config.disk_mb
    worst = 0
    where = []
    for d in ("/", "/var/tmp", "/home", "/root", "/opt", "/srv", "/run"):
        out = await _py(sb, _fill_code(), f"{d.rstrip('/')}/.agentroll-fill", str(limit * 3 * _MIB))
        written = int(out.get("written_mb", 0))  # type: ignore[call-overload]
        if written:
            where.append(f"{d}:{written}")
        worst = max(worst, written)
    return _verdict(
        "rootfs_write", worst > limit * 1.05, "unbounded", f"writable={where} limit_mb={limit}"
    )


async def probe_cpu(sb: Sandbox, host: Host) -> Finding:
    cpus = host.config.cpus
    code = """
import json, os, time
n, wall = 4, 2.0
kids = []
start = time.time()
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        end = time.time() + wall
        while time.time() < end:
            pass
        os._exit(0)
    kids.append(pid)
for k in kids:
    os.waitpid(k, 0)
t = os.times()
print(json.dumps({"cpu_s": t.children_user + t.children_system, "wall_s": time.time() - start}))
"""
    out = await _py(sb, code, timeout=60)
    wall = float(out.get("wall_s", 0) or 0)  # type: ignore[arg-type]
    used = float(out.get("cpu_s", 0) or 0) / max(float(out.get("wall_s", 1) or 1), 1e-3)  # type: ignore[arg-type]
    bad = "error" in out or used > cpus * 1.3
    return _verdict(
        "cpu_total", bad, "unbounded", f"cores_used={used:.2f} limit={cpus} wall_s={wall:.1f}"
    )


PROBES: dict[str, Probe] = {
    "capabilities": probe_capabilities,
    "remount_root": probe_remount_root,
    "unmount_tmp_proc": probe_unmount,
    "host_processes": probe_host_processes,
    "host_secrets": probe_host_secrets,
    "host_unix_sockets": probe_host_sockets,
    "network": probe_network,
    "survivor": probe_survivor,
    "foreign_fds": probe_foreign_fds,
    "pids_total": probe_pids,
    "memory_total": probe_memory,
    "tmp_size": probe_tmp,
    "workdir_size": probe_disk,
    "rootfs_write": probe_rootfs,
    "cpu_total": probe_cpu,
}


def _host_pids(tag: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag.encode() in raw and state != "Z":
            found.append(int(entry))
    return found


def _host_secrets() -> list[str]:
    home = Path.home()
    paths = [
        "/etc/shadow",
        "/etc/gshadow",
        "/etc/sudoers",
        "/root",
        str(home),
        str(home / ".cache"),
        str(home / ".ssh"),
        str(Path(__file__).resolve().parents[2]),  # the project tree (agentroll/sandbox/..)
        sys.prefix,  # the virtual environment
        str(Path(sys.executable).resolve()),
    ]
    return sorted({p for p in paths if os.path.exists(p)})


def _host_sockets(limit: int = 64) -> list[str]:
    paths: set[str] = set()
    for url in (os.environ.get("DOCKER_HOST", ""), os.environ.get("AGENTROLL_DOCKER_HOST", "")):
        if url.startswith("unix://"):
            paths.add(url[len("unix://") :])
    for known in ("/var/run/docker.sock", "/run/docker.sock", "/tmp/agentroll-dockerd/docker.sock"):
        paths.add(known)
    try:
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7].startswith("/"):
                paths.add(fields[7])
    except OSError:
        pass
    return sorted(p for p in paths if os.path.exists(p))[:limit]


async def audit(
    backend: str = "local",
    *,
    config: SandboxConfig | None = None,
    probes: list[str] | None = None,
    on_finding: Callable[[Finding], None] | None = None,
) -> list[Finding]:
    """Run ``probes`` (default: all) in a fresh sandbox of ``backend`` each; returns the
    findings in order.  Raises ``SandboxError`` if a sandbox cannot be started.

    A probe runs as model-written code would; ``escaped`` means it reached something outside,
    ``unbounded`` that it used more than its limit.
    """
    cfg = msgspec.structs.replace(config or AUDIT_CONFIG, backend=backend)
    token = secrets.token_hex(8)
    marker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(600)", f"agentroll-audit-{token}"
    )
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    # not named after the token: the probe gets its path in argv and scans cmdlines for it
    tmp_marker = Path(tempfile.gettempdir()) / f"agentroll-audit-tmp-{secrets.token_hex(8)}"
    tmp_marker.write_text("host /tmp")
    host = Host(
        token=f"agentroll-audit-{token}",
        marker_pid=marker.pid,
        port=listener.getsockname()[1],
        tmp_marker=tmp_marker,
        secrets=_host_secrets(),
        sockets=_host_sockets(),
        config=cfg,
    )
    findings: list[Finding] = []
    try:
        for name in probes or list(PROBES):
            async with open_sandbox(cfg, episode_id=f"audit-{name}") as sandbox:
                started = time.monotonic()
                try:
                    finding = await PROBES[name](sandbox, host)
                except Exception as exc:  # a probe that breaks the sandbox is a finding too
                    finding = Finding(name, "escaped", f"probe failed: {exc!r}")
                finding = Finding(
                    finding.probe,
                    finding.status,
                    f"{finding.detail} ({time.monotonic() - started:.1f}s)",
                )
            findings.append(finding)
            if on_finding is not None:
                on_finding(finding)
    finally:
        marker.kill()
        await marker.wait()
        listener.close()
        tmp_marker.unlink(missing_ok=True)
    return findings


def main_audit(
    backend: str, *, docker_host: str | None = None, probes: list[str] | None = None
) -> int:
    """Print one ``probe=... status=...`` line per probe and a summary; 1 if any escaped or
    was unbounded."""
    config = AUDIT_CONFIG
    if backend == "docker" and docker_host:
        config = msgspec.structs.replace(config, options={"docker_host": docker_host})
    unknown = set(probes or ()) - set(PROBES)
    if unknown:
        raise SystemExit(f"unknown probes {sorted(unknown)}; choose from {sorted(PROBES)}")
    print(f"auditing the {backend} sandbox: {len(probes or PROBES)} probes", file=sys.stderr)
    findings = asyncio.run(
        audit(
            backend, config=config, probes=probes, on_finding=lambda f: print(f.line(), flush=True)
        )
    )
    bad = [f for f in findings if f.status != "contained"]
    print(
        f"backend={backend} probes={len(findings)} contained={len(findings) - len(bad)} "
        f"escaped={sum(f.status == 'escaped' for f in bad)} "
        f"unbounded={sum(f.status == 'unbounded' for f in bad)}"
    )
    return 1 if bad else 0
