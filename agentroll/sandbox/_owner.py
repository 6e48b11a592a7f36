"""Process identity on this host, shared by the docker and local sandboxes' reapers.

A process is named by ``(pid, start ticks)`` from ``/proc/PID/stat``: a pid the kernel
hands to a new process later has other start ticks, so a reused pid never makes a dead
owner look alive.  Invariant: ``owner_alive`` is False only when the process is provably
gone (no such pid, or the pid now belongs to a process that started at another time).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

HOST = socket.gethostname()


def start_ticks(pid: int) -> str:
    """Start time of ``pid`` in clock ticks since boot, as text (``""`` if unknown)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def owner_alive(pid: int, ticks: str) -> bool:
    """Whether the process ``pid`` that started at ``ticks`` still runs here."""
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
