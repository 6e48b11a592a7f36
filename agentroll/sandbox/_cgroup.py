"""Per-sandbox cgroups of the local sandbox: totals of memory, pids and CPU, and a kill that
reaches every process a command started, on cgroup v1 and v2.

Invariants: killing a command kills exactly its processes (a ``setsid`` or double fork does
not leave a cgroup); a group is only written through files under ``root``; a host without
usable cgroups gives ``None`` from ``open_cgroups`` and the caller warns, never silently.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("agentroll.sandbox")

_ROOT = Path("/sys/fs/cgroup")
_PARENT = "agentroll"
_V1_CONTROLLERS = ("memory", "pids", "cpu")
_CPU_PERIOD_US = 100_000
_KILL_ROUNDS = 50  # each round kills all members; only children forked meanwhile remain


class Cgroups:
    """The cgroup directories of one sandbox, one per hierarchy that holds a limit.

    ``procs`` lists the ``cgroup.procs`` files a new exec's leader writes its pid into
    (memory and CPU at the sandbox level, pids in the exec's own child group).
    """

    def __init__(self, version: int, dirs: dict[str, Path]) -> None:
        self.version = version
        self.dirs = dirs  # controller ("memory", "pids", "cpu"; "unified" on v2) -> directory

    @property
    def _pids_dir(self) -> Path:
        return self.dirs["unified" if self.version == 2 else "pids"]

    @property
    def joins(self) -> list[Path]:
        """The ``cgroup.procs`` files that put a process in the sandbox's groups."""
        return [d / "cgroup.procs" for d in self.dirs.values()]

    def exec_group(self, n: int) -> tuple[Path, list[Path]]:
        """Create exec ``n``'s child group; returns it and the ``cgroup.procs`` files to join."""
        child = self._pids_dir / f"exec-{n}"
        child.mkdir(exist_ok=True)
        joins = [child / "cgroup.procs"]
        if self.version == 1:
            joins += [d / "cgroup.procs" for c, d in self.dirs.items() if c != "pids"]
        return child, joins

    def kill_exec(self, child: Path) -> bool:
        """SIGKILL every process of an exec's group and remove the group; True when it is
        empty afterwards (False only if processes kept appearing for all rounds)."""
        empty = kill_members(child)
        remove_dir(child)
        return empty

    def kill_all(self) -> None:
        """SIGKILL every process in the sandbox's groups (all execs)."""
        for directory in self.dirs.values():
            for child in _subdirs(directory):
                kill_members(child)
            kill_members(directory)

    def remove(self) -> None:
        """Kill what is left and remove the groups (children first)."""
        self.kill_all()
        for directory in self.dirs.values():
            for child in _subdirs(directory):
                remove_dir(child)
            remove_dir(directory)

    def memory_peak(self) -> int | None:
        """Bytes of the sandbox's peak memory use, where the host reports it."""
        directory = self.dirs.get("memory" if self.version == 1 else "unified")
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((directory / name).read_text()) if directory else None
        except (OSError, ValueError):
            return None


def _subdirs(directory: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _members(directory: Path) -> list[int]:
    try:
        return [int(p) for p in (directory / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def kill_members(
    directory: Path, *, kill: Callable[[int, int], None] = os.kill, rounds: int = _KILL_ROUNDS
) -> bool:
    """SIGKILL the members of ``directory`` until none is left; True when empty.  A v2
    group with ``cgroup.kill`` is killed by the kernel in one write."""
    cgroup_kill = directory / "cgroup.kill"
    if cgroup_kill.exists():
        with contextlib.suppress(OSError):
            cgroup_kill.write_text("1")
    for _ in range(rounds):
        pids = _members(directory)
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)
        time.sleep(0.001)  # killed processes leave the group when they exit, not at once
    return not _members(directory)


def remove_dir(directory: Path, *, attempts: int = 100) -> None:
    """rmdir a group, waiting briefly for killed members to exit (EBUSY meanwhile)."""
    for _ in range(attempts):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                log.debug("cannot remove cgroup %s: %s", directory, exc)
                return
            kill_members(directory, rounds=1)
            time.sleep(0.002)
    log.debug("cgroup %s stayed busy; left for the reaper", directory)


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _v2_base(root: Path) -> Path | None:
    """Where sandbox groups go on a unified hierarchy: a sibling of our own group whose
    parent delegates memory, pids and cpu (the "no internal processes" rule forbids
    controllers on a group that holds processes, so not under our own group)."""
    try:
        line = next(
            ln for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln.startswith("0::")
        )
    except (OSError, StopIteration):
        return None
    own = root / line[3:].lstrip("/")
    parent = own.parent if own != root else root
    try:
        enabled = (parent / "cgroup.subtree_control").read_text().split()
        if not {"memory", "pids", "cpu"} <= set(enabled):
            _write(parent / "cgroup.subtree_control", "+memory +pids +cpu")
        base = parent / _PARENT
        base.mkdir(exist_ok=True)
        _write(base / "cgroup.subtree_control", "+memory +pids +cpu")
    except OSError as exc:
        log.debug("cgroup v2 at %s is not delegated to us: %s", parent, exc)
        return None
    return base


def detect(root: Path = _ROOT) -> int | None:
    """The cgroup version we can create limited groups on (1 or 2), None if neither."""
    if (root / "cgroup.controllers").is_file():
        return 2 if _v2_base(root) is not None else None
    if all(os.access(root / c, os.W_OK) for c in _V1_CONTROLLERS):
        return 1
    return None


def open_cgroups(
    name: str, *, memory_bytes: int, pids: int, cpus: float, root: Path = _ROOT
) -> Cgroups | None:
    """Create the groups of one sandbox with its limits; None if the host has no usable
    cgroups (not root, read-only ``/sys/fs/cgroup``, v2 without delegation).

    Each sandbox gets one group (``agentroll/<owner>-<n>``) with its limits, and each exec a
    child group in the pids hierarchy.  On cgroup v1 there is one hierarchy per controller; on
    v2 one unified hierarchy with the controllers delegated to our subtree.
    """
    version = detect(root)
    if version is None:
        return None
    quota = max(1000, int(cpus * _CPU_PERIOD_US))
    dirs: dict[str, Path] = {}
    try:
        if version == 1:
            for controller in _V1_CONTROLLERS:
                directory = root / controller / _PARENT / name
                directory.mkdir(parents=True, exist_ok=True)
                dirs[controller] = directory
            memory = dirs["memory"]
            _write(memory / "memory.limit_in_bytes", str(memory_bytes))
            if (memory / "memory.memsw.limit_in_bytes").exists():  # no swap beyond the limit
                _write(memory / "memory.memsw.limit_in_bytes", str(memory_bytes))
            _write(dirs["pids"] / "pids.max", str(pids))
            _write(dirs["cpu"] / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
            _write(dirs["cpu"] / "cpu.cfs_quota_us", str(quota))
        else:
            base = _v2_base(root)
            if base is None:
                return None
            directory = base / name
            directory.mkdir(exist_ok=True)
            dirs["unified"] = directory
            _write(directory / "memory.max", str(memory_bytes))
            if (directory / "memory.swap.max").exists():
                _write(directory / "memory.swap.max", "0")
            _write(directory / "pids.max", str(pids))
            _write(directory / "cpu.max", f"{quota} {_CPU_PERIOD_US}")
    except OSError as exc:
        log.debug("cannot create sandbox cgroups %s: %s", name, exc)
        Cgroups(version, dirs).remove()
        return None
    return Cgroups(version, dirs)


def reap_cgroups(alive: Callable[[str], bool], root: Path = _ROOT) -> list[Path]:
    """Remove sandbox groups whose owner (the name's prefix before the last ``-``) is gone;
    ``alive(owner)`` decides.  Returns the removed directories.  Blocking."""
    removed: list[Path] = []
    parents = [root / c / _PARENT for c in _V1_CONTROLLERS]
    if (root / "cgroup.controllers").is_file():
        parents = [p / _PARENT for p in (root, *_subdirs(root))]
    for parent in parents:
        for group in _subdirs(parent):
            owner = group.name.rsplit("-", 1)[0]
            if alive(owner):
                continue
            Cgroups(1, {"x": group}).remove()
            if not group.exists():
                removed.append(group)
    return removed
