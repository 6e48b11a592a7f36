"""Process identity on this host, shared by the docker and local sandboxes' reapers.

A process is named by ``(pid, start ticks)`` and ``HOST`` tags the pid namespace and boot.
Invariant: ``owner_alive`` is False only when the process is provably gone (no such pid, or
the pid now belongs to a process that started at another time), and it is only asked about
owners whose ``HOST`` is ours.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path


def _pid_space() -> str:
    """A short tag of this process's pid namespace and of the boot (``""`` when /proc says
    neither: then a host name alone is all there is)."""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    if not namespace and not boot:
        return ""
    return hashlib.blake2s(f"{namespace}/{boot}".encode(), digest_size=4).hexdigest()


#: this process's pid space: host name, then ``~`` and the namespace/boot tag
HOST = socket.gethostname() + (f"~{tag}" if (tag := _pid_space()) else "")


def start_ticks(pid: int) -> str:
    """Start time of ``pid`` in clock ticks since boot, as text (``""`` if unknown)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def owner_alive(pid: int, ticks: str) -> bool:
    """Whether the process ``pid`` that started at ``ticks`` still runs here.

    The start ticks come from ``/proc/PID/stat``: a pid the kernel hands to a new process later
    has other start ticks, so a reused pid never makes a dead owner look alive.  A pid means
    something only in its pid namespace and boot, so ``HOST`` is the host name plus a tag of
    both: two containers of one Kubernetes pod share a host name (and perhaps a docker socket
    or a /tmp volume) but not their pids, and neither may take the other's processes for dead.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start_ticks(pid) == ticks


_me: tuple[int, str] | None = None


def me() -> tuple[int, str]:
    """This process's ``(pid, start ticks)`` (recomputed in a forked child)."""
    global _me
    if _me is None or _me[0] != os.getpid():
        _me = (os.getpid(), start_ticks(os.getpid()))
    return _me
